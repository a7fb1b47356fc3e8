"""Static pre-launch checks of an EAGLE-3 draft against its target and the SGLang serving flags.

Reads the draft's config.json and the safetensors *header* (8-byte little-endian length + JSON),
never the weights, except the small d2t/t2d tensors, read by offset to validate the vocab mapping.
Every problem has a stable code (see PROBLEM_CODES and docs/serving.md); nothing is ever modified.
"""

from __future__ import annotations

import json
import math
import os
import struct
import sys
from array import array
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable

from backend.layout import latest_checkpoint

NOTHING_CHANGED = "Nothing was changed."

# Stable problem codes (documented in docs/serving.md; the console keys on them).
KEY_PREFIX = "key_prefix"
FC_SHAPE = "fc_shape"
VOCAB_MAP = "vocab_map"
ARCHITECTURE = "architecture"
AUX_DISABLED = "aux_disabled"
AUX_LAYERS = "aux_layers"
CORRUPT = "corrupt"
ALGORITHM = "algorithm"
TARGET_SUPPORT = "target_support"
DTYPE = "dtype"
LAYER_SHAPE = "layer_shape"
PROBLEM_CODES = (KEY_PREFIX, FC_SHAPE, VOCAB_MAP, ARCHITECTURE, AUX_DISABLED, AUX_LAYERS, CORRUPT, ALGORITHM, TARGET_SUPPORT, DTYPE, LAYER_SHAPE)

# Draft classes SGLang's loader knows for EAGLE-3 (sglang srt/models/llama_eagle3.py, kimi_k25_eagle3.py).
LLAMA_DRAFT_CLASS = "LlamaForCausalLMEagle3"
MLA_DRAFT_CLASS = "Eagle3DeepseekV2ForCausalLM"
SGLANG_DRAFT_CLASSES = (LLAMA_DRAFT_CLASS, MLA_DRAFT_CLASS)

# Portable key set: loads on every SGLang version read (midlayer.* naming, SpecForge exporter's set).
_LLAMA_MIDLAYER = {
    "self_attn.q_proj.weight",
    "self_attn.k_proj.weight",
    "self_attn.v_proj.weight",
    "self_attn.o_proj.weight",
    "mlp.gate_proj.weight",
    "mlp.up_proj.weight",
    "mlp.down_proj.weight",
    "hidden_norm.weight",
    "input_layernorm.weight",
    "post_attention_layernorm.weight",
}
_MLA_MIDLAYER = {
    "self_attn.q_a_proj.weight",
    "self_attn.q_a_layernorm.weight",
    "self_attn.q_b_proj.weight",
    "self_attn.kv_a_proj_with_mqa.weight",
    "self_attn.kv_a_layernorm.weight",
    "self_attn.kv_b_proj.weight",
    "self_attn.o_proj.weight",
    "self_attn.q_proj.weight",
    "mlp.gate_proj.weight",
    "mlp.up_proj.weight",
    "mlp.down_proj.weight",
    "hidden_norm.weight",
    "input_layernorm.weight",
    "post_attention_layernorm.weight",
}
_MODEL_KEYS = {"fc.weight", "norm.weight", "embed_tokens.weight"}  # SGLang also accepts these under "model."
_TOP_KEYS = {"lm_head.weight", "d2t", "t2d"}
SPECFORGE_STATE_FILE = "training_state.pt"  # SpecForge's training checkpoint (specforge/training/checkpoint.py)

_DTYPE_BYTES = {
    "F64": 8,
    "F32": 4,
    "F16": 2,
    "BF16": 2,
    "I64": 8,
    "I32": 4,
    "I16": 2,
    "I8": 1,
    "U64": 8,
    "U32": 4,
    "U16": 2,
    "U8": 1,
    "BOOL": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "F8_E8M0": 1,
}
_MAX_HEADER_BYTES = 100 * 1024 * 1024
_TORCH_DTYPE_NAMES = {"float32": "float32", "float": "float32", "float16": "float16", "half": "float16", "bfloat16": "bfloat16", "auto": "auto"}


@dataclass
class Problem:
    code: str
    message: str
    hint: str


@dataclass
class PreflightReport:
    ok: bool
    problems: list[Problem]
    notes: list[str] = field(default_factory=list)  # facts read, and checks skipped (not failures)
    draft: str = ""
    target_config: str = ""

    def codes(self) -> list[str]:
        return [p.code for p in self.problems]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class _Collector:
    def __init__(self) -> None:
        self.problems: list[Problem] = []
        self.notes: list[str] = []

    def add(self, code: str, message: str, hint: str) -> None:
        self.problems.append(Problem(code, f"{message} {NOTHING_CHANGED}", hint))


# --------------------------------------------------------------------------- safetensors header


@dataclass
class TensorEntry:
    name: str
    dtype: str
    shape: list[int]
    begin: int  # absolute file offset of the first byte
    end: int
    file: Path


class HeaderError(ValueError):
    """A safetensors file whose header is missing, truncated or not what the format says."""


def read_safetensors_header(path: Path) -> dict[str, TensorEntry]:
    """Parse the 8-byte length + JSON header of one safetensors file and check the offsets fit the file."""
    try:
        size = path.stat().st_size
        with path.open("rb") as handle:
            prefix = handle.read(8)
            if len(prefix) < 8:
                raise HeaderError(f"{path} is {size} bytes, shorter than the 8-byte header length")
            (header_len,) = struct.unpack("<Q", prefix)
            if header_len > _MAX_HEADER_BYTES or 8 + header_len > size:
                raise HeaderError(f"{path}: header length {header_len} does not fit a {size}-byte file (truncated or not safetensors)")
            raw = handle.read(header_len)
    except OSError as exc:
        raise HeaderError(f"cannot read {path}: {exc}") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise HeaderError(f"{path}: header is not JSON ({exc})") from None
    header = parse_json(text, f"{path}: header")
    if not isinstance(header, dict):
        raise HeaderError(f"{path}: header is a {type(header).__name__}, not a JSON object")
    data_start = 8 + header_len
    entries: dict[str, TensorEntry] = {}
    furthest = 0
    for name, info in header.items():
        if name == "__metadata__":
            continue
        entries[name] = _header_entry(path, name, info, data_start)
        furthest = max(furthest, entries[name].end - data_start)
    if data_start + furthest > size:
        raise HeaderError(f"{path}: tensors need {data_start + furthest} bytes, file has {size} (truncated)")
    return entries


def _header_entry(path: Path, name: str, info: Any, data_start: int) -> TensorEntry:
    try:
        dtype, shape, (begin, end) = info["dtype"], list(info["shape"]), info["data_offsets"]
        begin, end = int(begin), int(end)
    except (TypeError, KeyError, ValueError) as exc:
        raise HeaderError(f"{path}: entry {name!r} lacks dtype/shape/data_offsets ({exc!r})") from None
    if end < begin or begin < 0 or any(not isinstance(d, int) or d < 0 for d in shape):
        raise HeaderError(f"{path}: entry {name!r} has bad offsets {[begin, end]} or shape {shape}")
    width = _DTYPE_BYTES.get(dtype)
    if width is not None and end - begin != math.prod(shape) * width:
        raise HeaderError(f"{path}: entry {name!r} spans {end - begin} bytes, {dtype}{shape} needs {math.prod(shape) * width}")
    return TensorEntry(name, dtype, shape, data_start + begin, data_start + end, path)


def read_small_tensor(entry: TensorEntry) -> list[int]:
    """Read an integer or bool tensor (d2t, t2d) by offset, as Python ints."""
    codes = {"I64": "q", "I32": "i", "I16": "h", "I8": "b", "U8": "B", "BOOL": "B", "U16": "H", "U32": "I", "U64": "Q"}
    if entry.dtype not in codes:
        raise HeaderError(f"{entry.name} has dtype {entry.dtype}, expected an integer or bool dtype")
    values = array(codes[entry.dtype])
    with entry.file.open("rb") as handle:
        handle.seek(entry.begin)
        data = handle.read(entry.end - entry.begin)
    if len(data) != entry.end - entry.begin:
        raise HeaderError(f"{entry.file}: {entry.name} is cut short (truncated file)")
    values.frombytes(data)
    if sys.byteorder != "little":
        values.byteswap()
    return values.tolist()


def draft_weight_files(draft_dir: Path) -> list[Path]:
    """model.safetensors, or the shards named by model.safetensors.index.json."""
    single = draft_dir / "model.safetensors"
    if single.is_file():
        return [single]
    index = draft_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            text = index.read_text()
        except (OSError, UnicodeDecodeError) as exc:
            raise HeaderError(f"{index} is unreadable: {exc}") from None
        data = parse_json(text, str(index))
        weight_map = data.get("weight_map") if isinstance(data, dict) else None
        if not isinstance(weight_map, dict) or not all(isinstance(name, str) for name in weight_map.values()):
            raise HeaderError(f"{index} has no weight_map of tensor name -> file name")
        return [draft_dir / name for name in sorted(set(weight_map.values()))]
    shards = sorted(draft_dir.glob("*.safetensors"))
    return shards


def read_draft_header(draft_dir: Path) -> dict[str, TensorEntry]:
    files = draft_weight_files(draft_dir)
    if not files:
        raise HeaderError(f"{draft_dir} has no model.safetensors (nor an index or other .safetensors file)")
    entries: dict[str, TensorEntry] = {}
    for path in files:
        if not path.is_file():
            raise HeaderError(f"shard {path} named by the index is missing")
        entries.update(read_safetensors_header(path))
    return entries


# --------------------------------------------------------------------------- configs


def parse_json(text: str, what: str) -> Any:
    """json.loads that turns every way a hostile or broken file fails into one HeaderError naming it:
    invalid JSON, nesting deeper than the parser's recursion limit, integers over Python's digit limit."""
    try:
        return json.loads(text)
    except RecursionError:
        raise HeaderError(
            f"{what} is nested too deeply to read (arrays/objects more than about {sys.getrecursionlimit()} levels deep; a real config has a handful)"
        ) from None
    except json.JSONDecodeError as exc:
        raise HeaderError(f"{what} is not valid JSON ({exc})") from None
    except ValueError as exc:  # an integer literal over sys.get_int_max_str_digits() digits
        detail = str(exc).split(";")[0]
        raise HeaderError(f"{what} holds a number too long to read ({detail}; a real config's numbers have a few digits)") from None


def load_json(path: Path, what: str) -> dict[str, Any]:
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise HeaderError(f"{what} {path} does not exist") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise HeaderError(f"{what} {path} is unreadable: {exc}") from None
    data = parse_json(text, f"{what} {path}")
    if not isinstance(data, dict):
        raise HeaderError(f"{what} {path} holds a {type(data).__name__}, not a JSON object")
    return data


@dataclass
class TargetFacts:
    architectures: list[str]
    hidden_size: int
    num_layers: int
    vocab_size: int
    dtype: str | None


def target_facts(config: dict[str, Any]) -> TargetFacts:
    """Read hidden size, layers, vocab and dtype, looking into text_config for wrapper (VLM) configs."""

    def pick(key: str) -> Any:
        for scope in (config, config.get("text_config") or {}, config.get("language_config") or {}, config.get("llm_config") or {}):
            if isinstance(scope, dict) and scope.get(key) is not None:
                return scope[key]
        return None

    missing = [k for k in ("hidden_size", "num_hidden_layers", "vocab_size") if pick(k) is None]
    if missing:
        raise HeaderError(f"target config lacks {', '.join(missing)}")
    sizes = {}
    for key in ("hidden_size", "num_hidden_layers", "vocab_size"):
        value = pick(key)
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise HeaderError(f"target config has {key} = {_short(repr(value))}, expected a positive integer")
        sizes[key] = value
    architectures = config.get("architectures") or []
    return TargetFacts(
        architectures=[str(a) for a in architectures] if isinstance(architectures, list) else [str(architectures)],
        hidden_size=sizes["hidden_size"],
        num_layers=sizes["num_hidden_layers"],
        vocab_size=sizes["vocab_size"],
        dtype=_dtype_name(pick("torch_dtype") or pick("dtype")),
    )


def _short(value: Any, limit: int = 80) -> str:
    """repr(value), or str(value) for a string, cut to `limit` characters (a 4,000-digit number stays readable)."""
    text = value if isinstance(value, str) else repr(value)
    return text if len(text) <= limit else text[:limit] + f"... ({len(text)} characters)"


def _dtype_name(value: Any) -> str | None:
    if value is None:
        return None
    text = str(value).replace("torch.", "")
    return _TORCH_DTYPE_NAMES.get(text, text)


def trained_block(config: dict[str, Any]) -> dict[str, Any]:
    block = config.get("eagle3_console")
    return block if isinstance(block, dict) else {}


def target_config_file(path: str | os.PathLike) -> Path:
    """--target-config as given, or, for a model dir holding one, its config.json (`target profile --from-config` takes either)."""
    inside = Path(path, "config.json")
    return inside if inside.is_file() else Path(path)


def resolve_draft_dir(path: Path) -> Path:
    """A checkpoint dir as given; a run dir (or its checkpoints/) resolves to its latest checkpoint (backend/layout.py)."""
    if (path / "config.json").exists():
        return path
    return latest_checkpoint(path) or path


# --------------------------------------------------------------------------- the checks


def check_architecture(draft_cfg: dict[str, Any], out: _Collector) -> str | None:
    archs = draft_cfg.get("architectures") or []
    arch = archs[0] if isinstance(archs, list) and archs else None
    if arch in SGLANG_DRAFT_CLASSES:
        if arch == MLA_DRAFT_CLASS:
            out.notes.append(f"{MLA_DRAFT_CLASS} (MLA draft) needs SGLang >= 0.5.14")
        return arch
    out.add(
        ARCHITECTURE,
        f"draft config.json declares architectures={archs!r}; SGLang loads EAGLE-3 drafts only as "
        f"{' or '.join(SGLANG_DRAFT_CLASSES)} (a target class such as DeepseekV3ForCausalLM would load the MTP "
        "head instead, and vLLM names like Eagle3LlamaForCausalLM are unknown to SGLang).",
        f'Set "architectures": ["{LLAMA_DRAFT_CLASS}"] in the draft\'s config.json (for a Llama-shaped draft), or re-export with `eagle3-host export`.',
    )
    return arch


def check_aux(draft_cfg: dict[str, Any], target: TargetFacts, out: _Collector) -> list[int] | None:
    declared = draft_cfg.get("eagle_config")
    eagle: dict[str, Any] = declared if isinstance(declared, dict) else {}
    if eagle.get("use_aux_hidden_state", True) is False:
        out.add(
            AUX_DISABLED,
            "draft config.json has eagle_config.use_aux_hidden_state = false: SGLang will hand the draft the "
            f"target's last hidden state ({target.hidden_size} wide) instead of 3 aux layers, and skip fc silently.",
            "Remove use_aux_hidden_state or set it to true in eagle_config (the draft was trained on 3 layers).",
        )
    served = eagle.get("eagle_aux_hidden_state_layer_ids")
    trained = trained_block(draft_cfg).get("trained_aux_layer_ids")
    default = [1, target.num_layers // 2 - 1, target.num_layers - 4]
    if served is None:
        out.notes.append(f"eagle_config names no aux layer ids: SGLang uses its default, output-of-layer {default}")
        if trained is not None and list(trained) != default:
            out.add(
                AUX_LAYERS,
                f"the draft was trained on aux layers {list(trained)} but its config.json names none, so SGLang would capture its default layers {default}.",
                f'Add "eagle_config": {{"eagle_aux_hidden_state_layer_ids": {list(trained)}}} to the draft config.json.',
            )
        return default
    if not isinstance(served, list) or not all(isinstance(i, int) for i in served):
        out.add(AUX_LAYERS, f"eagle_aux_hidden_state_layer_ids is {served!r}, not a list of ints.", "Write the 3 integer layer ids the draft was trained on.")
        return None
    expected_count = int(draft_cfg.get("num_aux_hidden_states") or 3)
    if len(served) != 3 or expected_count != 3:
        out.add(
            AUX_LAYERS,
            f"eagle_aux_hidden_state_layer_ids has {len(served)} ids {served} (num_aux_hidden_states={expected_count}); "
            "an EAGLE-3 draft's fc takes exactly 3 target layers on the SGLang versions this tool supports.",
            "Write the 3 layer ids the draft was trained on.",
        )
    top = target.num_layers - 2  # SGLang captures the input of layer id+1, which must exist
    outside = [i for i in served if not 0 <= i <= top]
    if outside or len(set(served)) != len(served):
        out.add(
            AUX_LAYERS,
            f"aux layer ids {served}: {outside or 'duplicates'} outside 0..{top} for a {target.num_layers}-layer target "
            "(SGLang captures the input of layer id+1).",
            f"Use ids the target has, e.g. the default {default}.",
        )
    if trained is not None and list(trained) != list(served):
        out.add(
            AUX_LAYERS,
            f"config.json tells SGLang to capture layers {served}, but the draft was trained on {list(trained)} (eagle3_console.trained_aux_layer_ids).",
            f"Set eagle_config.eagle_aux_hidden_state_layer_ids to {list(trained)}.",
        )
    return served


def check_keys(entries: dict[str, TensorEntry], arch: str | None, out: _Collector) -> None:
    midlayer = _MLA_MIDLAYER if arch == MLA_DRAFT_CLASS else _LLAMA_MIDLAYER
    layers0 = [k for k in entries if k.startswith(("layers.", "model.layers."))]
    unknown = [k for k in entries if not _known_key(k, midlayer, arch) and k not in layers0]
    if layers0 and arch != MLA_DRAFT_CLASS:
        out.add(
            KEY_PREFIX,
            f"{len(layers0)} weights are named layers.N.* (e.g. {sorted(layers0)[0]}); SGLang before 0.5.14 "
            "drops them silently and serves a random decoder layer (accept length ~1.0).",
            "Rename to midlayer.*: `eagle3-host convert SRC DST` writes a converted copy.",
        )
    if unknown:
        shown = ", ".join(sorted(unknown)[:5]) + (" ..." if len(unknown) > 5 else "")
        out.add(
            KEY_PREFIX,
            f"{len(unknown)} weights have names SGLang's {arch or 'EAGLE-3'} loader does not know ({shown}); it skips unknown names without an error.",
            "Export with `eagle3-host export` (or `eagle3-host convert SRC DST`) so only midlayer.*, fc, norm, lm_head, d2t, t2d (and embed_tokens) remain.",
        )
    required = ["norm.weight"]  # fc.weight is check_fc's
    if arch != MLA_DRAFT_CLASS and not layers0:
        required += [f"midlayer.{k}" for k in sorted(_LLAMA_MIDLAYER)]
    missing = [k for k in required if _get(entries, k) is None]
    if missing:
        out.add(
            KEY_PREFIX,
            f"the draft lacks {', '.join(missing)}; SGLang would leave them uninitialised.",
            "Re-export the checkpoint from the trainer (`eagle3-host export`).",
        )


def _known_key(key: str, midlayer: set[str], arch: str | None) -> bool:
    if key in _TOP_KEYS or key in _MODEL_KEYS:
        return True
    bare = key[len("model.") :] if key.startswith("model.") else key
    if bare in _MODEL_KEYS:
        return True
    if bare.startswith("midlayer."):
        return bare[len("midlayer.") :] in midlayer
    return False


def _get(entries: dict[str, TensorEntry], name: str) -> TensorEntry | None:
    return entries.get(name) or entries.get(f"model.{name}")


def check_fc(draft_cfg: dict[str, Any], entries: dict[str, TensorEntry], target: TargetFacts, out: _Collector) -> None:
    hidden = int(draft_cfg.get("hidden_size") or 0)
    target_hidden = int(draft_cfg.get("target_hidden_size") or target.hidden_size)
    if target_hidden != target.hidden_size:
        out.add(
            FC_SHAPE,
            f"draft config says target_hidden_size={target_hidden}, the target config has hidden_size={target.hidden_size}.",
            "Train the draft against this target, or serve it with the target it was trained for.",
        )
    fc = _get(entries, "fc.weight")
    want = 3 * target.hidden_size
    if fc is None:
        out.add(
            FC_SHAPE,
            f"the draft has no fc.weight: nothing maps the 3 aux layers ({want} wide) to the draft's {hidden}.",
            "Export the full draft from the trainer (`eagle3-host export`).",
        )
        return
    if len(fc.shape) != 2:
        out.add(FC_SHAPE, f"fc.weight has shape {fc.shape}, expected 2-D [{hidden}, {want}].", "Re-export the draft.")
        return
    rows, cols = fc.shape
    if cols != want:
        one_layer = " — one layer's width, not three: the draft was built for the last hidden state" if cols == target.hidden_size else ""
        out.add(
            FC_SHAPE,
            f"fc.weight takes {cols} input features but the target delivers 3 aux layers x {target.hidden_size} = "
            f"{want}{one_layer}. SGLang skips fc when the width already equals the draft hidden size, silently.",
            f"Retrain or re-export the draft with fc.weight of shape [{hidden}, {want}] (3 aux layers x target hidden size).",
        )
    if hidden and rows != hidden:
        out.add(
            FC_SHAPE,
            f"fc.weight has {rows} output rows, the draft hidden_size is {hidden}.",
            "Fix hidden_size in config.json to match the weights, or re-export.",
        )


def check_layer_shapes(draft_cfg: dict[str, Any], entries: dict[str, TensorEntry], arch: str | None, out: _Collector) -> None:
    if arch == MLA_DRAFT_CLASS:
        return
    hidden = int(draft_cfg.get("hidden_size") or 0)
    heads = int(draft_cfg.get("num_attention_heads") or 0)
    kv_heads = int(draft_cfg.get("num_key_value_heads") or heads)
    head_dim = int(draft_cfg.get("head_dim") or (hidden // heads if heads else 0))
    inter = int(draft_cfg.get("intermediate_size") or 0)
    expected = {
        "midlayer.self_attn.q_proj.weight": [heads * head_dim, 2 * hidden],
        "midlayer.self_attn.k_proj.weight": [kv_heads * head_dim, 2 * hidden],
        "midlayer.self_attn.v_proj.weight": [kv_heads * head_dim, 2 * hidden],
        "midlayer.self_attn.o_proj.weight": [hidden, heads * head_dim],
        "midlayer.mlp.gate_proj.weight": [inter, hidden],
        "midlayer.mlp.up_proj.weight": [inter, hidden],
        "midlayer.mlp.down_proj.weight": [hidden, inter],
    }
    wrong = []
    for name, shape in expected.items():
        entry = _get(entries, name)
        if entry is not None and entry.shape != shape:
            wrong.append(f"{name} {entry.shape} (config implies {shape})")
    if wrong:
        out.add(
            LAYER_SHAPE,
            f"the decoder-layer weights do not match config.json (attention inputs are 2 x hidden: embedding + hidden state): {'; '.join(wrong)}.",
            "Fix hidden_size / heads / head_dim / intermediate_size in config.json to match the weights, or re-export.",
        )


def check_vocab(draft_cfg: dict[str, Any], entries: dict[str, TensorEntry], target: TargetFacts, out: _Collector) -> None:
    vocab = target.vocab_size
    if "draft_vocab_size" not in draft_cfg:
        out.add(
            VOCAB_MAP,
            "draft config.json has no draft_vocab_size; SGLang's EAGLE-3 loader reads it to size lm_head.",
            "Add draft_vocab_size (the lm_head row count) to config.json.",
        )
        return
    draft_vocab = draft_cfg["draft_vocab_size"]
    if draft_vocab is None:
        out.notes.append("draft_vocab_size is null: SGLang uses the target's embedding and lm_head")
        return
    draft_vocab = int(draft_vocab)
    lm_head = _get(entries, "lm_head.weight")
    if lm_head is not None and lm_head.shape[:1] != [draft_vocab]:
        out.add(
            VOCAB_MAP,
            f"lm_head.weight has {lm_head.shape[0] if lm_head.shape else '?'} rows, draft_vocab_size is {draft_vocab}.",
            "Set draft_vocab_size to lm_head's row count, or re-export the draft.",
        )
    if lm_head is None:
        out.add(VOCAB_MAP, f"the draft has no lm_head.weight though draft_vocab_size is {draft_vocab}.", "Re-export the draft with its lm_head.")
    if draft_vocab > vocab:
        out.add(VOCAB_MAP, f"draft_vocab_size {draft_vocab} exceeds the target vocab {vocab}.", "Build the draft vocabulary from this target's tokenizer.")
        return
    d2t_entry = entries.get("d2t")
    if d2t_entry is None:
        if draft_vocab < vocab:
            out.add(
                VOCAB_MAP,
                f"no d2t tensor while the draft vocab ({draft_vocab}) is smaller than the target's ({vocab}): SGLang "
                "would read draft token ids as target ids, and every proposal would be a wrong token.",
                "Re-export with d2t (offsets target_id - draft_id) from the training vocab mapping.",
            )
        return
    hot = _check_d2t(d2t_entry, draft_vocab, vocab, out)
    if hot is not None and "t2d" in entries:
        _check_t2d(entries["t2d"], hot, draft_vocab, vocab, out)


def _check_d2t(entry: TensorEntry, draft_vocab: int, vocab: int, out: _Collector) -> list[int] | None:
    if entry.shape != [draft_vocab]:
        out.add(
            VOCAB_MAP, f"d2t has shape {entry.shape}, expected [{draft_vocab}] (one offset per draft token).", "Re-export d2t from the training vocab mapping."
        )
        return None
    try:
        offsets = read_small_tensor(entry)
    except (HeaderError, OSError) as exc:
        out.add(VOCAB_MAP, f"d2t could not be read: {exc}.", "Re-export d2t as int64.")
        return None
    hot = [offset + i for i, offset in enumerate(offsets)]
    if any(b <= a for a, b in zip(hot, hot[1:])):
        first = next(i for i, (a, b) in enumerate(zip(hot, hot[1:])) if b <= a)
        out.add(
            VOCAB_MAP,
            f"d2t + arange is not strictly increasing (target ids {hot[first]} then {hot[first + 1]} at draft ids "
            f"{first}, {first + 1}); d2t must hold sorted offsets target_id - draft_id, not absolute ids.",
            "Rebuild d2t as sorted(used_target_ids)[i] - i.",
        )
    elif hot and (hot[0] < 0 or hot[-1] >= vocab):
        out.add(
            VOCAB_MAP,
            f"d2t maps draft ids to target ids {hot[0]}..{hot[-1]}, outside the target vocab 0..{vocab - 1}.",
            "Rebuild d2t for this target's vocabulary (offsets, not absolute ids).",
        )
    else:
        return hot
    return None


def _check_t2d(entry: TensorEntry, hot: list[int], draft_vocab: int, vocab: int, out: _Collector) -> None:
    if entry.shape != [vocab]:
        out.add(VOCAB_MAP, f"t2d has shape {entry.shape}, expected [{vocab}] (the target vocab).", "Re-export t2d together with d2t from the same mapping.")
        return
    try:
        mask = read_small_tensor(entry)
    except (HeaderError, OSError) as exc:
        out.add(VOCAB_MAP, f"t2d could not be read: {exc}.", "Re-export t2d as a bool mask.")
        return
    marked = sum(1 for v in mask if v)
    outside = [t for t in hot if not mask[t]]
    if marked != draft_vocab or outside:
        out.add(
            VOCAB_MAP,
            f"t2d marks {marked} target tokens (expected {draft_vocab}) and {len(outside)} of d2t's targets are unmarked: "
            "d2t and t2d come from different vocab mappings (training used t2d, serving uses d2t).",
            "Re-export both from the mapping the draft was trained with.",
        )


def check_dtype(draft_cfg: dict[str, Any], target: TargetFacts, serving_dtype: str | None, out: _Collector) -> None:
    draft_dtype = _dtype_name(draft_cfg.get("torch_dtype") or draft_cfg.get("dtype"))
    if serving_dtype is None:
        out.notes.append("dtype: serving flags not given (pass --profile); only checked against --dtype auto when known")
        return
    if serving_dtype != "auto":
        out.notes.append(f"--dtype {serving_dtype} applies to target and draft")
        return
    if draft_dtype is None:
        out.add(
            DTYPE,
            "the draft config.json has no torch_dtype and serving uses --dtype auto: SGLang guesses the draft dtype.",
            "Pass --dtype explicitly (e.g. bfloat16; profiles set [serve].dtype).",
        )
    elif draft_dtype == "float32":
        out.add(
            DTYPE,
            "the draft config.json says torch_dtype float32 and serving uses --dtype auto: SGLang turns float32 into float16 for the draft.",
            "Pass --dtype explicitly (e.g. bfloat16) or set torch_dtype in the draft config to the target's dtype.",
        )
    elif target.dtype and draft_dtype != target.dtype:
        out.add(
            DTYPE,
            f"draft torch_dtype {draft_dtype} differs from the target's {target.dtype} with --dtype auto: each resolves its own dtype.",
            "Pass --dtype explicitly so target and draft run in the same dtype.",
        )


def check_serving_argv(argv: list[str], out: _Collector) -> None:
    """The flags SGLang will actually see (last occurrence wins, as with argparse)."""
    from backend.serve.sglang_args import parse_flag_values

    flags = parse_flag_values(argv)
    algorithm = flags.get("--speculative-algorithm")
    if algorithm != "EAGLE3":
        out.add(
            ALGORITHM,
            f"--speculative-algorithm is {algorithm!r}; an EAGLE-3 draft needs EAGLE3 (with EAGLE or NEXTN SGLang never "
            "captures the aux layers, hands the draft 1 x H, skips fc and accepts nothing, without a warning).",
            "Use --speculative-algorithm EAGLE3 (check [serve].extra_args in the profile).",
        )
    spec = {k: flags.get(k) for k in ("--speculative-num-steps", "--speculative-eagle-topk", "--speculative-num-draft-tokens")}
    given = [k for k, v in spec.items() if v is not None]
    if given and len(given) != 3:
        out.add(
            ALGORITHM,
            f"only {', '.join(given)} set; SGLang requires all three of steps/topk/draft-tokens or none.",
            "Set num_steps, eagle_topk and num_draft_tokens together in the profile's [serve] table.",
        )
    elif len(given) == 3:
        try:
            steps, topk, tokens = (int(value) for value in spec.values() if value is not None)  # all three, checked above
        except ValueError:
            out.add(ALGORITHM, f"steps/topk/draft-tokens are not integers: {spec}.", "Use integers.")
            return
        if topk == 1 and tokens != steps + 1:
            out.add(
                ALGORITHM,
                f"with --speculative-eagle-topk 1 SGLang forces --speculative-num-draft-tokens to steps+1 = "
                f"{steps + 1}, not {tokens}; the server would not run what the profile says.",
                f"Set num_draft_tokens = {steps + 1} in the profile.",
            )
    if flags.get("--speculative-draft-model-path") is None:
        out.add(ALGORITHM, "no --speculative-draft-model-path: SGLang would load the target as its own draft.", "Pass the draft checkpoint directory.")


def check_target_support(target: TargetFacts, out: _Collector, resolve_class: Callable[[list[str]], Any] | None = None) -> None:
    """Only where sglang imports (or a resolver is given): the target's SGLang class must capture aux states."""
    if resolve_class is None:
        resolve_class = _sglang_class_resolver()
        if resolve_class is None:
            out.notes.append("target_support not checked: sglang is not importable here")
            return
    try:
        cls = resolve_class(target.architectures)
    except Exception as exc:  # the registry raises assorted errors for unknown archs; never fatal here
        out.notes.append(f"target_support not checked: SGLang could not resolve {target.architectures}: {exc}")
        return
    if cls is None:
        out.notes.append(f"target_support not checked: SGLang has no class for {target.architectures}")
        return
    if not hasattr(cls, "set_eagle3_layers_to_capture"):
        out.add(
            TARGET_SUPPORT,
            f"the installed SGLang's {getattr(cls, '__name__', cls)} (for {target.architectures}) has no "
            "set_eagle3_layers_to_capture: EAGLE-3 cannot capture aux states for this target (startup AttributeError).",
            "Upgrade SGLang (Kimi-K2.5 needs PR #19689, SGLang >= 0.5.14) or serve with a version that supports it.",
        )
        return
    language = getattr(cls, "language_model", None)
    out.notes.append(
        f"SGLang class {getattr(cls, '__name__', cls)} implements set_eagle3_layers_to_capture"
        + (" (wrapper: make sure its language_model does too)" if language is not None else "")
    )


def _sglang_class_resolver() -> Callable[[list[str]], Any] | None:
    try:
        from sglang.srt.models.registry import ModelRegistry  # type: ignore[import-not-found]
    except Exception:  # sglang absent or its import chain broken (e.g. torchvision on CPU hosts)
        return None

    def resolve(architectures: list[str]) -> Any:
        cls, _ = ModelRegistry.resolve_model_cls(architectures)
        return cls

    return resolve


# --------------------------------------------------------------------------- entry point


def run_preflight(
    draft: str | os.PathLike,
    target_config: str | os.PathLike | dict[str, Any],
    serving_argv: list[str] | None = None,
    serving_dtype: str | None = None,
    resolve_class: Callable[[list[str]], Any] | None = None,
    check_sglang: bool = True,
) -> PreflightReport:
    """All checks. serving_argv (from sglang_args) drives the algorithm and dtype checks when given."""
    out = _Collector()
    draft_dir = Path(draft).expanduser()
    target_label = "(profile)" if isinstance(target_config, dict) else str(target_config)
    report = lambda: PreflightReport(ok=not out.problems, problems=out.problems, notes=out.notes, draft=str(draft_dir), target_config=target_label)
    try:
        draft_dir = resolve_draft_dir(draft_dir)
        _run_checks(draft_dir, target_config, serving_argv, serving_dtype, resolve_class, check_sglang, out)
    except Exception as exc:
        out.add(
            CORRUPT,
            f"preflight could not finish on {draft_dir}: {type(exc).__name__}: {_short(str(exc), 300)}.",
            "Check the draft's config.json and model.safetensors (re-export or copy them again); if they look right, report this as a preflight bug.",
        )
    return report()


_VALUE_ERRORS = (TypeError, ValueError, KeyError, IndexError, AttributeError, OverflowError, RecursionError)


def _guarded(out: _Collector, what: str, check: Callable[..., Any], *args: Any) -> Any:
    """Run one check; a config value of the wrong type or size becomes a `corrupt` problem naming the check."""
    try:
        return check(*args)
    except _VALUE_ERRORS as exc:
        out.add(
            CORRUPT,
            f"draft config.json: a value the {what} check reads has the wrong type or size ({type(exc).__name__}: {_short(str(exc), 200)}).",
            "Fix that value in the draft's config.json (compare with one the trainer writes) or re-export the draft.",
        )
        return None


def _run_checks(draft_dir: Path, target_config, serving_argv, serving_dtype, resolve_class, check_sglang, out: _Collector) -> None:
    if serving_argv is not None:
        check_serving_argv(serving_argv, out)
        from backend.serve.sglang_args import parse_flag_values

        serving_dtype = parse_flag_values(serving_argv).get("--dtype", "auto")
    try:
        target_raw = target_config if isinstance(target_config, dict) else load_json(Path(target_config), "target config")
        target = target_facts(target_raw)
    except HeaderError as exc:
        out.add(CORRUPT, f"target config: {exc}.", "Pass the target model's config.json with --target-config.")
        return
    try:
        draft_cfg = load_json(draft_dir / "config.json", "draft config")
    except HeaderError as exc:
        out.add(CORRUPT, f"{exc}.", _missing_config_hint(draft_dir))
        return
    arch = _guarded(out, "architecture", check_architecture, draft_cfg, out)
    _guarded(out, "aux layers", check_aux, draft_cfg, target, out)
    _guarded(out, "dtype", check_dtype, draft_cfg, target, serving_dtype, out)
    try:
        entries = read_draft_header(draft_dir)
    except (HeaderError, OSError) as exc:
        out.add(CORRUPT, f"draft weights unreadable: {exc}.", "Copy the checkpoint again (a partial copy truncates model.safetensors) or re-export it.")
        return
    _guarded(out, "key", check_keys, entries, arch, out)
    _guarded(out, "fc shape", check_fc, draft_cfg, entries, target, out)
    _guarded(out, "layer shape", check_layer_shapes, draft_cfg, entries, arch, out)
    _guarded(out, "vocab", check_vocab, draft_cfg, entries, target, out)
    if check_sglang:
        check_target_support(target, out, resolve_class)
    out.notes.append(f"target: {target.architectures} hidden {target.hidden_size}, {target.num_layers} layers, vocab {target.vocab_size}")


def _missing_config_hint(draft_dir: Path) -> str:
    """What to point preflight at instead; a SpecForge training checkpoint (training_state.pt only) needs its exporter."""
    try:
        specforge = (draft_dir / SPECFORGE_STATE_FILE).is_file() or any((step / SPECFORGE_STATE_FILE).is_file() for step in draft_dir.glob("*-step*"))
    except OSError:
        specforge = False
    if specforge:
        return (
            "This is a SpecForge training checkpoint (training_state.pt holds the draft, not in a form SGLang loads): "
            "export it first with `python -m specforge.export.to_sglang --checkpoint DIR --draft-config "
            "DRAFT_CONFIG.json --output-dir OUT`, then run preflight on OUT."
        )
    return "Point at a checkpoint directory holding config.json and model.safetensors."


def problems_text(report: PreflightReport) -> Iterable[str]:
    if report.ok:
        yield f"preflight ok: {report.draft}"
    for problem in report.problems:
        yield f"[{problem.code}] {problem.message}\n    hint: {problem.hint}"
    for note in report.notes:
        yield f"  note: {note}"
