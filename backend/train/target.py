"""The target side: load a HF causal LM, capture its 3 aux hidden states + teacher logits, greedy-generate, extract shards."""
from __future__ import annotations

import inspect
import json
import os
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

from backend.durable import write_atomic

BUILTIN_TINY = "builtin:tiny"
SHARD_META = "meta.json"
TARGET_HEAD_FILE = "target_head.safetensors"
SHARD_FORMAT = "eagle3-console-shards/1"
# Teacher logits are stored when the vocabulary is small; beyond this the final normed hidden state is
# stored instead and the logits are recomputed from the target's lm_head (as SpecForge's offline mode does).
LOGITS_STORE_MAX_VOCAB = 4096
DTYPES = {"float32": 4, "float16": 2, "bfloat16": 2}


class TargetMismatchError(ValueError):
    """The loaded target disagrees with its profile (hidden size, layers, vocab, aux layer ids)."""


class ExtractError(RuntimeError):
    """Extraction refused (no room, output dir in use) before anything was written."""


@dataclass
class TargetBatch:
    aux_hidden: "object"  # [B, S, 3*Ht]: outputs of the 3 aux layers, concatenated low/mid/high
    logits: "object | None" = None  # [B, S, V] teacher logits
    last_hidden: "object | None" = None  # [B, S, Ht] final normed hidden state (logits = lm_head(last_hidden))


def torch_dtype(name: str):
    import torch

    return {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}[name]


def hf_layer_index(layer_id: int) -> int:
    """Output-of-layer id L is HF hidden_states[L+1] (hidden_states[0] is the embedding output).

    SGLang's llama.py captures `hidden_states + residual` at the input of layer L+1 for config id L
    (reference 3.1, the +1 rule), which is the same tensor.
    """
    return layer_id + 1


def check_aux_layer_ids(layer_ids: list[int], num_layers: int) -> None:
    for layer in layer_ids:
        if not 0 <= layer < num_layers - 1:
            raise TargetMismatchError(
                f"aux layer id {layer} cannot be captured from a {num_layers}-layer target: SGLang captures id L at the input "
                f"of layer L+1, so ids must lie in 0..{num_layers - 2} (HF hidden_states[{num_layers}] is the final-normed state)"
            )


def _text_config(config):
    getter = getattr(config, "get_text_config", None)
    return getter() if callable(getter) else config


def check_config_matches_profile(config, profile) -> None:
    """Refuse a target whose shape differs from what the profile (and so the draft) was built for."""
    text = _text_config(config)
    expected = profile.target
    found = {
        "hidden_size": getattr(text, "hidden_size", None),
        "num_layers": getattr(text, "num_hidden_layers", None),
        "vocab_size": getattr(text, "vocab_size", None),
    }
    wrong = [f"{name}: profile says {getattr(expected, name)}, the model has {value}" for name, value in found.items() if value != getattr(expected, name)]
    if wrong:
        raise TargetMismatchError(f"target {expected.path} does not match profile {profile.name!r}: " + "; ".join(wrong) + ". Fix the profile's [target] section; nothing was loaded into training.")
    check_aux_layer_ids(list(expected.aux_layer_ids), found["num_layers"])


def resolve_target_path(profile) -> str:
    if profile.target.path == BUILTIN_TINY:
        from backend.train.tiny import ensure_tiny_target

        return str(ensure_tiny_target())
    return os.path.expanduser(profile.target.path)


def load_tokenizer(path: str, trust_remote_code: bool = False):
    from backend.train.tiny import ByteTokenizer, is_tiny_target_dir

    if is_tiny_target_dir(path):
        return ByteTokenizer.from_dir(path)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)


def _decoder_layers(model):
    for getter in (lambda m: m.get_decoder().layers, lambda m: m.model.layers, lambda m: m.language_model.model.layers):
        try:
            layers = getter(model)
        except AttributeError:
            continue
        if layers is not None:
            return layers
    raise TargetMismatchError(f"cannot find the decoder layers of {type(model).__name__} (looked for get_decoder().layers, model.layers)")


def _cache_kwarg(model) -> str:
    """transformers >= 5.2x names the KV cache argument `cache`; earlier 5.x and 4.x call it `past_key_values`."""
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def _output_cache(output):
    cache = getattr(output, "cache", None)
    return cache if cache is not None else getattr(output, "past_key_values", None)


class TargetModel:
    """A frozen target that produces the draft's inputs: aux hidden states, teacher logits, greedy continuations."""

    def __init__(self, model, tokenizer, profile, path: str, aux_layer_ids: list[int] | None = None):
        self.model = model.eval()
        for param in self.model.parameters():
            param.requires_grad_(False)
        self.tokenizer = tokenizer
        self.profile = profile
        self.path = path
        # aux_layer_ids overrides the profile's only for diagnostics (e.g. extracting a deliberately wrong feed).
        self.aux_layer_ids = list(aux_layer_ids if aux_layer_ids is not None else profile.target.aux_layer_ids)
        self._layers = _decoder_layers(model)
        self._cache_kwarg = _cache_kwarg(model)
        text = _text_config(model.config)
        self.hidden_size = text.hidden_size
        self.num_layers = text.num_hidden_layers
        self.vocab_size = text.vocab_size
        check_aux_layer_ids(self.aux_layer_ids, self.num_layers)

    @property
    def aux_width(self) -> int:
        return len(self.aux_layer_ids) * self.hidden_size

    @property
    def device(self):
        return self.model.get_input_embeddings().weight.device

    @property
    def dtype(self):
        return self.model.get_input_embeddings().weight.dtype

    def embed_weight(self):
        return self.model.get_input_embeddings().weight

    def lm_head_weight(self):
        return self.model.get_output_embeddings().weight

    def describe(self) -> dict:
        return {
            "path": self.profile.target.path,
            "resolved_path": self.path,
            "architecture": (getattr(self.model.config, "architectures", None) or [type(self.model).__name__])[0],
            "hidden_size": self.hidden_size,
            "num_layers": self.num_layers,
            "vocab_size": self.vocab_size,
            "aux_layer_ids": self.aux_layer_ids,
        }

    def capture(self, input_ids, attention_mask=None, with_logits: bool = True) -> TargetBatch:
        """One no-grad forward; aux = outputs of layers aux_layer_ids (= hidden_states[id+1]), concatenated."""
        import torch

        captured: dict[int, object] = {}

        def hook_for(layer_id):
            def hook(_module, _inputs, output):
                captured[layer_id] = output[0] if isinstance(output, tuple) else output
            return hook

        handles = [self._layers[layer].register_forward_hook(hook_for(layer)) for layer in self.aux_layer_ids]
        try:
            with torch.no_grad():
                decoder = self.model.get_decoder()
                output = decoder(input_ids=input_ids.to(self.device), attention_mask=None if attention_mask is None else attention_mask.to(self.device), use_cache=False)
        finally:
            for handle in handles:
                handle.remove()
        missing = [layer for layer in self.aux_layer_ids if layer not in captured]
        if missing:
            raise TargetMismatchError(f"aux layers {missing} produced no output during the target forward")
        aux = torch.cat([captured[layer] for layer in self.aux_layer_ids], dim=-1)
        last = output.last_hidden_state
        if with_logits:
            with torch.no_grad():
                return TargetBatch(aux_hidden=aux, logits=self.model.get_output_embeddings()(last))
        return TargetBatch(aux_hidden=aux, last_hidden=last)

    def greedy_generate(self, prompt_ids, max_new_tokens: int, prompt_mask=None, stop_token_id: int | None = None):
        """KV-cached greedy continuation of left-padded prompts [B, P] -> generated ids [B, N] (pad after a stop)."""
        import torch

        device = self.device
        ids = prompt_ids.to(device)
        mask = torch.ones_like(ids) if prompt_mask is None else prompt_mask.to(device).long()
        pad_id = getattr(self.tokenizer, "pad_token_id", None)
        pad_id = 0 if pad_id is None else pad_id
        finished = torch.zeros(ids.shape[0], dtype=torch.bool, device=device)
        generated = []
        cache = None
        step_input = ids
        with torch.no_grad():
            for _ in range(max_new_tokens):
                positions = (mask.cumsum(-1) - 1).clamp(min=0)[:, -step_input.shape[1] :]
                kwargs = {self._cache_kwarg: cache} if cache is not None else {}
                output = self.model(input_ids=step_input, attention_mask=mask, position_ids=positions, use_cache=True, **kwargs)
                cache = _output_cache(output)
                token = output.logits[:, -1].argmax(-1)
                token = torch.where(finished, torch.full_like(token, pad_id), token)
                generated.append(token)
                if stop_token_id is not None:
                    finished |= token == stop_token_id
                    if bool(finished.all()):
                        break
                step_input = token[:, None]
                mask = torch.cat([mask, torch.ones_like(token)[:, None]], dim=-1)
        return torch.stack(generated, dim=1)


def load_target(profile, device="cpu", dtype: str | None = None, device_map=None, aux_layer_ids: list[int] | None = None) -> TargetModel:
    """Load the profile's target ('builtin:tiny' builds/uses the cached tiny target) and check it against the profile."""
    from transformers import AutoConfig, AutoModelForCausalLM

    path = resolve_target_path(profile)
    trust = profile.serve.trust_remote_code
    config = AutoConfig.from_pretrained(path, trust_remote_code=trust)
    check_config_matches_profile(config, profile)
    kwargs = {"dtype": torch_dtype(dtype or profile.target.dtype), "attn_implementation": "sdpa", "trust_remote_code": trust}
    if device_map is not None:
        kwargs["device_map"] = device_map
    model = AutoModelForCausalLM.from_pretrained(path, **kwargs)
    if device_map is None:
        model = model.to(device)
    return TargetModel(model, load_tokenizer(path, trust), profile, path, aux_layer_ids)


# ----------------------------------------------------------------------------------------------
# Offline extraction: safetensors shards of (input_ids, loss_mask, aux_hidden_states, teacher)
# ----------------------------------------------------------------------------------------------

def bytes_per_token(hidden_size: int, vocab_size: int, num_aux: int, dtype: str, store: str) -> int:
    element = DTYPES[dtype]
    teacher = vocab_size if store == "logits" else hidden_size
    return (num_aux * hidden_size + teacher) * element + 8 + 1  # + int64 input id + uint8 loss mask


def choose_store(vocab_size: int, store: str = "auto") -> str:
    if store == "auto":
        return "logits" if vocab_size <= LOGITS_STORE_MAX_VOCAB else "last_hidden"
    if store not in ("logits", "last_hidden"):
        raise ValueError(f"store must be 'auto', 'logits' or 'last_hidden', got {store!r}")
    return store


def human_bytes(count: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(count) < 1024 or unit == "TiB":
            return f"{count:.1f} {unit}" if unit != "B" else f"{int(count)} B"
        count /= 1024
    return f"{count:.1f} TiB"


@dataclass
class ExtractPlan:
    samples: int
    tokens: int
    bytes_per_token: int
    head_bytes: int
    total_bytes: int
    free_bytes: int
    keep_free_bytes: int
    store: str

    @property
    def fits(self) -> bool:
        return self.total_bytes + self.keep_free_bytes <= self.free_bytes

    def describe(self) -> str:
        per_sample = self.total_bytes / max(1, self.samples)
        return (
            f"extract: {self.samples} samples, {self.tokens} tokens x {self.bytes_per_token} B/token "
            f"(~{human_bytes(per_sample)}/sample, teacher stored as {self.store}) + target head {human_bytes(self.head_bytes)} "
            f"= {human_bytes(self.total_bytes)}; free: {human_bytes(self.free_bytes)} (keeping {human_bytes(self.keep_free_bytes)} free)"
        )


def _free_bytes(path: Path) -> int:
    probe = path
    while not probe.exists():
        probe = probe.parent
    return shutil.disk_usage(probe).free


def plan_extract(target: TargetModel, lengths: list[int], out_dir: Path, dtype: str, store: str, keep_free_bytes: int) -> ExtractPlan:
    per_token = bytes_per_token(target.hidden_size, target.vocab_size, len(target.aux_layer_ids), dtype, store)
    head = 2 * target.vocab_size * target.hidden_size * DTYPES[dtype]
    tokens = sum(lengths)
    total = tokens * per_token + head + 4096 * (1 + len(lengths) // 64)
    return ExtractPlan(len(lengths), tokens, per_token, head, total, _free_bytes(out_dir), keep_free_bytes, store)


class ProgressBar:
    """A one-line progress bar on stderr (redrawn with \\r on a terminal, one line per 10 % otherwise)."""

    def __init__(self, label: str, total: int, stream=None):
        self.label, self.total, self.done = label, max(1, total), 0
        self.stream = stream or sys.stderr
        self.started = time.monotonic()
        self.tty = self.stream.isatty()
        self._last_decile = -1

    def update(self, count: int) -> None:
        self.done = min(self.total, self.done + count)
        fraction = self.done / self.total
        elapsed = time.monotonic() - self.started
        eta = elapsed / fraction - elapsed if fraction else 0.0
        bar = "#" * int(30 * fraction) + "." * (30 - int(30 * fraction))
        line = f"{self.label} [{bar}] {self.done}/{self.total} {elapsed:.0f}s elapsed, ~{eta:.0f}s left"
        if self.tty:
            self.stream.write("\r" + line + ("\n" if self.done == self.total else ""))
        elif int(fraction * 10) != self._last_decile:
            self._last_decile = int(fraction * 10)
            self.stream.write(line + "\n")
        self.stream.flush()


def _write_safetensors_atomic(tensors: dict, path: Path, metadata: dict | None = None) -> None:
    from safetensors.torch import save_file

    temp = path.with_name(path.name + ".tmp")
    save_file({k: v.contiguous().cpu() for k, v in tensors.items()}, str(temp), metadata=metadata)
    with open(temp, "rb") as handle:
        os.fsync(handle.fileno())
    os.rename(temp, path)


def _write_json_atomic(data: dict, path: Path) -> None:
    write_atomic(path, json.dumps(data, indent=1) + "\n")


def _batches_by_length(samples: list, batch_size: int) -> Iterable[list[int]]:
    order = sorted(range(len(samples)), key=lambda i: len(samples[i].input_ids))
    for start in range(0, len(order), batch_size):
        yield order[start : start + batch_size]


def extract_split(target: TargetModel, samples: list, split_dir: Path, dtype: str, store: str, batch_size: int,
                  shard_samples: int, progress: ProgressBar, should_stop: Callable[[], bool] = lambda: False) -> dict:
    """Run the target over the samples and write shard-XXXXX.safetensors files with per-sample tensors."""
    import torch

    from backend.train.data import collate

    split_dir.mkdir(parents=True, exist_ok=True)
    pad_id = getattr(target.tokenizer, "pad_token_id", 0) or 0
    store_dtype = torch_dtype(dtype)
    shards, pending, written, tokens = [], {}, 0, 0

    def flush():
        nonlocal pending
        if not pending:
            return
        name = f"shard-{len(shards):05d}.safetensors"
        count = len({key.split(".")[0] for key in pending})
        _write_safetensors_atomic(pending, split_dir / name)
        shards.append({"file": name, "samples": count})
        pending = {}

    for indices in _batches_by_length(samples, batch_size):
        if should_stop():
            raise KeyboardInterrupt("extraction stopped by a signal")
        batch = collate([samples[i] for i in indices], pad_id)
        result = target.capture(batch["input_ids"], batch["attention_mask"], with_logits=(store == "logits"))
        teacher = result.logits if store == "logits" else result.last_hidden
        for row, index in enumerate(indices):
            length = len(samples[index].input_ids)
            key = f"s{written}"
            pending[f"{key}.input_ids"] = batch["input_ids"][row, :length].to(torch.int64)
            pending[f"{key}.loss_mask"] = batch["loss_mask"][row, :length].to(torch.uint8)
            pending[f"{key}.aux_hidden_states"] = result.aux_hidden[row, :length].to(store_dtype)
            pending[f"{key}.{'target_logits' if store == 'logits' else 'last_hidden_states'}"] = teacher[row, :length].to(store_dtype)
            written += 1
            tokens += length
            if len({k.split(".")[0] for k in pending}) >= shard_samples:
                flush()
        progress.update(len(indices))
    flush()
    return {"samples": written, "tokens": tokens, "shards": shards}


def extract(target: TargetModel, splits: dict[str, list], out_dir: str | os.PathLike, *, store: str = "auto",
            dtype: str | None = None, batch_size: int = 8, shard_samples: int = 256, keep_free_bytes: int = 1 << 30,
            should_stop: Callable[[], bool] = lambda: False, log: Callable[[str], None] | None = None) -> Path:
    """Write offline training data. The disk estimate is printed first; refuses (writing nothing) when it will not fit."""
    log = log or (lambda message: print(message, file=sys.stderr, flush=True))
    out = Path(out_dir).expanduser()
    if (out / SHARD_META).exists() or (out.exists() and any(out.iterdir())):
        raise ExtractError(f"{out} is not empty; extraction writes into a new or empty directory. Nothing was written.")
    dtype = dtype or target.profile.target.dtype
    store = choose_store(target.vocab_size, store)
    lengths = [len(s.input_ids) for samples in splits.values() for s in samples]
    plan = plan_extract(target, lengths, out, dtype, store, keep_free_bytes)
    log(plan.describe())
    if not plan.fits:
        raise ExtractError(
            f"not enough disk space under {out}: the shards need {human_bytes(plan.total_bytes)} and "
            f"{human_bytes(plan.keep_free_bytes)} must stay free, but only {human_bytes(plan.free_bytes)} is free. "
            "Nothing was written; extract fewer samples (--samples), choose another --out, or lower --keep-free-gb."
        )
    out.mkdir(parents=True, exist_ok=True)
    _write_safetensors_atomic({"embed_tokens.weight": target.embed_weight().detach(), "lm_head.weight": target.lm_head_weight().detach()}, out / TARGET_HEAD_FILE)
    meta = {
        "format": SHARD_FORMAT,
        "profile": target.profile.name,
        "target": target.describe(),
        "hidden_size": target.hidden_size,
        "vocab_size": target.vocab_size,
        "aux_layer_ids": target.aux_layer_ids,
        "aux_width": target.aux_width,
        "store": store,
        "dtype": dtype,
        "head_file": TARGET_HEAD_FILE,
        "created": time.time(),
        "estimate_bytes": plan.total_bytes,
        "splits": {},
    }
    progress = ProgressBar("extract", sum(len(s) for s in splits.values()))
    for name, samples in splits.items():
        meta["splits"][name] = extract_split(target, samples, out / name, dtype, store, batch_size, shard_samples, progress, should_stop)
    _write_json_atomic(meta, out / SHARD_META)
    log(f"extract: wrote {sum(s['samples'] for s in meta['splits'].values())} samples to {out}")
    return out
