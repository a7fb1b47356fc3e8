"""One run's metrics summary: the series index fed from metrics.jsonl (fast backlog scan, live records), its sidecar, the val and recent records.

Standard library only. `MetricsIndex` holds what the console asks about a run without touching the raw
file: per-series buckets (backend.metrics.series), the val records (the accuracy table, grokking evals), the
latest train records (the signals' recent window) and counts. `MetricsFeed` ties one to a metrics.jsonl:
records the agent streams live are folded as they pass; a backlog (a file the agent never saw, or saw only
in part) is scanned in bounded chunks by `index_step()`, which the agent runs on a background thread while
live records keep flowing; a large one by worker processes over the same chunks (backend.metrics.parallel). The sidecar `metrics.index` beside the file is a rebuildable cache: it is trusted
only when its format, the file's first bytes and the file's size still agree, and rebuilt otherwise.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import threading
import time
from collections import deque
from pathlib import Path
from typing import Any, Iterable

from backend.durable import write_atomic
from backend.jsonl import MAX_LINE_BYTES, LineReader, describe_dropped
from backend.metrics.scan import ChunkScanner, ScanResult, decode_line, points_of_records
from backend.metrics.series import Level, Series, query

INDEX_FORMAT = 5  # 5: the wall-time series "time"; an older sidecar lacks it and is rebuilt
HEAD_BYTES = 4096
SCAN_CHUNK_BYTES = 8 << 20
INDEX_STEP_BYTES = 2 << 20  # one backlog step holds the GIL for ~tens of ms: requests answer between steps
VAL_KEPT = 20_000
RECENT_TRAIN_KEPT = 2048
TAIL_BYTES_FOR_RECENT = 4 << 20
MAGIC = b"EAGLE3-METRICS-INDEX\n"


class MetricsIndex:
    """Series buckets plus the val records and the latest train records of one run (no file I/O here)."""

    def __init__(self) -> None:
        self.series: dict[str, Series] = {}
        self._val_records: deque = deque(maxlen=VAL_KEPT)
        self._val_bytes = b""
        self.recent_train: deque = deque(maxlen=RECENT_TRAIN_KEPT)
        self.total_records = 0
        self.bad_lines = 0
        self.problems: list[str] = []
        self.version = 0

    @property
    def val_records(self) -> deque:
        if self._val_bytes:
            loaded = deque((json.loads(line) for line in self._val_bytes.splitlines()), maxlen=VAL_KEPT)
            loaded.extend(self._val_records)
            self._val_records, self._val_bytes = loaded, b""
        return self._val_records

    def fold_records(self, records: Iterable[dict[str, Any]]) -> None:
        """Cleaned records (file order) into the series, the val list and the recent window."""
        records = list(records)
        if not records:
            return
        for key, (steps, values) in points_of_records(records).items():
            self._series(key).add(steps, values)
        for record in records:
            (self.val_records if record.get("split") == "val" else self.recent_train).append(record)
        self.total_records += len(records)
        self.version += 1

    def fold_scan(self, result: ScanResult) -> None:
        """A scanned chunk: its fast columns and its slow (val, odd) records."""
        for key, (steps, values) in result.columns.items():
            self._series(key).add(steps, values)
        self.total_records += result.fast_records
        self.bad_lines += result.bad_lines
        self.problems = (self.problems + result.problems)[-5:]
        self.fold_records(result.slow_records)
        self.version += 1

    def fold_dropped(self, spans: list[tuple[int, int]]) -> None:
        """Lines the reader dropped (over the line cap): counted as bad lines, each described by its byte range."""
        if not spans:
            return
        self.bad_lines += len(spans)
        self.problems = (self.problems + [describe_dropped(*span) for span in spans])[-5:]
        self.version += 1

    def _series(self, key: str) -> Series:
        series = self.series.get(key)
        if series is None:
            series = self.series[key] = Series()
        return series

    def keys(self) -> list[str]:
        return sorted(self.series)

    def step_range(self) -> tuple[int, int] | None:
        """First and last step of any series."""
        spans = [span for span in (s.span() for s in self.series.values()) if span is not None]
        return (min(lo for lo, _ in spans), max(hi for _, hi in spans)) if spans else None

    def buckets(self, key: str, step_from: int | None, step_to: int | None, points: int, log_x: bool = False) -> list[dict]:
        series = self.series.get(key)
        span = self.step_range()
        if series is None or span is None:
            return []
        lo = span[0] if step_from is None else step_from
        hi = span[1] if step_to is None else step_to
        if hi < lo:
            return []
        return query(series, lo, hi, points, log_x)

    def latest_val(self, count: int) -> list[dict[str, Any]]:
        return list(self.val_records)[-count:]

    def signal_records(self, coarse_points: int = 2000) -> list[dict[str, Any]]:
        """Records for backend.metrics.signals: older train history as bucket means (log-spaced), then the recent raw train
        records and every kept val record, in step order."""
        recent = list(self.recent_train)
        synthetic = self._coarse_train(recent[0]["step"] - 1 if recent else None, coarse_points)
        return sorted([*synthetic, *recent, *self.val_records], key=lambda r: r["step"])

    def _coarse_train(self, step_to: int | None, points: int) -> list[dict[str, Any]]:
        loss = self.series.get("train.loss")
        if loss is None or (step_to is not None and step_to < 0):
            return []
        by_step: dict[int, dict[str, Any]] = {}
        plan = {
            "train.loss": ("loss", "mean"),
            "lr": ("lr", "last"),
            "grad_norm": ("grad_norm", "mean"),
            "weight_norm": ("weight_norm", "last"),
            "tokens": ("tokens", "last"),
            "train.acc.0": ("acc", "mean"),
        }
        for key, (field, pick) in plan.items():
            for bucket in self.buckets(key, None, step_to, points, log_x=True):
                if bucket[pick] is None:
                    continue
                record = by_step.setdefault(bucket["step_hi"], {"step": bucket["step_hi"], "split": "train"})
                record[field] = [bucket[pick]] if field == "acc" else bucket[pick]
        if step_to is not None:
            by_step = {s: r for s, r in by_step.items() if s <= step_to}
        for record in by_step.values():
            if "tokens" in record:
                record["tokens"] = int(record["tokens"])
        return [r for r in by_step.values() if "loss" in r]

    # -- the sidecar -------------------------------------------------------------------------------

    def to_bytes(self, header: dict[str, Any]) -> bytes:
        for series in self.series.values():
            series.level(0)  # rebuild the coarser levels now, so they are saved and never rebuilt on load
        meta = dict(
            header,
            format=INDEX_FORMAT,
            total_records=self.total_records,
            bad_lines=self.bad_lines,
            series=[[key, [len(level) for level in s.levels]] for key, s in sorted(self.series.items())],
        )
        parts = [MAGIC, json.dumps(meta).encode() + b"\n"]
        for _, series in sorted(self.series.items()):
            parts.extend(level.to_bytes() for level in series.levels)
        vals = b"".join(json.dumps(r, allow_nan=True).encode() + b"\n" for r in self.val_records)
        parts.append(struct.pack("<Q", len(vals)) + vals)
        return b"".join(parts)

    @classmethod
    def from_bytes(cls, data: bytes) -> tuple["MetricsIndex", dict[str, Any]]:
        if not data.startswith(MAGIC):
            raise ValueError("not a metrics index")
        end = data.index(b"\n", len(MAGIC))
        meta = json.loads(data[len(MAGIC) : end])
        if meta.get("format") != INDEX_FORMAT:
            raise ValueError(f"index format {meta.get('format')}, this agent reads {INDEX_FORMAT}")
        index = cls()
        pos = end + 1
        probe = Level()
        row_bytes = probe.ids.itemsize + sum(col.itemsize for col in probe.cols)
        for key, counts in meta["series"]:
            levels = []
            for count in counts:
                size = count * row_bytes
                levels.append(Level.from_bytes(data[pos : pos + size], count))
                pos += size
            index.series[key] = Series(levels[0], levels[1:])
        (vals_size,) = struct.unpack("<Q", data[pos : pos + 8])
        index._val_bytes = data[pos + 8 : pos + 8 + vals_size]  # decoded on first use (a query of series needs none)
        index.total_records = int(meta["total_records"])
        index.bad_lines = int(meta["bad_lines"])
        return index, meta


def head_digest(path: Path, length: int) -> str:
    with open(path, "rb") as handle:
        return hashlib.sha256(handle.read(length)).hexdigest()


class MetricsFeed:
    """A metrics.jsonl with its index: live records folded as the agent streams them, a backlog scanned in chunks.

    `live_offset` is where the agent's live stream reads next; `indexed_offset` is how far the index has
    folded. They meet once the backlog is scanned; from then on `poll_live()` folds what it returns.
    """

    def __init__(self, path: str | os.PathLike, sidecar: str | os.PathLike | None, *, live_from_end: bool):
        self.path = Path(path)
        self.sidecar = Path(sidecar) if sidecar else None
        self.lock = threading.RLock()
        self.index = MetricsIndex()
        self.indexed_offset = 0
        self.scanner = ChunkScanner()
        self.live_lines = LineReader()  # one reader per offset: each remembers the over-cap line it is reading past
        self.index_lines = LineReader()
        self.cold_scan: Any = None  # a backend.metrics.parallel.ColdScan while worker processes scan the backlog
        self.sidecar_note = ""
        self.saved_version = -1
        self.head_length = 0
        self.head_hash = ""
        self._load_sidecar()  # trusted only when the file still holds at least what it indexed
        # Live from the end (an agent meeting a run), else from where the index stops (what it holds is not re-sent).
        self.live_offset = self._file_size() if live_from_end else self.indexed_offset
        if live_from_end and self.backlog_bytes() and self.indexed_offset == 0:
            self._fill_recent_from_tail()

    # -- state ------------------------------------------------------------------------------------

    def _file_size(self) -> int:
        try:
            return self.path.stat().st_size
        except OSError:
            return 0

    def backlog_bytes(self) -> int:
        return max(0, self.live_offset - self.indexed_offset)

    @property
    def caught_up(self) -> bool:
        return self.indexed_offset >= self.live_offset

    def progress(self) -> dict[str, Any]:
        return {
            "indexed_bytes": self.indexed_offset,
            "file_bytes": self._file_size(),
            "backlog_bytes": self.backlog_bytes(),
            "caught_up": self.caught_up,
            "total_records": self.index.total_records,
            "bad_lines": self.index.bad_lines,
            "sidecar": self.sidecar_note,
        }

    def _reset(self, why: str) -> None:
        self.index = MetricsIndex()
        self.indexed_offset = 0
        self.scanner = ChunkScanner()
        self.index_lines = LineReader()
        self.head_length, self.head_hash = 0, ""
        self.sidecar_note = f"rebuilding: {why}"

    # -- live -----------------------------------------------------------------------------------

    def poll_live(self, max_bytes: int = SCAN_CHUNK_BYTES) -> tuple[list[dict[str, Any]], int, int]:
        """(new cleaned records, start offset, end offset); folds them when the index has caught up."""
        with self.lock:
            start = self.live_offset
            chunk = self.live_lines.read(self.path, start, max_bytes)
            if chunk.size is not None and (chunk.size < start or chunk.offset != start) and not self._head_unchanged():
                self._reset("the file was replaced")
                start = self.live_offset = 0
                chunk = self.live_lines.read(self.path, 0, max_bytes)
            elif chunk.size is not None and chunk.size < start:
                self._reset("the file was truncated")
                start = 0
            end = chunk.offset
            records = self._decode(chunk.data) if chunk.data else []
            folding = self.indexed_offset >= start
            self.live_offset = end
            if folding and end != start:
                self.index.fold_records(records)
                self.index.fold_dropped(chunk.dropped)
                self.indexed_offset = end
                self._note_head()
            return records, start, end

    def _decode(self, data: bytes, count_bad: bool = True) -> list[dict[str, Any]]:
        """Cleaned records of complete lines; bad ones are counted in the index when count_bad."""
        records = []
        for line in data.splitlines():
            if len(line) > MAX_LINE_BYTES:  # only tail_records meets one: the line readers cut them out
                continue
            clean, problem = decode_line(line)
            if clean is not None:
                records.append(clean)
            elif problem is not None and count_bad:
                self.index.bad_lines += 1
                self.index.problems = (self.index.problems + [problem])[-5:]
        return records

    # -- backlog ----------------------------------------------------------------------------------

    def index_step(self, max_bytes: int = INDEX_STEP_BYTES) -> bool:
        """Scan up to max_bytes of the backlog; True while backlog remains (or worker processes are scanning it)."""
        if self.cold_scan is not None:
            return True  # backend.metrics.parallel.backlog_step merges the workers' ranges, then scans on here
        with self.lock:
            start, stop = self.indexed_offset, self.live_offset
            if start >= stop:
                return False
            chunk = self.index_lines.read(self.path, start, max_bytes, stop=stop)
            if chunk.offset == start:
                return False
            if chunk.data:
                self.index.fold_scan(self.scanner.scan(chunk.data))
            self.index.fold_dropped(chunk.dropped)
            self.indexed_offset = min(chunk.offset, stop)
            self._note_head()
            return self.indexed_offset < self.live_offset

    def _fill_recent_from_tail(self) -> None:
        """The last train records for the signals' recent window while the backlog is still being scanned."""
        try:
            records = self.tail_records(RECENT_TRAIN_KEPT, split="train", max_scan_bytes=TAIL_BYTES_FOR_RECENT)
        except OSError:
            return
        self.index.recent_train.extend(records)

    def tail_records(self, count: int, split: str | None = None, max_scan_bytes: int = 64 << 20, end: int | None = None) -> list[dict[str, Any]]:
        """The last `count` cleaned records (of `split`) before `end` (default: live_offset), read backwards from there.

        Pass the offset you report with them: live_offset may move on meanwhile, and records past the reported offset
        would be sent twice (once here, once in the next live event).
        """
        if end is None:
            with self.lock:
                end = self.live_offset
        found: list[dict[str, Any]] = []
        block = 256 << 10
        pos = end
        carry = b""
        if not end or not self.path.exists():
            return []
        with open(self.path, "rb") as handle:
            while pos > 0 and len(found) < count and end - pos < max_scan_bytes:
                start = max(0, pos - block)
                handle.seek(start)
                data = handle.read(pos - start) + carry
                pos = start
                lines = data.split(b"\n")
                carry = lines[0] if start else b""
                body = lines[1:] if start else lines
                batch = [r for r in self._decode(b"\n".join(body), count_bad=False) if split is None or r.get("split") == split]
                found = batch + found
                block = min(block * 2, 16 << 20)
        return found[-count:]

    # -- sidecar ---------------------------------------------------------------------------------

    def _note_head(self) -> None:
        if self.head_length < HEAD_BYTES and self.indexed_offset > self.head_length:
            self.head_length = min(HEAD_BYTES, self.indexed_offset)
            self.head_hash = head_digest(self.path, self.head_length)

    def _head_unchanged(self) -> bool:
        return not self.head_length or head_digest(self.path, self.head_length) == self.head_hash

    def _load_sidecar(self) -> None:
        if self.sidecar is None or not self.sidecar.exists():
            self.sidecar_note = "no index yet" if self.sidecar else "in memory"
            return
        try:
            index, meta = MetricsIndex.from_bytes(self.sidecar.read_bytes())
            head_length, head_hash, offset = int(meta["head_length"]), str(meta["head_hash"]), int(meta["indexed_offset"])
            if self._file_size() < offset:
                raise ValueError("the file is shorter than the index")
            if head_length and head_digest(self.path, head_length) != head_hash:
                raise ValueError("the file's first bytes differ")
        except (OSError, ValueError, KeyError, TypeError, struct.error) as exc:
            self.sidecar_note = f"rebuilding: the saved index was not usable ({exc})"
            return
        self.index, self.indexed_offset = index, offset
        self.head_length, self.head_hash = head_length, head_hash
        self.saved_version = index.version
        self.sidecar_note = f"loaded ({offset} bytes indexed)"

    def save_sidecar(self) -> bool:
        """Write the index beside the file (atomically) when it changed and covers the file from its start."""
        if self.sidecar is None:
            return False
        with self.lock:
            if self.index.version == self.saved_version or not self.indexed_offset:
                return False
            header = {
                "indexed_offset": self.indexed_offset,
                "head_length": self.head_length,
                "head_hash": self.head_hash,
                "source": str(self.path),
                "saved_at": time.time(),
            }
            data = self.index.to_bytes(header)
            version = self.index.version
        try:
            write_atomic(self.sidecar, data)
        except OSError as exc:
            self.sidecar_note = f"not saved: {exc}"
            return False
        self.saved_version = version
        return True
