"""SGLang-format draft checkpoints: atomic save (temp dir, fsync, rename, `latest` pointer), listing, strict load."""
from __future__ import annotations

import json
import os
import re
import secrets
import shutil
from pathlib import Path

import torch

from backend.train.draft import CONSOLE_BLOCK, DraftModelConfig, Eagle3Draft
from backend.train.fsutil import fsync_path, pid_alive

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
STATE_FILE = "training_state.pt"
LATEST_FILE = "latest"
CHECKPOINTS_DIR = "checkpoints"
TEMP_PREFIX = ".tmp-"
NAME_PATTERN = re.compile(r"^epoch_(\d+)_step_(\d+)$")
NOT_SAVED = ("embed_tokens.weight",)  # loaded from the target, as SGLang does


class CheckpointError(ValueError):
    """A checkpoint directory is missing files, or its tensors do not match its config."""


def checkpoint_name(epoch: int, step: int) -> str:
    return f"epoch_{epoch}_step_{step}"


def expected_tensors(config: DraftModelConfig) -> dict[str, tuple[tuple[int, ...], str]]:
    """Every key of model.safetensors with its shape and kind ('float', 'int64', 'bool'): reference section 2.3."""
    h, i = config.hidden_size, config.intermediate_size
    q_rows = config.num_attention_heads * config.head_dim
    kv_rows = config.num_key_value_heads * config.head_dim
    return {
        "fc.weight": ((h, config.aux_width), "float"),
        "midlayer.self_attn.q_proj.weight": ((q_rows, 2 * h), "float"),
        "midlayer.self_attn.k_proj.weight": ((kv_rows, 2 * h), "float"),
        "midlayer.self_attn.v_proj.weight": ((kv_rows, 2 * h), "float"),
        "midlayer.self_attn.o_proj.weight": ((h, q_rows), "float"),
        "midlayer.mlp.gate_proj.weight": ((i, h), "float"),
        "midlayer.mlp.up_proj.weight": ((i, h), "float"),
        "midlayer.mlp.down_proj.weight": ((h, i), "float"),
        "midlayer.input_layernorm.weight": ((h,), "float"),
        "midlayer.hidden_norm.weight": ((h,), "float"),
        "midlayer.post_attention_layernorm.weight": ((h,), "float"),
        "norm.weight": ((h,), "float"),
        "lm_head.weight": ((config.draft_vocab_size, h), "float"),
        "d2t": ((config.draft_vocab_size,), "int64"),
        "t2d": ((config.vocab_size,), "bool"),
    }


def _kind(tensor: torch.Tensor) -> str:
    if tensor.dtype.is_floating_point:
        return "float"
    return {torch.int64: "int64", torch.bool: "bool"}.get(tensor.dtype, str(tensor.dtype))


def tensor_problems(tensors: dict[str, torch.Tensor], config: DraftModelConfig) -> list[str]:
    """Missing keys, unexpected keys, shape and dtype mismatches against `expected_tensors(config)`."""
    expected = expected_tensors(config)
    problems = []
    missing = sorted(set(expected) - set(tensors))
    unexpected = sorted(set(tensors) - set(expected))
    if missing:
        problems.append(f"missing keys: {', '.join(missing)}")
    if unexpected:
        problems.append(f"unexpected keys: {', '.join(unexpected)}")
    for name in sorted(set(expected) & set(tensors)):
        shape, kind = expected[name]
        got = tensors[name]
        if tuple(got.shape) != shape:
            problems.append(f"{name}: shape {list(got.shape)}, config says {list(shape)}")
        elif _kind(got) != kind:
            problems.append(f"{name}: dtype {got.dtype}, expected {kind}")
    return problems


def draft_tensors(draft: Eagle3Draft) -> dict[str, torch.Tensor]:
    """The tensors a checkpoint holds (no embed_tokens), detached, on CPU, contiguous."""
    module = _unwrap(draft)
    return {
        name: tensor.detach().to("cpu").contiguous()
        for name, tensor in module.state_dict().items()
        if name not in NOT_SAVED
    }


def _unwrap(draft):
    for attribute in ("_orig_mod", "module"):  # torch.compile / DDP wrappers
        while hasattr(draft, attribute) and isinstance(getattr(draft, attribute), torch.nn.Module):
            draft = getattr(draft, attribute)
    return draft


# --- durable file operations -----------------------------------------------------------------------

def write_json_durably(path: Path, data: dict) -> None:
    with open(path, "w") as handle:
        json.dump(data, handle, indent=2)
        handle.write("\n")
        handle.flush()
        os.fsync(handle.fileno())


def _temp_name(label: str) -> str:
    return f"{TEMP_PREFIX}{label}-{os.getpid()}-{secrets.token_hex(4)}"


def _owner_pid(temp_name: str) -> int | None:
    try:
        return int(temp_name.rsplit("-", 2)[1])
    except (IndexError, ValueError):
        return None


def clean_stale_temps(checkpoints_dir: Path) -> list[Path]:
    """Remove temp dirs/files left by saves whose process is gone (e.g. SIGKILLed mid-save)."""
    removed = []
    for entry in checkpoints_dir.glob(f"{TEMP_PREFIX}*"):
        pid = _owner_pid(entry.name)
        if pid is not None and pid_alive(pid) and pid != os.getpid():
            continue  # another live process is saving right now
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry, ignore_errors=True)
        else:
            entry.unlink(missing_ok=True)
        removed.append(entry)
    return removed


def _write_latest(checkpoints_dir: Path, name: str) -> None:
    temp = checkpoints_dir / _temp_name("latest")
    with open(temp, "w") as handle:
        handle.write(name + "\n")
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(temp, checkpoints_dir / LATEST_FILE)
    fsync_path(checkpoints_dir)


# --- save ----------------------------------------------------------------------------------------

def save_checkpoint(
    run_out_dir: str | Path,
    draft: Eagle3Draft,
    config: DraftModelConfig,
    *,
    epoch: int,
    step: int,
    training_state: dict | None,
    extra_meta: dict | None = None,
) -> Path:
    """Write run_out_dir/checkpoints/epoch_E_step_S/ atomically and point checkpoints/latest at it.

    Files go into a temp dir beside it, each is fsynced, then the dir, then it is renamed into place
    and `latest` is replaced the same way. A kill at any moment leaves `latest` naming a complete
    checkpoint (or absent, before the first save). extra_meta lands in config.json's eagle3_console block.
    """
    from safetensors.torch import save_file

    checkpoints_dir = Path(run_out_dir) / CHECKPOINTS_DIR
    checkpoints_dir.mkdir(parents=True, exist_ok=True)
    clean_stale_temps(checkpoints_dir)
    name = checkpoint_name(epoch, step)
    tensors = draft_tensors(draft)
    problems = tensor_problems(tensors, config)
    if problems:
        raise CheckpointError(f"draft does not match its config ({'; '.join(problems)}); nothing was saved")
    temp = checkpoints_dir / _temp_name(name)
    temp.mkdir()
    try:
        meta = {"epoch": epoch, "step": step, **(extra_meta or {})}
        write_json_durably(temp / CONFIG_FILE, config.to_hf_config(meta))
        save_file(tensors, str(temp / WEIGHTS_FILE), metadata={"format": "pt", "producer": "eagle3-console"})
        fsync_path(temp / WEIGHTS_FILE)
        with open(temp / STATE_FILE, "wb") as handle:
            torch.save(training_state if training_state is not None else {}, handle)
            handle.flush()
            os.fsync(handle.fileno())
        fsync_path(temp)
        _move_into_place(temp, checkpoints_dir / name)
        _write_latest(checkpoints_dir, name)
    except BaseException:
        shutil.rmtree(temp, ignore_errors=True)
        raise
    clean_stale_temps(checkpoints_dir)
    return checkpoints_dir / name


def _move_into_place(temp: Path, final: Path) -> None:
    """Rename temp -> final; an existing final (same epoch/step saved again) is moved aside first."""
    replaced = None
    if final.exists():
        replaced = final.parent / _temp_name(f"replaced-{final.name}")
        os.rename(final, replaced)
    os.rename(temp, final)
    fsync_path(final.parent)
    if replaced is not None:
        shutil.rmtree(replaced, ignore_errors=True)


# --- find ----------------------------------------------------------------------------------------

def checkpoints_dir_of(path: str | Path) -> Path:
    """Accept a run output dir (holding checkpoints/) or the checkpoints dir itself."""
    path = Path(path)
    return path / CHECKPOINTS_DIR if (path / CHECKPOINTS_DIR).is_dir() else path


def is_complete(checkpoint_dir: Path) -> bool:
    return (checkpoint_dir / CONFIG_FILE).is_file() and (checkpoint_dir / WEIGHTS_FILE).is_file()


def list_checkpoints(path: str | Path) -> list[Path]:
    """Complete epoch_E_step_S dirs, oldest first by (epoch, step); temp dirs are never listed."""
    directory = checkpoints_dir_of(path)
    if not directory.is_dir():
        return []
    found = []
    for entry in directory.iterdir():
        match = NAME_PATTERN.match(entry.name)
        if match and entry.is_dir() and is_complete(entry):
            found.append(((int(match[1]), int(match[2])), entry))
    return [entry for _, entry in sorted(found)]


def latest_checkpoint(path: str | Path) -> Path | None:
    """The checkpoint `latest` names; if that is absent or incomplete, the newest complete one; else None."""
    directory = checkpoints_dir_of(path)
    try:
        name = (directory / LATEST_FILE).read_text().strip()
    except (FileNotFoundError, NotADirectoryError):
        name = ""
    candidate = directory / name
    if name and NAME_PATTERN.match(name) and is_complete(candidate):
        return candidate
    listed = list_checkpoints(directory)
    return listed[-1] if listed else None


# --- load ----------------------------------------------------------------------------------------

def read_config(checkpoint_dir: Path) -> dict:
    path = checkpoint_dir / CONFIG_FILE
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{path} is not valid JSON ({exc}); nothing was loaded") from None


def load_checkpoint(
    ckpt_dir: str | Path,
    target_embedding: torch.Tensor | None = None,
    map_location: str | torch.device = "cpu",
) -> tuple[Eagle3Draft, DraftModelConfig, dict, dict | None]:
    """Load (draft, config, meta = config.json's eagle3_console block, training_state or None).

    Every key and shape is checked against the config first; any missing, unexpected or misshapen
    tensor raises CheckpointError naming all of them (SGLang would drop them silently).
    """
    from safetensors.torch import load_file

    ckpt_dir = Path(ckpt_dir)
    absent = [name for name in (CONFIG_FILE, WEIGHTS_FILE) if not (ckpt_dir / name).is_file()]
    if absent:
        hint = " (it looks like a run or checkpoints dir: use latest_checkpoint())" if checkpoints_dir_of(ckpt_dir).is_dir() and list_checkpoints(ckpt_dir) else ""
        raise CheckpointError(f"{ckpt_dir} lacks {', '.join(absent)}{hint}; nothing was loaded")
    hf_config = read_config(ckpt_dir)
    config = DraftModelConfig.from_hf_config(hf_config)
    tensors = load_file(str(ckpt_dir / WEIGHTS_FILE), device="cpu")
    problems = tensor_problems(tensors, config)
    if problems:
        raise CheckpointError(f"{ckpt_dir / WEIGHTS_FILE} does not match its config.json: {'; '.join(problems)}; nothing was loaded")
    draft = Eagle3Draft(config)
    draft.to(tensors["fc.weight"].dtype)
    result = draft.load_state_dict(tensors, strict=False)
    leftover = [key for key in result.missing_keys if key not in NOT_SAVED] + list(result.unexpected_keys)
    if leftover:
        raise CheckpointError(f"draft module rejected keys {leftover}; nothing was loaded")
    if target_embedding is not None:
        draft.load_target_embedding(target_embedding.to(draft.fc.weight.dtype))
    draft.to(map_location)
    state_path = ckpt_dir / STATE_FILE
    training_state = torch.load(state_path, map_location=map_location, weights_only=False) if state_path.is_file() else None
    return draft, config, dict(hf_config.get(CONSOLE_BLOCK) or {}), training_state
