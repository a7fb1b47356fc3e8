"""Offline extraction: the target run once over the data, written as safetensors shards (input ids, loss mask, aux hidden states, teacher)."""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable

from backend.cli import human_bytes
from backend.durable import free_bytes, publish, write_atomic
from backend.layout import SHARD_FORMAT, SHARD_META
from backend.train.data import collate
from backend.train.target import TargetModel, torch_dtype

TARGET_HEAD_FILE = "target_head.safetensors"
# Teacher logits are stored when the vocabulary is small; beyond this the final normed hidden state is
# stored instead and the logits are recomputed from the target's lm_head (as SpecForge's offline mode does).
LOGITS_STORE_MAX_VOCAB = 4096
DTYPES = {"float32": 4, "float16": 2, "bfloat16": 2}


class ExtractError(RuntimeError):
    """Extraction refused (no room, output dir in use) before anything was written."""


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
    free = free_bytes(path)
    if free is None:
        raise OSError(f"cannot read the free space of the filesystem holding {path}")
    return free


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
    publish(temp, path)


def _write_json_atomic(data: dict, path: Path) -> None:
    write_atomic(path, json.dumps(data, indent=1) + "\n")


def _batches_by_length(samples: list, batch_size: int) -> Iterable[list[int]]:
    order = sorted(range(len(samples)), key=lambda i: len(samples[i].input_ids))
    for start in range(0, len(order), batch_size):
        yield order[start : start + batch_size]


def extract_split(
    target: TargetModel,
    samples: list,
    split_dir: Path,
    dtype: str,
    store: str,
    batch_size: int,
    shard_samples: int,
    progress: ProgressBar,
    should_stop: Callable[[], bool] = lambda: False,
) -> dict:
    """Run the target over the samples and write shard-XXXXX.safetensors files with per-sample tensors."""
    import torch

    split_dir.mkdir(parents=True, exist_ok=True)
    pad_id = getattr(target.tokenizer, "pad_token_id", 0) or 0
    store_dtype = torch_dtype(dtype)
    shards: list[dict[str, Any]] = []
    pending: dict[str, torch.Tensor] = {}
    written = tokens = 0

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
        batch = collate([samples[i] for i in indices], pad_id, bucket=False)
        result = target.capture(batch["input_ids"], batch["attention_mask"], with_logits=(store == "logits"))
        teacher = result.logits if store == "logits" else result.last_hidden
        if teacher is None:
            raise ExtractError(f"the target's capture returned no {store} for the teacher; shards written so far stay in {split_dir}")
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


def extract(
    target: TargetModel,
    splits: dict[str, list],
    out_dir: str | os.PathLike,
    *,
    store: str = "auto",
    dtype: str | None = None,
    batch_size: int = 8,
    shard_samples: int = 256,
    keep_free_bytes: int = 1 << 30,
    should_stop: Callable[[], bool] = lambda: False,
    log: Callable[[str], None] | None = None,
) -> Path:
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
    head = {"embed_tokens.weight": target.embed_weight().detach(), "lm_head.weight": target.lm_head_weight().detach()}
    norm = target.final_norm_weight()
    if norm is not None:  # with lm_head: what `train --draft-head target` starts a draft's output layer from
        head["norm.weight"] = norm.detach()
    _write_safetensors_atomic(head, out / TARGET_HEAD_FILE)
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
