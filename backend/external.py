"""Read-only watching of runs this tool did not start: TensorBoard event files and SpecForge logs -> records.

Standard library only. Nothing here writes to the watched run. `ExternalRunReader(path).poll()` returns
new records in the schema of backend/metrics.py each time, resuming by byte offset per file:
- a directory: every *tfevents* file under it (new files are picked up on later polls);
- a file named *tfevents*: that event file;
- any other file: a SpecForge console log (stdout/stderr of scripts/train_eagle3*.py).

Values of one step arrive as several events or lines. A (split, step) group is handed out when a later
step shows up in the same source, or when a poll finds the source has not grown since the previous poll:
the newest step of a quiet run comes one poll late. If values of an already handed-out group arrive
after that (a writer that paused mid-step), the group is handed out again, complete; series() in
backend/metrics.py keeps the latest record per step.
"""
from __future__ import annotations

import functools
import math
import os
import re
import struct
import time
from pathlib import Path
from typing import Any, Iterator

from backend.jsonl import read_complete_lines
from backend.metrics import PLOSS_DECAY

# ---------------------------------------------------------------- CRC32C (Castagnoli), for TFRecord framing

_CRC_TABLE = []
for _byte in range(256):
    _crc = _byte
    for _ in range(8):
        _crc = (_crc >> 1) ^ 0x82F63B78 if _crc & 1 else _crc >> 1
    _CRC_TABLE.append(_crc)
del _byte, _crc


def crc32c(data: bytes, crc: int = 0) -> int:
    crc ^= 0xFFFFFFFF
    table = _CRC_TABLE
    for byte in data:
        crc = table[(crc ^ byte) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


def masked_crc32c(data: bytes) -> int:
    """TFRecord's masked CRC: rotate right by 15 and add a constant (so CRCs of CRCs stay distinct)."""
    crc = crc32c(data)
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


# ---------------------------------------------------------------- TFRecord framing

class TFRecordFollower:
    """Reads complete TFRecords of a growing file from a byte offset.

    Record: uint64 length | uint32 masked crc32c(length) | data | uint32 masked crc32c(data), little endian.
    A record not fully written yet (or whose CRC fails at the very end of the file: a torn write) is left
    for the next poll. A bad record with data after it is skipped: a bad data CRC skips that record; a bad
    length CRC resynchronizes at the next offset where a whole valid record starts. `skipped` counts them.
    """

    HEADER = 12

    def __init__(self, path: str | os.PathLike, offset: int = 0, max_bytes_per_poll: int = 1 << 20):
        self.path = Path(path)
        self.offset = offset
        self.skipped = 0
        self.max_bytes_per_poll = max_bytes_per_poll
        self.last_size = -1
        self._stuck: tuple[int, int] | None = None  # (offset, size) where the last poll made no progress

    def poll(self) -> list[bytes]:
        try:
            size = self.path.stat().st_size
        except FileNotFoundError:
            return []
        if size < self.offset:  # truncated or replaced: start over
            self.offset = 0
        self.last_size = size
        if size == self.offset or self._stuck == (self.offset, size):
            return []
        budget = self.max_bytes_per_poll
        with open(self.path, "rb") as handle:
            while True:
                handle.seek(self.offset)
                chunk = handle.read(min(size - self.offset, budget))
                records, consumed = self._parse(chunk, at_eof=self.offset + len(chunk) >= size)
                need = self._record_size(chunk) if not consumed else 0
                if consumed or need <= len(chunk) or self.offset + need > size:
                    break
                budget = need  # one record larger than the per-poll budget: read it whole
        self.offset += consumed
        self._stuck = (self.offset, size) if not consumed else None
        return records

    def _record_size(self, chunk: bytes) -> int:
        if len(chunk) < self.HEADER or self._record_at(chunk, 0)[0] == "bad_header":
            return 0
        return self.HEADER + struct.unpack("<Q", chunk[:8])[0] + 4

    def _parse(self, chunk: bytes, at_eof: bool) -> tuple[list[bytes], int]:
        records, pos = [], 0
        while len(chunk) - pos >= self.HEADER:
            state, end = self._record_at(chunk, pos)
            if state == "ok":
                records.append(chunk[pos + self.HEADER:end - 4])
                pos = end
            elif state == "short":
                break
            elif state == "bad_data" and (end < len(chunk) or not at_eof):
                self.skipped += 1
                pos = end
            elif state == "bad_header":
                next_pos = self._resync(chunk, pos + 1)
                if next_pos is None:
                    break  # maybe torn; if it is corruption, more data will let a later poll resync
                self.skipped += 1
                pos = next_pos
            else:
                break  # bad data CRC at the end of the file: maybe torn, wait
        return records, pos

    def _record_at(self, chunk: bytes, pos: int) -> tuple[str, int]:
        header = chunk[pos:pos + 8]
        (length,) = struct.unpack("<Q", header)
        if struct.unpack("<I", chunk[pos + 8:pos + 12])[0] != masked_crc32c(header):
            return "bad_header", pos
        end = pos + self.HEADER + length + 4
        if end > len(chunk):
            return "short", end
        data = chunk[pos + self.HEADER:end - 4]
        if struct.unpack("<I", chunk[end - 4:end])[0] != masked_crc32c(data):
            return "bad_data", end
        return "ok", end

    def _resync(self, chunk: bytes, start: int) -> int | None:
        for pos in range(start, len(chunk) - self.HEADER + 1):
            state, _ = self._record_at(chunk, pos)
            if state == "ok":
                return pos
        return None


# ---------------------------------------------------------------- protobuf wire format (just enough for Event)

class ProtobufError(ValueError):
    pass


def _varint(buf: bytes, pos: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        if pos >= len(buf):
            raise ProtobufError("truncated varint")
        byte = buf[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return result, pos
        shift += 7
        if shift > 63:
            raise ProtobufError("varint longer than 10 bytes")


def iter_fields(buf: bytes) -> Iterator[tuple[int, int, Any]]:
    """(field number, wire type, value): varint -> int, 64-bit/32-bit -> raw 8/4 bytes, length-delimited -> bytes."""
    pos, size = 0, len(buf)
    while pos < size:
        key = buf[pos]
        if key < 0x80:  # one-byte keys and varints are the common case: skip the general decoder
            pos += 1
        else:
            key, pos = _varint(buf, pos)
        number, wire = key >> 3, key & 7
        if wire == 0:
            if pos < size and buf[pos] < 0x80:
                value, pos = buf[pos], pos + 1
            else:
                value, pos = _varint(buf, pos)
        elif wire == 1:
            value, pos = buf[pos:pos + 8], pos + 8
        elif wire == 2:
            length, pos = _varint(buf, pos)
            value, pos = buf[pos:pos + length], pos + length
        elif wire == 5:
            value, pos = buf[pos:pos + 4], pos + 4
        else:
            raise ProtobufError(f"unsupported wire type {wire} (field {number})")
        if pos > len(buf):
            raise ProtobufError(f"field {number} runs past the end of the message")
        yield number, wire, value


_DT_FLOAT, _DT_DOUBLE, _DT_INT32, _DT_INT64 = 1, 2, 3, 9


def _packed(value: Any, wire: int, fmt: str) -> list[float]:
    """Repeated float/double fields arrive packed (wire 2) or one per field (wire 5/1)."""
    size = struct.calcsize("<" + fmt)
    if wire == 2:
        return [x for (x,) in struct.iter_unpack("<" + fmt, value[: len(value) - len(value) % size])]
    return [struct.unpack("<" + fmt, value)[0]]


def _tensor_scalar(buf: bytes) -> float | None:
    """First element of a TensorProto: float_val / double_val / int_val / int64_val, or tensor_content bytes."""
    dtype, content, values = 0, b"", []
    for number, wire, value in iter_fields(buf):
        if number == 1 and wire == 0:
            dtype = value
        elif number == 4 and wire == 2:
            content = value
        elif number == 5 and wire in (2, 5):
            values += _packed(value, wire, "f")
        elif number == 6 and wire in (2, 1):
            values += _packed(value, wire, "d")
        elif number in (7, 10) and wire == 0:
            values.append(value - (1 << 64) if value >= 1 << 63 else value)
    if values:
        return float(values[0])
    formats = {_DT_FLOAT: "<f", _DT_DOUBLE: "<d", _DT_INT32: "<i", _DT_INT64: "<q"}
    fmt = formats.get(dtype)
    if fmt and len(content) >= struct.calcsize(fmt):
        return float(struct.unpack_from(fmt, content)[0])
    return None


def parse_event(buf: bytes) -> tuple[float | None, int, list[tuple[str, float]]]:
    """Event{wall_time=1, step=2, summary=5{value=1{tag=1, simple_value=2, tensor=8}}} -> (wall_time, step, scalars)."""
    wall_time, step, scalars = None, 0, []
    for number, wire, value in iter_fields(buf):
        if number == 1 and wire == 1:
            wall_time = struct.unpack("<d", value)[0]
        elif number == 2 and wire == 0:
            step = value - (1 << 64) if value >= 1 << 63 else value
        elif number == 5 and wire == 2:
            scalars += _summary_scalars(value)
    return wall_time, step, scalars


def _summary_scalars(buf: bytes) -> list[tuple[str, float]]:
    out = []
    for number, wire, value in iter_fields(buf):
        if number != 1 or wire != 2:
            continue
        tag, scalar = None, None
        for v_number, v_wire, v_value in iter_fields(value):
            if v_number == 1 and v_wire == 2:
                tag = v_value.decode("utf-8", "replace")
            elif v_number == 2 and v_wire == 5:
                scalar = struct.unpack("<f", v_value)[0]
            elif v_number == 8 and v_wire == 2 and scalar is None:
                scalar = _tensor_scalar(v_value)
        if tag is not None and scalar is not None:
            out.append((tag, scalar))
    return out


# ---------------------------------------------------------------- tag names -> our keys

_SPLIT_PREFIXES = {"train": "train", "eval": "val", "val": "val", "valid": "val", "validation": "val", "test": "val"}
_LIST_NAME = re.compile(r"^(?:step_|epoch_?)?(ploss|acc|acceptance_rate)_(\d+)$")
_SCALAR_NAMES = {"lr": "lr", "learning_rate": "lr", "grad_norm": "grad_norm", "loss": "loss", "ploss": "loss",
                 "weight_norm": "weight_norm", "epoch": "epoch", "tokens": "tokens", "step_time": "step_time"}


@functools.lru_cache(maxsize=4096)
def map_tag(tag: str) -> tuple[str, str, int | None] | None:
    """SpecForge tag -> (split, key, index): "eval/acc_3" -> ("val", "acc", 3); "train/lr" -> ("train", "lr", None).

    Tags without a mode prefix count as train; old names (epochacc_i, step_ploss_i) map like the new ones.
    Unknown tags -> None.
    """
    head, _, name = tag.strip().rpartition("/")
    split = _SPLIT_PREFIXES.get(head.lower().split("/")[-1]) if head else "train"
    if split is None:
        return None
    name = name.lower()
    match = _LIST_NAME.match(name)
    if match:
        return split, match.group(1), int(match.group(2))
    key = _SCALAR_NAMES.get(name)
    return (split, key, None) if key else None


# ---------------------------------------------------------------- grouping values into records

class _Assembler:
    """Collects (split, step) groups from one source in order and turns them into schema records.

    Groups handed out by a quiet-poll flush are remembered until another step shows up: values of the same
    (split, step) that arrive later are merged into them and the whole record is handed out again.
    """

    def __init__(self) -> None:
        self.groups: dict[tuple[str, int], dict[str, Any]] = {}
        self.flushed: dict[tuple[str, int], dict[str, Any]] = {}
        self.last_step: int | None = None

    def add(self, split: str, step: int, key: str, index: int | None, value: float, **extra: Any) -> list[dict]:
        """Add one value; returns the records closed by it (groups of earlier steps)."""
        done = self.close_before(step)
        if (split, step) not in self.groups and (split, step) in self.flushed:
            old = self.flushed.pop((split, step))
            self.groups[(split, step)] = {**old, "lists": {k: dict(v) for k, v in old["lists"].items()}}
        group = self.groups.setdefault((split, step), {"split": split, "step": step, "lists": {}})
        if index is None:
            group[key] = value
        else:
            group["lists"].setdefault(key, {})[index] = value
        for name, item in extra.items():
            if item is not None:
                group[name] = max(group.get(name, item), item) if name == "time" else item
        self.last_step = step
        return done

    def close_before(self, step: int) -> list[dict[str, Any]]:
        if self.last_step is None or step == self.last_step:
            return []
        self.flushed.clear()
        records = [self._record(group) for group in self.groups.values()]
        self.groups.clear()
        return records

    def flush(self) -> list[dict[str, Any]]:
        """Hand out the open groups now (the source went quiet), keeping them for late values."""
        records = [self._record(group) for group in self.groups.values()]
        self.flushed.update(self.groups)
        self.groups.clear()
        return records

    @staticmethod
    def _record(group: dict[str, Any]) -> dict[str, Any]:
        record = {k: v for k, v in group.items() if k != "lists"}
        for key, by_index in group["lists"].items():
            record[key] = [by_index.get(i, math.nan) for i in range(max(by_index) + 1)]
        if "loss" not in record and record.get("ploss"):
            record["loss"] = sum(PLOSS_DECAY**i * p for i, p in enumerate(record["ploss"]))
        if "tokens" in record:
            record["tokens"] = int(record["tokens"]) if math.isfinite(record["tokens"]) else None
        if "epoch" in record and not math.isfinite(record["epoch"]):
            record.pop("epoch")
        return {k: v for k, v in record.items() if v is not None}


class TensorBoardSource:
    """One tfevents file -> records."""

    def __init__(self, path: Path):
        self.path = path
        self.follower = TFRecordFollower(path)
        self.assembler = _Assembler()
        self.bad_events = 0

    def poll(self) -> list[dict[str, Any]]:
        size_before = self.follower.last_size
        records: list[dict[str, Any]] = []
        payloads = self.follower.poll()
        for payload in payloads:
            try:
                wall_time, step, scalars = parse_event(payload)
            except (ProtobufError, struct.error, UnicodeDecodeError):
                self.bad_events += 1
                continue
            for tag, value in scalars:
                mapped = map_tag(tag)
                if mapped is not None and step >= 0:
                    split, key, index = mapped
                    records += self.assembler.add(split, step, key, index, value, time=wall_time)
        if self.follower.last_size == size_before:
            records += self.assembler.flush()  # quiet: the file did not grow since the last poll
        return records


# ---------------------------------------------------------------- SpecForge console logs

_NUM = r"([-+]?(?:\d+\.?\d*(?:[eE][-+]?\d+)?|\.\d+(?:[eE][-+]?\d+)?|nan|inf|-inf))"
# scripts/train_eagle3.py (2025-2026): "Eval - Step {s} [{s+1}/{epochs}], position {i},  Acc: {a:.2f}"
# (printed for both modes: train first, then eval at the same step), "... pLoss: {p}", "... Acceptance Rate: {r}".
_STEP_LINE = re.compile(r"\bEval - Step (\d+)(\s*\[[^\]]*\])?\s*,\s*position (\d+)\s*,\s*(Acc|pLoss|Acceptance Rate)\s*:\s*" + _NUM)
# train_eagle3_online.py (2025): "Eval Step [{s}], position {i}, Acc: {a}" (eval only)
_STEP_BRACKET_LINE = re.compile(r"\bEval Step \[(\d+)\]\s*,\s*position (\d+)\s*,\s*(Acc|pLoss|Acceptance Rate)\s*:\s*" + _NUM)
# older scripts: "Train Epoch [{e+1}/{epochs}], position {i},  Acc: {a:.2f}", also Eval/Test Epoch
_EPOCH_LINE = re.compile(r"\b(Train|Eval|Test) Epoch \[(\d+)/\d+\]\s*,\s*position (\d+)\s*,\s*(Acc|pLoss|Acceptance Rate)\s*:\s*" + _NUM)
_TQDM_LINE = re.compile(r"\b(Training|Evaluating) Epoch (\d+)\s*:\s*(?:\s*\d+%\|[^|]*\|\s*(\d+)/(\d+))?")
_LR = re.compile(r"\b(?:lr|learning[_ ]rate)\s*[=:]\s*" + _NUM, re.IGNORECASE)
_ASCTIME = re.compile(r"^\s*(\d{2}/\d{2}/\d{4} \d{2}:\d{2}:\d{2})")
_KEYS = {"acc": "acc", "ploss": "ploss", "acceptance rate": "acceptance_rate"}


class SpecForgeLogSource:
    """A SpecForge training console log -> records.

    Mode of the "Eval - Step S [..]" lines (SpecForge prints that prefix for train and eval alike): eval
    when a tqdm "Evaluating Epoch" line came since the previous block, or when a train block of step S was
    already seen; train otherwise. Epoch-summary lines ("Train Epoch [E/N]") get step = E * steps per epoch
    when a tqdm "Training Epoch e: ... n/M" line told M, else step = E. An "lr=<x>" on any other line (e.g.
    "Restored optimizer/scheduler state: ... lr=...") goes into the next train block. The logging prefix "%m/%d/%Y %H:%M:%S" gives `time` (local time).
    """

    def __init__(self, path: Path, max_bytes_per_poll: int = 2 << 20):
        self.path = path
        self.offset = 0
        self.last_size = -1
        self.max_bytes_per_poll = max_bytes_per_poll
        self.assembler = _Assembler()
        self.block: tuple[str, int] | None = None  # (split, step) of the block being read
        self.block_keys: set[tuple[str, int]] = set()  # (key, position) values already in the block
        self.last_train_step: int | None = None
        self.eval_marker = False
        self.epoch: int | None = None
        self.steps_per_epoch: int | None = None
        self.pending_lr: float | None = None

    def poll(self) -> list[dict[str, Any]]:
        size, data, self.offset = read_complete_lines(self.path, self.offset, self.max_bytes_per_poll, b"\n\r")
        if size is None:
            return []
        records: list[dict[str, Any]] = []
        for line in re.split(rb"[\r\n]", data):
            records += self._line(line.decode("utf-8", "replace"))
        if size == self.last_size:
            records += self.assembler.flush()  # quiet: the file did not grow since the last poll
        self.last_size = size
        return records

    def _line(self, line: str) -> list[dict[str, Any]]:
        if not line.strip():
            return []
        stamp = _ASCTIME.match(line)
        when = _parse_asctime(stamp.group(1)) if stamp else None
        match = _STEP_LINE.search(line)
        if match:
            step, bracket, index, name, value = match.groups()
            return self._value(None if bracket else "val", int(step), name, int(index), value, when)
        match = _STEP_BRACKET_LINE.search(line)
        if match:
            step, index, name, value = match.groups()
            return self._value("val", int(step), name, int(index), value, when)
        match = _EPOCH_LINE.search(line)
        if match:
            mode, epoch, index, name, value = match.groups()
            epoch_done = int(epoch)
            step = epoch_done * self.steps_per_epoch if self.steps_per_epoch else epoch_done
            split = "train" if mode == "Train" else "val"
            return self._value(split, step, name, int(index), value, when, epoch=epoch_done - 1)
        self._side_info(line)
        return []

    def _side_info(self, line: str) -> None:
        tqdm = _TQDM_LINE.search(line)
        if tqdm:
            kind, epoch, _, total = tqdm.groups()
            if kind == "Evaluating":
                self.eval_marker = True
            else:
                self.epoch = int(epoch)
                if total and int(total) > 0:
                    self.steps_per_epoch = int(total)
        lr = _LR.search(line)
        if lr and not tqdm:
            self.pending_lr = float(lr.group(1))

    def _value(self, split: str | None, step: int, name: str, index: int, text: str, when: float | None,
               epoch: int | None = None) -> list[dict[str, Any]]:
        """One per-position value; split None means an "Eval - Step S [..]" line whose mode must be inferred."""
        key = _KEYS[name.lower()]
        continues = (self.block is not None and self.block[1] == step and (key, index) not in self.block_keys
                     and split in (None, self.block[0]))
        if not continues:
            if split is None:
                split = "val" if self.eval_marker or step == self.last_train_step else "train"
            self.eval_marker = False
            self.block, self.block_keys = (split, step), set()
            if split == "train":
                self.last_train_step = step
        self.block_keys.add((key, index))
        extra = {"time": when, "epoch": epoch if epoch is not None else self.epoch}
        if self.block[0] == "train" and self.pending_lr is not None:
            extra["lr"], self.pending_lr = self.pending_lr, None
        return self.assembler.add(self.block[0], step, key, index, float(text), **extra)


def _parse_asctime(text: str) -> float | None:
    try:
        return time.mktime(time.strptime(text, "%m/%d/%Y %H:%M:%S"))
    except (ValueError, OverflowError):
        return None


# ---------------------------------------------------------------- the reader the agent uses

def _is_event_file(path: Path) -> bool:
    return "tfevents" in path.name


class ExternalRunReader:
    """Follows a foreign run read-only; `poll()` returns the new records (metrics schema) since the last poll.

    path: a directory (all *tfevents* files below it, up to 4 levels, new ones included), a tfevents file,
    or a SpecForge console log file. Raises FileNotFoundError when the path does not exist.
    """

    MAX_DEPTH = 4

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        if not self.path.exists():
            raise FileNotFoundError(f"nothing to watch at {self.path} (no such file or directory); nothing was read")
        self.sources: dict[Path, TensorBoardSource | SpecForgeLogSource] = {}
        self.kind = "tensorboard" if self.path.is_dir() or _is_event_file(self.path) else "log"

    def _discover(self) -> None:
        if self.path.is_file():
            if self.path not in self.sources:
                self.sources[self.path] = (TensorBoardSource(self.path) if self.kind == "tensorboard"
                                           else SpecForgeLogSource(self.path))
            return
        base_depth = len(self.path.parts)
        for root, dirs, files in os.walk(self.path):
            dirs[:] = sorted(d for d in dirs if not d.startswith("."))
            if len(Path(root).parts) - base_depth >= self.MAX_DEPTH:
                dirs[:] = []
            for name in sorted(files):
                path = Path(root) / name
                if _is_event_file(path) and path not in self.sources:
                    self.sources[path] = TensorBoardSource(path)

    def poll(self) -> list[dict[str, Any]]:
        self._discover()
        records: list[dict[str, Any]] = []
        for path in sorted(self.sources, key=_event_file_order):
            records += self.sources[path].poll()
        return records

    def status(self) -> dict[str, Any]:
        """What is being followed and what was skipped, for the operator."""
        files = []
        for path, source in self.sources.items():
            entry: dict[str, Any] = {"path": str(path), "kind": "tensorboard" if isinstance(source, TensorBoardSource) else "log"}
            if isinstance(source, TensorBoardSource):
                entry.update(offset=source.follower.offset, skipped_records=source.follower.skipped,
                             bad_events=source.bad_events)
            else:
                entry.update(offset=source.offset)
            files.append(entry)
        return {"path": str(self.path), "kind": self.kind, "files": files}


def _event_file_order(path: Path) -> tuple[float, str]:
    """events.out.tfevents.<unix time>.<host>...: older files first, so a resumed run's records come later."""
    parts = path.name.split(".")
    try:
        stamp = float(parts[parts.index("tfevents") + 1])
    except (ValueError, IndexError):
        stamp = math.inf
    return stamp, str(path)
