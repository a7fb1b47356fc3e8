"""Data-scaling numbers: bytes per sample of hidden-state data, free disk where it lives, how many more samples fit.

Standard library only (the agent answers the console's data-scaling panel with it). Measured from an `extract`
output (meta.json + shard files) when one exists; otherwise estimated from the profile's shapes and marked so.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from backend.durable import free_bytes

META_FILE = "meta.json"
KEEP_FREE_BYTES = 1 << 30


def shard_bytes(directory: Path) -> int:
    """The shards' own bytes (not the directory's: meta.json is no per-sample cost)."""
    return sum(path.stat().st_size for path in directory.rglob("*.safetensors") if path.is_file())


def measured(data_dir: str | os.PathLike, keep_free_bytes: int = KEEP_FREE_BYTES) -> dict[str, Any]:
    """Numbers from a finished extraction: real bytes on disk and real extraction speed."""
    directory = Path(data_dir).expanduser()
    meta_path = directory / META_FILE
    meta = json.loads(meta_path.read_text())
    splits = meta.get("splits") or {}
    samples = sum(int(split.get("samples", 0)) for split in splits.values())
    tokens = sum(int(split.get("tokens", 0)) for split in splits.values())
    total = shard_bytes(directory)
    seconds = max(meta_path.stat().st_mtime - float(meta.get("created", meta_path.stat().st_mtime)), 0.0)
    return _summary(directory, "measured", samples, tokens, total, seconds, keep_free_bytes)


def estimated(shape: dict[str, int], data_dir: str | os.PathLike, keep_free_bytes: int = KEEP_FREE_BYTES) -> dict[str, Any]:
    """Numbers for an online run (no shards on disk): what one offline sample of seq_len tokens would take."""
    per_token = (shape["aux_width"] + shape["teacher_width"]) * shape["dtype_bytes"] + 8 + 1  # + int64 id + mask byte
    per_sample = per_token * shape["seq_len"]
    summary = _summary(Path(data_dir).expanduser(), "estimated", 1, shape["seq_len"], per_sample, None, keep_free_bytes)
    summary.update(
        samples=0,
        tokens=0,
        bytes=0,
        fit_multiple_of_current=None,
        shape=shape,
        note="no extracted shards here: bytes per sample estimated from the profile's shapes",
    )
    return summary


def _summary(directory: Path, kind: str, samples: int, tokens: int, total_bytes: int, seconds: float | None, keep_free_bytes: int) -> dict[str, Any]:
    free = free_bytes(directory)
    if free is None:
        raise OSError(f"cannot read the free space of the filesystem holding {directory}")
    per_sample = total_bytes / samples if samples else None
    room = max(free - keep_free_bytes, 0)
    more = int(room // per_sample) if per_sample else None
    per_sample_s = seconds / samples if seconds and samples else None
    return {
        "kind": kind,
        "path": str(directory),
        "samples": samples,
        "tokens": tokens,
        "bytes": total_bytes,
        "bytes_per_sample": per_sample,
        "free_bytes": free,
        "keep_free_bytes": keep_free_bytes,
        "more_samples_fit": more,
        "fit_multiple_of_current": (more / samples) if more is not None and samples else None,
        "seconds_per_sample": per_sample_s,
        "estimated_seconds_for_fit": (more * per_sample_s) if more is not None and per_sample_s else None,
    }


def data_scaling(data_dir: str | os.PathLike | None, shape: dict[str, int] | None = None) -> dict[str, Any]:
    """Measured when data_dir holds an extraction; estimated from a profile shape otherwise."""
    if data_dir and (Path(data_dir).expanduser() / META_FILE).is_file():
        return measured(data_dir)
    if shape is None:
        raise ValueError(f"{data_dir} holds no {META_FILE} (not an `eagle3-host extract` output) and no profile shape was given to estimate from")
    return estimated(shape, data_dir or ".")
