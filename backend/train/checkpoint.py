"""SGLang-format draft checkpoints: atomic save (temp dir, fsync, rename or swap, `latest` pointer), listing, strict load, export.

A save checks the free space against an estimate of what it writes first and says "disk full: N bytes
needed, M free" (before writing, or when a write fails mid-save); a failed save removes its temp dir
and leaves `latest` as it was. training_state.pt holds only tensors, dicts, lists, tuples, numbers,
strings and None, and is loaded with torch.load(weights_only=True).
"""

from __future__ import annotations

import errno
import json
import os
import pickle
import secrets
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

import torch

from backend.layout import (
    CHECKPOINT_NAME,
    CHECKPOINTS_DIR,
    CONFIG_FILE,
    LATEST_FILE,
    STATE_FILE,
    WEIGHTS_FILE,
    checkpoint_name,
    checkpoints_dir_of,
    latest_checkpoint,
    list_checkpoints,
)
from backend.durable import free_bytes, fsync_path
from backend.host.disk import dir_size
from backend.train.draft import CONSOLE_BLOCK, DraftModelConfig, Eagle3Draft
from backend.train.fsutil import (
    PRIVATE_DIR,
    ForeignPathError,
    copy_new_file,
    exchange_paths,
    open_new_file,
    pid_alive,
    private_dir,
    staging_dir,
    symlink_at_or_under,
    write_new_file,
)

TEMP_PREFIX = ".tmp-"
NAME_PATTERN = CHECKPOINT_NAME
NOT_SAVED = ("embed_tokens.weight",)  # loaded from the target, as SGLang does


class CheckpointError(ValueError):
    """A checkpoint directory is missing files, or its tensors do not match its config."""


class CheckpointDiskFullError(OSError):
    """A save refused (or cut short) for lack of space: `needed` bytes (estimated), `free` bytes at that moment."""

    def __init__(self, directory: Path, needed: int, free: int | None, message: str):
        super().__init__(errno.ENOSPC, message, str(directory))
        self.directory, self.needed, self.free, self.message = directory, needed, free, message

    def __str__(self) -> str:
        return self.message


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


class ShapeAndDtype(Protocol):
    """What tensor_problems reads of a tensor: a torch.Tensor, or a safetensors slice's header (no data read)."""

    shape: Any
    dtype: torch.dtype


def _kind(tensor: ShapeAndDtype) -> str:
    if tensor.dtype.is_floating_point:
        return "float"
    return {torch.int64: "int64", torch.bool: "bool"}.get(tensor.dtype, str(tensor.dtype))


def tensor_problems(tensors: Mapping[str, ShapeAndDtype], config: DraftModelConfig) -> list[str]:
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


def draft_tensors(draft: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The tensors a checkpoint holds (no embed_tokens), detached, on CPU, contiguous."""
    module = _unwrap(draft)
    return {name: tensor.detach().to("cpu").contiguous() for name, tensor in module.state_dict().items() if name not in NOT_SAVED}


def _unwrap(draft):
    for attribute in ("_orig_mod", "module"):  # torch.compile / DDP wrappers
        while hasattr(draft, attribute) and isinstance(getattr(draft, attribute), torch.nn.Module):
            draft = getattr(draft, attribute)
    return draft


# --- what training_state.pt may hold ---------------------------------------------------------------


def plain_state(value, where: str = "training_state"):
    """A copy of `value` that torch.load(weights_only=True) reads back: tensors (detached), dicts, lists,
    tuples, bool/int/float/str/None. Paths become strings, numpy scalars numbers, numpy arrays tensors,
    dtypes and devices strings; anything else raises CheckpointError naming where it sits."""
    if isinstance(value, torch.Tensor):
        return value.detach()
    if value is None or isinstance(value, (bool, int, float, str)):
        return _plain_leaf(value)
    if isinstance(value, Mapping):
        plain = {}
        for key, item in value.items():
            if not (key is None or isinstance(key, (bool, int, float, str))):
                raise CheckpointError(f"{where}: key {key!r} is a {type(key).__name__}; keys must be strings or numbers. Nothing was saved.")
            plain[_plain_leaf(key)] = plain_state(item, f"{where}[{key!r}]")
        return plain
    if isinstance(value, (list, tuple)):
        items = [plain_state(item, f"{where}[{index}]") for index, item in enumerate(value)]
        return items if isinstance(value, list) else tuple(items)
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    if isinstance(value, (torch.dtype, torch.device)):
        return str(value)
    if type(value).__module__ == "numpy" and hasattr(value, "tolist"):
        return value.item() if getattr(value, "ndim", 0) == 0 else torch.from_numpy(value.copy())
    raise CheckpointError(
        f"{where} is a {type(value).__module__}.{type(value).__qualname__}; training_state.pt holds only "
        "tensors, dicts, lists, tuples, numbers, strings and None (it is loaded with weights_only=True). "
        "Nothing was saved."
    )


def _plain_leaf(value):
    for kind in (bool, int, float, str):  # numpy.float64 is a float subclass: save the builtin
        if isinstance(value, kind):
            return kind(value)
    return value


def _state_parts(value, tensors: list[torch.Tensor]) -> int:
    """Collect the tensors of a plain state and return a generous byte estimate of everything else in it."""
    if isinstance(value, torch.Tensor):
        tensors.append(value)
        return 64
    if isinstance(value, dict):
        return 16 + sum(_state_parts(k, tensors) + _state_parts(v, tensors) for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return 16 + sum(_state_parts(item, tensors) for item in value)
    return 16 + len(repr(value))


BLOCK = 4096


def _blocks(size: int) -> int:
    return -(-size // BLOCK) * BLOCK


def estimate_checkpoint_bytes(tensors: dict[str, torch.Tensor], state, config_bytes: int) -> int:
    """Upper estimate of the disk a save takes: config.json, model.safetensors, training_state.pt, `latest`,
    each rounded up to 4 KiB blocks, plus a few blocks for directory entries."""
    weights = 8 + 256 + sum(t.numel() * t.element_size() + len(name) + 96 for name, t in tensors.items())
    held: list[torch.Tensor] = []
    other = _state_parts(state, held)
    storages: dict[tuple, int] = {}
    for tensor in held:  # torch.save writes each storage once, whole (a view saves its base)
        storage = tensor.untyped_storage()
        storages[(tensor.device.type, storage.data_ptr(), storage.nbytes())] = storage.nbytes()
    state_bytes = 8192 + other + sum(nbytes + 256 for nbytes in storages.values())
    return _blocks(config_bytes) + _blocks(weights) + _blocks(state_bytes) + 4 * BLOCK


# --- durable file operations -----------------------------------------------------------------------


def write_json_durably(path: Path, data: dict) -> None:
    write_bytes_durably(path, _json_bytes(data))


def _json_bytes(data: dict) -> bytes:
    return (json.dumps(data, indent=2) + "\n").encode()


def write_bytes_durably(path: Path, data: bytes) -> None:
    """A new file (every caller writes a fresh temp name): create-only, never through a symbolic link, fsynced."""
    write_new_file(path, data)


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
    """Not durable.write_atomic: the temp carries this dir's TEMP_PREFIX and owner pid, so clean_stale_temps removes
    what a SIGKILLed save left (benchmarks/kill_checkpoint.py)."""
    temp = checkpoints_dir / _temp_name("latest")
    try:
        write_bytes_durably(temp, (name + "\n").encode())
        os.replace(temp, checkpoints_dir / LATEST_FILE)
    except BaseException:
        temp.unlink(missing_ok=True)
        raise
    fsync_path(checkpoints_dir)


def _latest_name(checkpoints_dir: Path) -> str | None:
    try:
        name = (checkpoints_dir / LATEST_FILE).read_text().strip()
    except (OSError, UnicodeDecodeError):
        return None
    return name or None


# --- save ----------------------------------------------------------------------------------------


def save_checkpoint(
    run_out_dir: str | Path,
    draft: torch.nn.Module,  # an Eagle3Draft, or the trainer's view of it with fp32 master weights
    config: DraftModelConfig,
    *,
    epoch: int,
    step: int,
    training_state: dict | None,
    extra_meta: dict | None = None,
    check_space: bool = True,
) -> Path:
    """Write run_out_dir/checkpoints/epoch_E_step_S/ atomically and point checkpoints/latest at it.

    Files go into a temp dir beside it, each is fsynced, then the dir, then it is renamed into place (or,
    when that step was saved before, swapped with the old dir in one atomic exchange) and `latest` is
    replaced the same way. A kill at any moment leaves `latest` naming a complete checkpoint (or absent,
    before the first save). Free space is checked against an estimate first; on a full disk (then or
    mid-save) CheckpointDiskFullError says "disk full: N bytes needed, M free", the temp dir is removed and
    `latest` is left as it was. training_state must hold only tensors, dicts, lists, tuples, numbers,
    strings and None (see plain_state). check_space=False skips the up-front check (tests of the
    mid-save path). extra_meta lands in config.json's eagle3_console block.
    """
    from safetensors.torch import save_file

    checkpoints_dir = Path(run_out_dir) / CHECKPOINTS_DIR
    private_checkpoints_dir(checkpoints_dir)
    clean_stale_temps(checkpoints_dir)
    name = checkpoint_name(epoch, step)
    tensors = draft_tensors(draft)
    problems = tensor_problems(tensors, config)
    if problems:
        raise CheckpointError(f"draft does not match its config ({'; '.join(problems)}); nothing was saved")
    state = plain_state(training_state if training_state is not None else {})
    meta = {"epoch": epoch, "step": step, **(extra_meta or {})}
    config_bytes = _json_bytes(config.to_hf_config(meta))
    needed = estimate_checkpoint_bytes(tensors, state, len(config_bytes))
    free = free_bytes(checkpoints_dir)
    if check_space and free is not None and free < needed:
        raise CheckpointDiskFullError(checkpoints_dir, needed, free, _full_message(checkpoints_dir, name, needed, free, "nothing was written"))
    temp = checkpoints_dir / _temp_name(name)
    temp.mkdir(mode=PRIVATE_DIR)
    placed = False
    try:
        write_bytes_durably(temp / CONFIG_FILE, config_bytes)
        open_new_file(temp / WEIGHTS_FILE).close()  # created 0600 first: safetensors rewrites it and keeps the mode
        save_file(tensors, str(temp / WEIGHTS_FILE), metadata={"format": "pt", "producer": "eagle3-console"})
        fsync_path(temp / WEIGHTS_FILE)
        with open_new_file(temp / STATE_FILE) as handle:
            torch.save(state, handle)
            handle.flush()
            os.fsync(handle.fileno())
        fsync_path(temp)
        _move_into_place(temp, checkpoints_dir / name)
        placed = True
        _write_latest(checkpoints_dir, name)
    except BaseException as exc:
        free_then = free_bytes(checkpoints_dir)
        remaining = needed - (dir_size(temp, max_entries=None, max_seconds=None) or 0)
        shutil.rmtree(temp, ignore_errors=True)
        if isinstance(exc, Exception) and _is_disk_full(exc, free_then, remaining):
            done = f"{name} is complete but `latest` could not be updated" if placed else "the partial checkpoint was removed"
            raise CheckpointDiskFullError(checkpoints_dir, needed, free_then, _full_message(checkpoints_dir, name, needed, free_then, done)) from exc
        raise
    clean_stale_temps(checkpoints_dir)
    return checkpoints_dir / name


def private_checkpoints_dir(checkpoints_dir: Path) -> None:
    """checkpoints/ made, or an existing one tightened, to 0700; refused (CheckpointError) when it is a link or not ours."""
    try:
        private_dir(checkpoints_dir)
    except ForeignPathError as exc:
        raise CheckpointError(f"checkpoints: {exc}") from None


def _full_message(checkpoints_dir: Path, name: str, needed: int, free: int | None, done: str) -> str:
    latest = _latest_name(checkpoints_dir)
    return (
        f"disk full: {needed} bytes needed, {'unknown' if free is None else free} free in {checkpoints_dir}; "
        f"checkpoint {name} was not saved ({done}); `latest` still names "
        f"{latest if latest else 'no checkpoint (none saved yet)'}. Free space there (old checkpoints, "
        "extracted data) and save again."
    )


_FULL_TEXT = ("No space left on device", "os error 28", "Disk quota exceeded", "os error 122")


def _is_disk_full(exc: BaseException, free_then: int | None, remaining: int) -> bool:
    """ENOSPC/EDQUOT anywhere in the chain, the Rust-side texts of safetensors, or (torch.save's opaque
    'unexpected pos' errors) less room left than the rest of the save needed."""
    seen = set()
    error: BaseException | None = exc
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if any(text in str(error) for text in _FULL_TEXT):
            return True
        error = error.__cause__ or error.__context__
    return free_then is not None and free_then < max(remaining, BLOCK)


def _move_into_place(temp: Path, final: Path) -> None:
    """Rename temp -> final. When final exists (the same epoch/step saved again) the two are swapped in
    one atomic exchange, so `latest` never names a missing dir; the old content (now under the temp
    name) is removed. Without RENAME_EXCHANGE, `latest` is first pointed at another complete checkpoint
    (when there is one) before the old dir is moved aside."""
    if final.exists():
        if exchange_paths(temp, final):
            fsync_path(final.parent)
            shutil.rmtree(temp, ignore_errors=True)
            return
        if _latest_name(final.parent) == final.name:
            others = [c for c in list_checkpoints(final.parent) if c.name != final.name]
            if others:
                _write_latest(final.parent, others[-1].name)
        replaced = final.parent / _temp_name(f"replaced-{final.name}")
        os.rename(final, replaced)
        os.rename(temp, final)
        fsync_path(final.parent)
        shutil.rmtree(replaced, ignore_errors=True)
        return
    os.rename(temp, final)
    fsync_path(final.parent)


# --- find ----------------------------------------------------------------------------------------

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
        hint = (
            " (it looks like a run or checkpoints dir: use latest_checkpoint())" if checkpoints_dir_of(ckpt_dir).is_dir() and list_checkpoints(ckpt_dir) else ""
        )
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
    training_state = load_training_state(ckpt_dir / STATE_FILE, map_location)
    return draft, config, dict(hf_config.get(CONSOLE_BLOCK) or {}), training_state


def load_training_state(path: Path, map_location: str | torch.device = "cpu") -> dict | None:
    """training_state.pt read with weights_only=True (no arbitrary unpickling); None when absent."""
    if not path.is_file():
        return None
    try:
        state = torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise CheckpointError(
            f"{path} holds objects other than tensors and plain containers ({first}); it was not unpickled, "
            "nothing was loaded. Re-save it with this version's trainer, or load it yourself with "
            "torch.load(weights_only=False) if you trust where it came from."
        ) from None
    except (RuntimeError, EOFError, OSError) as exc:
        raise CheckpointError(f"{path} is unreadable ({exc}); nothing was loaded") from None
    if not isinstance(state, dict):
        raise CheckpointError(f"{path} holds a {type(state).__name__}, not a dict; nothing was loaded")
    return state


# --- export --------------------------------------------------------------------------------------


def export_checkpoint(checkpoint: Path, destination: Path) -> Path:
    """Copy the serving files of a checkpoint into a new or empty dir, verifying the key set and shapes first.

    The files go into a staging dir beside the destination and are renamed into place: a failure leaves nothing.
    A destination that is, or holds, a symbolic link is refused before anything is written, and no write ever
    follows a link (create-only opens with O_NOFOLLOW; the rename replaces no link).
    """
    from safetensors import safe_open

    source = Path(checkpoint).expanduser()
    if not (source / WEIGHTS_FILE).is_file():
        found = latest_checkpoint(source)
        if found is None:
            raise CheckpointError(f"{source} is neither a checkpoint nor a run dir with checkpoints; nothing was exported")
        source = found
    config = DraftModelConfig.from_hf_config(read_config(source))
    with safe_open(str(source / WEIGHTS_FILE), framework="pt") as handle:
        shapes = {key: _Shape(handle.get_slice(key)) for key in handle.keys()}
    problems = tensor_problems(shapes, config)
    if problems:
        raise CheckpointError(f"{source} does not match its config.json: {'; '.join(problems)}; nothing was exported")
    destination = Path(destination).expanduser()
    link = symlink_at_or_under(destination)
    if link is not None:
        raise CheckpointError(
            f"{link} is a symbolic link; export writes only into a real, new or empty directory and never follows a link; nothing was exported"
        )
    if destination.exists() and (not destination.is_dir() or any(destination.iterdir())):
        raise CheckpointError(f"{destination} exists and is not an empty directory; nothing was exported")
    try:
        _export_files(source, destination)
    except OSError as exc:
        raise CheckpointError(f"could not export into {destination}: {exc.strerror or exc}; nothing was exported") from None
    return destination


def _export_files(source: Path, destination: Path) -> None:
    destination.parent.mkdir(parents=True, exist_ok=True)
    staging = staging_dir(destination.parent, f".{destination.name}.export-")
    try:
        for name in (CONFIG_FILE, WEIGHTS_FILE):
            copy_new_file(source / name, staging / name)
        fsync_path(staging)
        if destination.exists():
            destination.rmdir()  # empty (checked); a link put there since is not a dir and fails, untouched
        os.rename(staging, destination)  # onto a link that appeared since: ENOTDIR, never through it
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    fsync_path(destination.parent)


class _Shape:
    """A safetensors slice seen as a tensor by tensor_problems (shape and dtype, no data read)."""

    def __init__(self, tensor_slice):
        self.shape = tuple(tensor_slice.get_shape())
        names = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "I64": torch.int64, "BOOL": torch.bool}
        self.dtype = names.get(tensor_slice.get_dtype(), torch.uint8)
