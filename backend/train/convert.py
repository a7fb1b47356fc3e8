"""`eagle3-host convert`: repair a draft checkpoint (layers.0.* keys, prefixes, fused weights, alias arch) into SGLang's midlayer.* format."""

from __future__ import annotations

import json
import os
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path
from backend.durable import fsync_path
from backend.train.fsutil import symlink_at_or_under, copy_new_file, staging_dir

KNOWN_PREFIXES = ("draft_model.", "module.", "_orig_mod.", "model.")
LAYER_PREFIX = "layers.0."
ARCHITECTURE = "LlamaForCausalLMEagle3"
ALIASES = ("Eagle3LlamaForCausalLM", "LlamaForCausalLMEagle3")
DROPPED_KEYS = {"embed_tokens.weight": "embeddings come from the target (SGLang's set_embed), never saved"}
PASS_THROUGH = ("training_state.pt",)


class ConvertError(ValueError):
    """The source checkpoint cannot be mapped onto the SGLang format; the destination was not created."""

    exit_code = 1


class UnsafeDestinationError(ConvertError):
    """DST is, or holds, a symbolic link (or became one mid-write): a usage error, exit 2; nothing was written."""

    exit_code = 2


@dataclass
class ConvertReport:
    src: str
    dst: str
    renamed: list[tuple[str, str]] = field(default_factory=list)
    dropped: list[tuple[str, str]] = field(default_factory=list)
    built: list[str] = field(default_factory=list)
    config_changes: list[str] = field(default_factory=list)
    copied_files: list[str] = field(default_factory=list)
    skipped_files: list[str] = field(default_factory=list)
    unchanged_keys: int = 0
    written: bool = False

    def as_dict(self) -> dict:
        return {
            "src": self.src,
            "dst": self.dst,
            "written": self.written,
            "renamed": [list(pair) for pair in self.renamed],
            "dropped": [list(pair) for pair in self.dropped],
            "built": self.built,
            "config_changes": self.config_changes,
            "copied_files": self.copied_files,
            "skipped_files": self.skipped_files,
            "unchanged_keys": self.unchanged_keys,
        }

    def lines(self) -> list[str]:
        out = [f"convert {self.src} -> {self.dst}" + ("" if self.written else " (dry run: nothing written)")]
        out += [f"  renamed  {old} -> {new}" for old, new in self.renamed]
        out += [f"  dropped  {key} ({why})" for key, why in self.dropped]
        out += [f"  built    {what}" for what in self.built]
        out += [f"  config   {change}" for change in self.config_changes]
        out += [f"  copied   {name}" for name in self.copied_files]
        out += [f"  skipped  {name} (not part of a draft checkpoint)" for name in self.skipped_files]
        out.append(f"  {self.unchanged_keys} keys already in SGLang format")
        return out


# --- reading the source ----------------------------------------------------------------------------


def _read_tensors(src: Path) -> dict:
    from safetensors.torch import load_file

    index = src / "model.safetensors.index.json"
    if (src / "model.safetensors").is_file():
        return load_file(str(src / "model.safetensors"))
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        tensors = {}
        for shard in shards:
            tensors.update(load_file(str(src / shard)))
        return tensors
    if (src / "pytorch_model.bin").is_file():
        import torch

        return torch.load(src / "pytorch_model.bin", map_location="cpu", weights_only=True)
    raise ConvertError(f"{src} holds no model.safetensors, model.safetensors.index.json or pytorch_model.bin; nothing was written")


def _source_files(src: Path) -> set[str]:
    names = {"config.json", "model.safetensors", "model.safetensors.index.json", "pytorch_model.bin"}
    index = src / "model.safetensors.index.json"
    if index.is_file():
        names |= set(json.loads(index.read_text())["weight_map"].values())
    return names


# --- key mapping -----------------------------------------------------------------------------------


def _strip_prefixes(key: str) -> str:
    changed = True
    while changed:
        changed = False
        for prefix in KNOWN_PREFIXES:
            if key.startswith(prefix):
                key, changed = key[len(prefix) :], True
    return key


def map_key(key: str) -> str:
    """SpecForge/EAGLE/SGLang-v0.5.14 spellings -> the midlayer.* name (unknown names come back unchanged)."""
    key = _strip_prefixes(key)
    if key.startswith(LAYER_PREFIX):
        key = "midlayer." + key[len(LAYER_PREFIX) :]
    return key


def _split_fused(tensors: dict, config, report: ConvertReport) -> None:
    """SGLang-internal fused tensors (qkv_proj, gate_up_proj) back into the separate projections."""
    q_rows = config.num_attention_heads * config.head_dim
    kv_rows = config.num_key_value_heads * config.head_dim
    fused = {
        "midlayer.self_attn.qkv_proj.weight": [("q_proj", q_rows), ("k_proj", kv_rows), ("v_proj", kv_rows)],
        "midlayer.mlp.gate_up_proj.weight": [("gate_proj", config.intermediate_size), ("up_proj", config.intermediate_size)],
    }
    for name, parts in fused.items():
        if name not in tensors:
            continue
        tensor = tensors.pop(name)
        sizes = [rows for _, rows in parts]
        if tensor.shape[0] != sum(sizes):
            raise ConvertError(f"{name} has {tensor.shape[0]} rows, the config implies {sum(sizes)}; nothing was written")
        base = name.rsplit(".", 2)[0]
        for (part, _), piece in zip(parts, tensor.split(sizes, dim=0)):
            tensors[f"{base}.{part}.weight"] = piece.contiguous()
        report.built.append(f"split {name} into {', '.join(part for part, _ in parts)}")


def _vocab_buffers(tensors: dict, config, report: ConvertReport) -> None:
    import torch

    if "d2t" not in tensors:
        if config.draft_vocab_size != config.vocab_size:
            raise ConvertError(
                f"no d2t in the checkpoint while draft_vocab_size {config.draft_vocab_size} < vocab_size "
                f"{config.vocab_size}: the draft->target token mapping is lost; nothing was written"
            )
        tensors["d2t"] = torch.zeros(config.draft_vocab_size, dtype=torch.int64)
        report.built.append("d2t = zeros (draft vocab == target vocab: identity mapping)")
    if "t2d" not in tensors:
        t2d = torch.zeros(config.vocab_size, dtype=torch.bool)
        t2d[tensors["d2t"].long() + torch.arange(tensors["d2t"].numel())] = True
        tensors["t2d"] = t2d
        report.built.append("t2d from d2t (t2d[d2t[i] + i] = True)")


# --- config ----------------------------------------------------------------------------------------


def fix_config(config: dict, tensors: dict, aux_layer_ids: list[int] | None, report: ConvertReport) -> dict:
    config = json.loads(json.dumps(config))
    archs = config.get("architectures") or []
    arch = archs[0] if archs else None
    if arch != ARCHITECTURE:
        if arch in ALIASES or (arch == "LlamaForCausalLM" and "eagle_config" in config):
            config["architectures"] = [ARCHITECTURE]
            report.config_changes.append(f"architectures {archs} -> [{ARCHITECTURE!r}]")
        else:
            raise ConvertError(
                f"config.json architectures={archs!r} is not a known alias of {ARCHITECTURE} "
                f"(known: {', '.join(ALIASES)}, or LlamaForCausalLM with an eagle_config); nothing was written"
            )
    if config.get("num_hidden_layers", 1) != 1:
        raise ConvertError(f"config.json has num_hidden_layers={config['num_hidden_layers']}; only 1-layer drafts convert; nothing was written")
    if config.get("num_hidden_layers") is None:
        config["num_hidden_layers"] = 1
        report.config_changes.append("num_hidden_layers set to 1")
    if config.get("draft_vocab_size") is None and "lm_head.weight" in tensors:
        config["draft_vocab_size"] = int(tensors["lm_head.weight"].shape[0])
        report.config_changes.append(f"draft_vocab_size set to {config['draft_vocab_size']} (lm_head rows)")
    eagle = dict(config.get("eagle_config") or {})
    if aux_layer_ids is not None and eagle.get("eagle_aux_hidden_state_layer_ids") != list(aux_layer_ids):
        report.config_changes.append(f"eagle_config.eagle_aux_hidden_state_layer_ids {eagle.get('eagle_aux_hidden_state_layer_ids')} -> {list(aux_layer_ids)}")
        eagle["eagle_aux_hidden_state_layer_ids"] = list(aux_layer_ids)
    if not eagle.get("eagle_aux_hidden_state_layer_ids"):
        raise ConvertError(
            "config.json has no eagle_config.eagle_aux_hidden_state_layer_ids, so the layers the draft was trained on "
            "are unknown (SGLang would capture its defaults); pass --aux-layer-ids (output-of-layer ids, e.g. 1,15,28); nothing was written"
        )
    if eagle.get("use_aux_hidden_state") is not True:
        report.config_changes.append(f"eagle_config.use_aux_hidden_state {eagle.get('use_aux_hidden_state')} -> True")
        eagle["use_aux_hidden_state"] = True
    config["eagle_config"] = eagle
    num_aux = len(eagle["eagle_aux_hidden_state_layer_ids"])
    if config.get("target_hidden_size") is None and "fc.weight" in tensors:
        config["target_hidden_size"] = int(tensors["fc.weight"].shape[1]) // num_aux
        report.config_changes.append(f"target_hidden_size set to {config['target_hidden_size']} (fc width / {num_aux})")
    if config.get("tie_word_embeddings"):
        raise ConvertError("config.json says tie_word_embeddings=true: lm_head would be replaced by the embedding; nothing was written")
    return config


# --- the conversion --------------------------------------------------------------------------------


def convert_checkpoint(src, dst, *, aux_layer_ids: list[int] | None = None, dry_run: bool = False) -> ConvertReport:
    """Rewrite the checkpoint in `src` into `dst` (which must not exist) with SGLang's midlayer.* key set.

    Renames layers.0.* / model.layers.0.* / draft_model.* keys, splits fused qkv/gate_up tensors, drops
    embed_tokens, builds t2d from d2t when absent, fixes an alias architecture. Any key it cannot map, or a
    result that does not match the config exactly, is refused with ConvertError and dst stays absent.
    """
    from backend.train.checkpoint import tensor_problems, write_json_durably
    from backend.train.draft import CONSOLE_BLOCK, DraftConfigError, DraftModelConfig

    src, dst = Path(src), Path(dst)
    report = ConvertReport(src=str(src), dst=str(dst))
    if not (src / "config.json").is_file():
        raise ConvertError(f"{src} has no config.json; nothing was written")
    link = symlink_at_or_under(dst)
    if link is not None:
        raise UnsafeDestinationError(f"{link} is a symbolic link; convert writes only a new, real directory and never follows a link (nothing was written)")
    if dst.exists():
        raise ConvertError(f"{dst} already exists; pick a new destination (nothing was written)")
    raw_tensors = _read_tensors(src)
    tensors = {}
    for key, tensor in raw_tensors.items():
        new = map_key(key)
        if new in DROPPED_KEYS:
            report.dropped.append((key, DROPPED_KEYS[new]))
            continue
        if new in tensors:
            raise ConvertError(f"{key} and another key both map to {new}; nothing was written")
        tensors[new] = tensor
        if new != key:
            report.renamed.append((key, new))
        else:
            report.unchanged_keys += 1
    config_json = fix_config(json.loads((src / "config.json").read_text()), tensors, aux_layer_ids, report)
    try:
        config = DraftModelConfig.from_hf_config(config_json)
    except DraftConfigError as exc:
        raise ConvertError(f"{exc} (in {src / 'config.json'}); nothing was written") from None
    _split_fused(tensors, config, report)
    _vocab_buffers(tensors, config, report)
    problems = tensor_problems(tensors, config)
    if problems:
        raise ConvertError(f"cannot map {src} onto the SGLang key set: {'; '.join(problems)}; nothing was written ({dst} not created)")
    block = dict(config_json.get(CONSOLE_BLOCK) or {})
    block.setdefault("trained_aux_width", config.aux_width)
    block.setdefault("trained_aux_layer_ids", list(config.aux_layer_ids))
    block["converted_from"] = str(src)
    config_json[CONSOLE_BLOCK] = block
    present = {entry.name for entry in src.iterdir() if entry.is_file()}
    report.copied_files = sorted(present & set(PASS_THROUGH))
    report.skipped_files = sorted(present - set(PASS_THROUGH) - _source_files(src))
    if dry_run:
        return report
    try:
        _write(dst, config_json, tensors, src, report.copied_files, fsync_path, write_json_durably)
    except OSError as exc:
        what = exc.strerror or str(exc)
        if isinstance(exc, NotADirectoryError) or dst.is_symlink():  # a link put at dst since the check
            raise UnsafeDestinationError(f"{dst} became a symbolic link or file while converting ({what}); nothing was written") from None
        raise ConvertError(f"could not write {dst}: {what}; nothing was written") from None
    report.written = True
    return report


def _write(dst: Path, config_json: dict, tensors: dict, src: Path, copied: list[str], fsync_path, write_json_durably) -> None:
    from safetensors.torch import save_file

    dst.parent.mkdir(parents=True, exist_ok=True)
    temp = staging_dir(dst.parent, f".tmp-convert-{dst.name}-")  # a fresh private name: no old dir or link is reused
    try:
        write_json_durably(temp / "config.json", config_json)  # create-only, never through a link
        save_file({k: v.contiguous() for k, v in sorted(tensors.items())}, str(temp / "model.safetensors"), metadata={"format": "pt"})
        fsync_path(temp / "model.safetensors")
        for name in copied:
            copy_new_file(src / name, temp / name)
        fsync_path(temp)
        os.rename(temp, dst)  # onto a link that appeared since: ENOTDIR, never through it
        fsync_path(dst.parent)
    except BaseException:
        shutil.rmtree(temp, ignore_errors=True)
        raise


# --- command line ----------------------------------------------------------------------------------


def register_convert(subparsers, parent) -> None:
    parser = subparsers.add_parser(
        "convert",
        parents=[parent],
        help="repair a draft checkpoint into SGLang's midlayer.* format",
        description="Rewrite a draft checkpoint saved with layers.0.* / model.layers.0.* / draft_model.* keys "
        "(or an alias architecture) into the key set SGLang loads, printing every rename and drop.",
    )
    parser.add_argument("src", type=Path, help="checkpoint dir with config.json and model.safetensors")
    parser.add_argument("dst", type=Path, help="new dir to write (must not exist)")
    parser.add_argument(
        "--aux-layer-ids",
        type=_int_list,
        default=None,
        help="output-of-layer ids the draft was trained on, e.g. 1,15,28 (needed when config.json lacks eagle_config)",
    )
    parser.add_argument("--dry-run", action="store_true", help="report what would change, write nothing")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.set_defaults(handler=_handle_convert)


def _int_list(text: str) -> list[int]:
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise ValueError(f"--aux-layer-ids wants comma-separated integers, got {text!r}") from None


def _handle_convert(args) -> int:
    try:
        report = convert_checkpoint(args.src, args.dst, aux_layer_ids=args.aux_layer_ids, dry_run=args.dry_run)
    except ConvertError as exc:
        if args.json:
            print(json.dumps({"ok": False, "error": str(exc)}))
        print(f"convert refused: {exc}", file=sys.stderr)
        return exc.exit_code
    print(json.dumps({"ok": True, **report.as_dict()}) if args.json else "\n".join(report.lines()))
    return 0
