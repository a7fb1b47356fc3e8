"""Read-only watching of runs this tool did not start: TensorBoard event files and SpecForge logs -> records.

Standard library only. Nothing here writes to the watched run. `ExternalRunReader(path).poll()` returns
new cleaned records (backend.metrics.records.normalize_record) each time, resuming by byte offset per file:
- a directory: every *tfevents* file under it (new files are picked up on later polls);
- a file named *tfevents*: that event file;
- any other file: a log, its format decided by its first lines (WATCH_FORMATS): a SpecForge console log
  (stdout/stderr of its trainer, `step S: {...}` lines, or the older `Eval - Step S ..., position i, Acc: a` lines),
  a plain-text log of `name value` pairs with a step, or any text log through the watcher's own line regex.
One poll reads at most MAX_BYTES_PER_POLL bytes in bounded chunks and stops early after POLL_SECONDS, so a
1 GiB file is caught up over several polls; `bytes_read` / `bytes_total` tell how far it got. No file can make a
poll hold more than one record under MAX_RECORD_BYTES (16 MiB) or wait on bytes that are no record: a larger length
header, a zero-filled gap or garbage is skipped, counted and noted (status()'s per-file `notes`), see TFRecordFollower.

A `step S: {...}` line is whole records and is handed out at once. Otherwise values of one step arrive as
several events or lines. A (split, step) group is handed out when a later step shows up in the same source,
or when a poll has read to the end of a source that has not grown since the previous poll: the newest step
of a quiet run comes one poll late. If values of an already handed-out group arrive after that (a writer
that paused mid-step), the group is handed out again, complete; series() in backend/metrics/records.py keeps the
latest record per step.
"""

from __future__ import annotations

import errno
import functools
import json
import math
import os
import re
import struct
import time
from pathlib import Path
from typing import Any, BinaryIO, Iterator, NamedTuple, overload

from backend.jsonl import read_complete_lines
from backend.metrics.records import LIST_KEYS, NONNEGATIVE_KEYS, PLOSS_DECAY, SCALAR_KEYS, SPLITS, normalize_record

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

MAX_RECORD_BYTES = 16 << 20  # a record whose length header says this much or more is skipped unread
ZERO_SKIP_BYTES = 64 << 20  # zero-filled bytes one poll reads past at most (the holes of a sparse file cost nothing)
_ZERO_RUN = re.compile(rb"\x00{5,}")  # a header of a record under the cap has zeros in length bytes 3..7
_ZERO_FILLED = "zero-filled, skipped"


def _next_data(handle: BinaryIO, pos: int, size: int) -> int:
    """The first offset at or after pos that is not in a hole of a sparse file (at most size); pos when unknown."""
    try:
        return min(size, max(pos, os.lseek(handle.fileno(), pos, os.SEEK_DATA)))
    except OSError as exc:
        return size if exc.errno == errno.ENXIO else pos  # ENXIO: only a hole is left


class TFRecordFollower:
    """Reads complete TFRecords of a growing file from a byte offset, in bounded memory and time per poll.

    Record: uint64 length | uint32 masked crc32c(length) | data | uint32 masked crc32c(data), little endian.
    A record not fully written yet (or whose CRC fails at the very end of the file: a torn write) is left
    for the next poll. Everything else that is no readable record is skipped, counted and noted (`notes`,
    the last MAX_NOTES byte ranges with what they held), never waited on:
    - a bad data CRC skips that record;
    - a bad length CRC resynchronizes at the next offset whose length header has a valid CRC (and whose
      record, when it is already whole, has a valid data CRC);
    - a zero-filled gap is read past (up to ZERO_SKIP_BYTES per poll; holes of a sparse file are seeked past);
    - a length header of MAX_RECORD_BYTES or more is skipped unread when a valid header (or the end of the
      file) follows where it says the record ends, and treated as corruption (resync) otherwise.
    `skipped` counts skipped records and resyncs, `skipped_bytes` the bytes they held. `at_end` tells whether
    the last poll read up to the end of the file (nothing complete is left unread).
    """

    HEADER = 12
    MAX_NOTES = 20

    def __init__(self, path: str | os.PathLike, offset: int = 0, max_bytes_per_poll: int = 1 << 20):
        self.path = Path(path)
        self.offset = offset
        self.skipped = 0
        self.skipped_bytes = 0
        self.max_bytes_per_poll = max_bytes_per_poll
        self.last_size = -1
        self.at_end = False
        self._stuck: tuple[int, int] | None = None  # (offset, size) where the last poll made no progress
        self._gaps: list[list[Any]] = []  # [start, end, what held there], contiguous ranges of one kind merged

    @property
    def notes(self) -> list[str]:
        """What was skipped, for the operator: "bytes A..B (N): what they held"."""
        return [f"bytes {start}..{end} ({end - start}): {what}" for start, end, what in self._gaps]

    def poll(self, max_bytes: int | None = None) -> list[bytes]:
        """Complete records after the offset, reading at most max_bytes (default: max_bytes_per_poll).

        One record larger than max_bytes_per_poll (and under MAX_RECORD_BYTES) is read whole; one that only
        exceeds a smaller max_bytes waits for a later poll.
        """
        try:
            size = self.path.stat().st_size
        except FileNotFoundError:
            self.at_end = True
            return []
        if size < self.offset:  # truncated or replaced: start over
            self.offset = 0
        self.last_size = size
        self.at_end = True
        if size == self.offset or self._stuck == (self.offset, size):
            return []
        limit = self.max_bytes_per_poll if max_bytes is None else min(max_bytes, self.max_bytes_per_poll)
        records, consumed, seen = self._read(size, limit)
        self.at_end = self.offset + seen >= size
        self.offset += consumed
        cut_short = limit < self.max_bytes_per_poll and not self.at_end
        self._stuck = (self.offset, size) if not consumed and not cut_short else None
        return records

    def _read(self, size: int, limit: int) -> tuple[list[bytes], int, int]:
        """(records, bytes consumed from the offset, bytes looked at from the offset)."""
        with open(self.path, "rb", buffering=0) as handle:  # unbuffered: _next_data moves the descriptor's offset
            zeros = self._skip_zeros(handle, size)
            if zeros:
                return [], zeros, zeros
            handle.seek(self.offset)
            chunk = handle.read(min(size - self.offset, limit))
            at_eof = self.offset + len(chunk) >= size
            records, consumed = self._parse(chunk, at_eof)
            if consumed or len(chunk) < self.HEADER:
                return records, consumed, len(chunk)
            state, end = self._record_at(chunk, 0)
            if state == "too_big":
                return [], self._skip_too_big(handle, size, chunk, end), len(chunk)
            if state == "short" and self.offset + end <= size and end > self.max_bytes_per_poll:
                handle.seek(self.offset)  # one record larger than the per-poll budget: read it whole
                chunk = handle.read(end)
                records, consumed = self._parse(chunk, at_eof=self.offset + end >= size)
            return records, consumed, len(chunk)

    def _skip_zeros(self, handle: BinaryIO, size: int) -> int:
        """Bytes of a zero-filled run at the offset to skip (0 when none starts there); at most ZERO_SKIP_BYTES
        are read, holes of a sparse file are seeked past. The last 8 zeros before data stay: they could be the
        length of a record."""
        handle.seek(self.offset)
        if size - self.offset < self.HEADER or handle.read(self.HEADER).strip(b"\0"):
            return 0  # twelve zero bytes are no header: masked_crc32c of a zero length is not zero
        pos, read = self.offset + self.HEADER, 0
        while pos < size and read < ZERO_SKIP_BYTES:
            pos = _next_data(handle, pos, size)
            handle.seek(pos)
            block = handle.read(min(1 << 20, size - pos))
            read += len(block)
            zeros = len(block) - len(block.lstrip(b"\0"))
            pos += zeros
            if zeros < len(block) or not block:
                break
        pos = min(pos, size) - 8
        if pos <= self.offset:
            return 0
        self._note(self.offset, pos, _ZERO_FILLED)
        return pos - self.offset

    def _skip_too_big(self, handle: BinaryIO, size: int, chunk: bytes, end: int) -> int:
        """A valid length header of MAX_RECORD_BYTES or more at the offset: bytes to skip."""
        length = end - self.HEADER - 4
        record_end = self.offset + end
        if record_end <= size:
            handle.seek(record_end)
            following = handle.read(self.HEADER)
            if len(following) < self.HEADER or self._record_at(following, 0)[0] != "bad_header":
                self.skipped += 1
                self._note(self.offset, record_end, f"a record of {length} bytes, over the {MAX_RECORD_BYTES}-byte cap: skipped unread")
                return end
        resync = self._resync(chunk, 1)
        self.skipped += 1
        self._note(self.offset, self.offset + resync, f"a length header claiming {length} bytes, followed by no record: corrupt, resynced")
        return resync

    def _parse(self, chunk: bytes, at_eof: bool) -> tuple[list[bytes], int]:
        records, pos = [], 0
        while len(chunk) - pos >= self.HEADER:
            state, end = self._record_at(chunk, pos)
            if state == "ok":
                records.append(chunk[pos + self.HEADER : end - 4])
                pos = end
            elif state == "bad_data" and (end < len(chunk) or not at_eof):
                self.skipped += 1
                self._note(self.offset + pos, self.offset + end, "a record whose data CRC fails, skipped")
                pos = end
            elif state == "bad_header":
                if not chunk[pos : pos + self.HEADER].strip(b"\0"):
                    break  # a zero-filled run: the next poll reads past it (_skip_zeros)
                next_pos = self._resync(chunk, pos + 1)
                if chunk[pos:next_pos].strip(b"\0"):
                    self.skipped += 1
                    self._note(self.offset + pos, self.offset + next_pos, "no record (bad length CRC), resynced")
                else:  # the last zeros of a zero-filled run
                    self._note(self.offset + pos, self.offset + next_pos, _ZERO_FILLED)
                pos = next_pos
            else:
                break  # short, too big (_read decides), or a bad data CRC at the end of the file: maybe torn, wait
        return records, pos

    def _record_at(self, chunk: bytes, pos: int) -> tuple[str, int]:
        header = chunk[pos : pos + 8]
        (length,) = struct.unpack("<Q", header)
        if struct.unpack("<I", chunk[pos + 8 : pos + 12])[0] != masked_crc32c(header):
            return "bad_header", pos
        end = pos + self.HEADER + length + 4
        if length >= MAX_RECORD_BYTES:
            return "too_big", end
        if end > len(chunk):
            return "short", end
        data = chunk[pos + self.HEADER : end - 4]
        if struct.unpack("<I", chunk[end - 4 : end])[0] != masked_crc32c(data):
            return "bad_data", end
        return "ok", end

    def _resync(self, chunk: bytes, start: int) -> int:
        """The first offset at or after start where a record under the cap may start (a valid length CRC, and a
        valid data CRC when the record is whole in the chunk); else where the chunk's last unchecked header starts.

        Only offsets whose length bytes 3..7 are zero can hold such a header, so only a few places around each run
        of five or more zeros are checked (a run's inner all-zero headers are not: their CRC cannot match).
        """
        last = len(chunk) - self.HEADER
        for run in _ZERO_RUN.finditer(chunk, min(start + 3, len(chunk))):
            a, b = run.span()
            for pos in (*range(max(start, a - 3), a), *range(max(start, a, b - 11), b - 7)):
                if pos > last:
                    return last + 1
                if self._record_at(chunk, pos)[0] in ("ok", "short"):
                    return pos
        return max(start, last + 1)

    def _note(self, start: int, end: int, what: str) -> None:
        self.skipped_bytes += end - start
        if self._gaps and self._gaps[-1][1] == start and self._gaps[-1][2] == what:
            self._gaps[-1][1] = end
        else:
            self._gaps = (self._gaps + [[start, end, what]])[-self.MAX_NOTES :]


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
    value: int | bytes
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
            value, pos = buf[pos : pos + 8], pos + 8
        elif wire == 2:
            length, pos = _varint(buf, pos)
            value, pos = buf[pos : pos + length], pos + length
        elif wire == 5:
            value, pos = buf[pos : pos + 4], pos + 4
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
    simple = _simple_scalar_event(buf)
    if simple is not None:
        return simple
    wall_time, step, scalars = None, 0, []
    for number, wire, value in iter_fields(buf):
        if number == 1 and wire == 1:
            wall_time = struct.unpack("<d", value)[0]
        elif number == 2 and wire == 0:
            step = value - (1 << 64) if value >= 1 << 63 else value
        elif number == 5 and wire == 2:
            scalars += _summary_scalars(value)
    return wall_time, step, scalars


def _simple_scalar_event(buf: bytes) -> tuple[float, int, list[tuple[str, float]]] | None:
    """The event SummaryWriter.add_scalar writes, read directly (the general decoder is ~3x slower); None otherwise.

    Bytes: 09 <wall_time f64> 10 <step varint> 2a <len> 0a <len> 0a <tag len> <tag> 15 <simple_value f32>.
    """
    size = len(buf)
    if size < 16 or buf[0] != 0x09 or buf[9] != 0x10:
        return None
    step, pos = _varint(buf, 10)
    if pos >= size or buf[pos] != 0x2A or step >= 1 << 63:
        return None
    for _ in range(2):  # summary, then its one value: each must run to the end of the event
        length, pos = _varint(buf, pos + 1)
        if pos + length != size or pos >= size or buf[pos] != 0x0A:
            return None
    tag_length, pos = _varint(buf, pos + 1)
    tag_end = pos + tag_length
    if tag_end + 5 != size or buf[tag_end] != 0x15:
        return None
    tag = buf[pos:tag_end].decode("utf-8", "replace")
    return struct.unpack_from("<d", buf, 1)[0], step, [(tag, struct.unpack_from("<f", buf, tag_end + 1)[0])]


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
# "acc_3", older "epochacc_3" / "step_ploss_1", and "per_position_acc_3"
_INDEXED_NAME = re.compile(r"^(?:step_|epoch_?|per_position_)?(ploss|acc|acceptance_rate)_(\d+)$")
# list metrics a tracker expands to "<name>/<i>" (SpecForge: eval/per_position_acc/<i>)
_LIST_NAMES = {
    "acc": "acc",
    "acces": "acc",
    "per_position_acc": "acc",
    "ploss": "ploss",
    "plosses": "ploss",
    "per_position_ploss": "ploss",
    "acceptance_rate": "acceptance_rate",
    "acceptance_rates": "acceptance_rate",
    "per_position_acceptance_rate": "acceptance_rate",
}
_SCALAR_NAMES = {
    "lr": "lr",
    "learning_rate": "lr",
    "grad_norm": "grad_norm",
    "loss": "loss",
    "ploss": "loss",
    "avg_loss": "loss",
    "weight_norm": "weight_norm",
    "epoch": "epoch",
    "tokens": "tokens",
    "step_time": "step_time",
    "perf/optimizer_step_time_s": "step_time",
}


@functools.lru_cache(maxsize=4096)
def map_tag(tag: str) -> tuple[str, str, int | None] | None:
    """SpecForge tag -> (split, key, index): "eval/per_position_acc/3" -> ("val", "acc", 3), "train/lr" -> lr.

    Tags without a mode prefix count as train; old names (eval/acc_i, epochacc_i, step_ploss_i) map like the
    new ones. Tags with no home in the record schema (train/acc and train/acceptance_rate, which are means over
    positions; eval/avg_acc, eval/simulated_acc_len, most perf/*) and unknown tags -> None.
    """
    parts = tag.strip().lower().split("/")
    index = int(parts.pop()) if len(parts) > 1 and parts[-1].isdigit() else None
    split, name = _split_and_name(parts)
    if index is not None:
        key = _LIST_NAMES.get(name)
        return (split, key, index) if key else None
    match = _INDEXED_NAME.match(name)
    if match:
        return split, match.group(1), int(match.group(2))
    key = _SCALAR_NAMES.get(name)
    return (split, key, None) if key else None


EXTRAS_MAX = 64  # tags with no home in the schema kept per record, under "extras" as the tracker named them


def extra_split(tag: str) -> str:
    """The split of a tag the schema has no key for (eval/simulated_acc_len -> val): kept under the record's "extras"."""
    return _split_and_name(tag.strip().lower().split("/"))[0]


def _split_and_name(parts: list[str]) -> tuple[str, str]:
    """The first mode component ("train", "eval", ...) gives the split; what follows it is the metric name."""
    for i, part in enumerate(parts[:-1]):
        split = _SPLIT_PREFIXES.get(part)
        if split:
            return split, "/".join(parts[i + 1 :])
    return "train", "/".join(parts)


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
        return self.add_values(split, step, [(key, index, value)], **extra)

    def add_extra(self, step: int, tag: str, value: float, **extra: Any) -> list[dict]:
        """A value whose tag has no key in the schema: kept as written under the record's "extras"."""
        done = self.add_values(extra_split(tag), step, [], **extra)
        extras = self._group(extra_split(tag), step).setdefault("extras", {})
        if tag in extras or len(extras) < EXTRAS_MAX:
            extras[tag] = value
        return done

    def add_values(self, split: str, step: int, values: list[tuple[str, int | None, float]], **extra: Any) -> list[dict]:
        """Add (key, index, value) triples of one (split, step); returns the records closed by them."""
        done = self.close_before(step)
        group = self._group(split, step)
        lists = group["lists"]
        for key, index, value in values:
            if index is None:
                group[key] = value
            else:
                lists.setdefault(key, {})[index] = value
        for name, item in extra.items():
            if item is not None:
                group[name] = max(group.get(name, item), item) if name == "time" else item
        self.last_step = step
        return done

    def _group(self, split: str, step: int) -> dict[str, Any]:
        if (split, step) not in self.groups and (split, step) in self.flushed:
            old = self.flushed.pop((split, step))
            self.groups[(split, step)] = {
                **old,
                "lists": {k: dict(v) for k, v in old["lists"].items()},
                **({"extras": dict(old["extras"])} if "extras" in old else {}),
            }
        return self.groups.setdefault((split, step), {"split": split, "step": step, "lists": {}})

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
        record = {k: (dict(v) if k == "extras" else v) for k, v in group.items() if k != "lists"}
        for key, by_index in group["lists"].items():
            record[key] = [by_index.get(i, math.nan) for i in range(max(by_index) + 1)]
        return _finished(record)


def _finished(record: dict[str, Any]) -> dict[str, Any]:
    """Derived and coerced fields: loss from the plosses when only they were logged, integer tokens."""
    if "loss" not in record and record.get("ploss"):
        record["loss"] = sum(PLOSS_DECAY**i * p for i, p in enumerate(record["ploss"]))
    if "tokens" in record:
        record["tokens"] = int(record["tokens"]) if math.isfinite(record["tokens"]) else None
    if "epoch" in record and not math.isfinite(record["epoch"]):
        record.pop("epoch")
    return {k: v for k, v in record.items() if v is not None}


# ---------------------------------------------------------------- sources: one file each, read in bounded chunks

MAX_BYTES_PER_POLL = 8 << 20
POLL_SECONDS = 0.5  # a poll stops after the chunk that crosses this, so the agent's 1 s tick stays on time


class _Budget:
    """What one reader poll may still read: bytes left and a deadline."""

    def __init__(self, max_bytes: int = MAX_BYTES_PER_POLL, seconds: float = POLL_SECONDS):
        self.bytes_left = max_bytes
        self.deadline = time.monotonic() + seconds

    def spend(self, count: int) -> None:
        self.bytes_left -= max(0, count)

    @property
    def spent(self) -> bool:
        return self.bytes_left <= 0 or time.monotonic() >= self.deadline


class _ChunkedSource:
    """Reads one growing file chunk by chunk within a budget; subclasses parse a chunk into records.

    Subclasses provide `offset`, `size` (-1 before the first look), `at_end` and `_read_chunk`.
    """

    CHUNK_BYTES = 1 << 20

    def __init__(self, path: Path):
        self.path = path
        self.assembler = _Assembler()

    @property
    def offset(self) -> int:
        """Bytes of the file consumed so far."""
        raise NotImplementedError

    @property
    def size(self) -> int:
        """The file's size at the last look; -1 before the first."""
        raise NotImplementedError

    @property
    def at_end(self) -> bool:
        """Whether the last chunk read up to the end of the file."""
        raise NotImplementedError

    def poll(self, budget: _Budget | None = None) -> list[dict[str, Any]]:
        budget = budget or _Budget()
        size_before = self.size
        records: list[dict[str, Any]] = []
        while True:
            before = self.offset
            records += self._read_chunk(min(self.CHUNK_BYTES, budget.bytes_left))
            budget.spend(self.offset - before)
            if self.at_end or self.offset == before or budget.spent:
                break
        if self.at_end and self.size == size_before:
            records += self.assembler.flush()  # quiet: read to the end, and the file did not grow since the last poll
        return records

    def _read_chunk(self, max_bytes: int) -> list[dict[str, Any]]:
        raise NotImplementedError


class TensorBoardSource(_ChunkedSource):
    """One tfevents file -> records."""

    CHUNK_BYTES = 256 << 10  # events parse at a few MiB/s in pure Python: small chunks keep a poll near its deadline

    def __init__(self, path: Path):
        super().__init__(path)
        self.follower = TFRecordFollower(path, max_bytes_per_poll=self.CHUNK_BYTES)
        self.bad_events = 0

    @property
    def offset(self) -> int:
        return self.follower.offset

    @property
    def size(self) -> int:
        return self.follower.last_size

    @property
    def at_end(self) -> bool:
        return self.follower.at_end

    def _read_chunk(self, max_bytes: int) -> list[dict[str, Any]]:
        records: list[dict[str, Any]] = []
        for payload in self.follower.poll(max_bytes):
            try:
                wall_time, step, scalars = parse_event(payload)
            except (ProtobufError, struct.error, UnicodeDecodeError):
                self.bad_events += 1
                continue
            for tag, value in scalars:
                if step < 0:
                    continue
                mapped = map_tag(tag)
                if mapped is not None:
                    split, key, index = mapped
                    records += self.assembler.add(split, step, key, index, value, time=wall_time)
                else:
                    records += self.assembler.add_extra(step, tag, value, time=wall_time)
        return records


# ---------------------------------------------------------------- SpecForge console logs

# SpecForge's trainer prints every tracker dict as `step {S}: {dict repr}`: Python repr (single quotes, bare
# nan/inf), values floats or lists of floats; keys "train/..."/"eval/..." (a tracker is set) or bare (none is).
_STEP_DICT_LINE = re.compile(r"(?<![\w/.-])step (\d+): (\{.*\})")
_DICT_ITEM = re.compile(r"""(?:'((?:[^'\\]|\\.)*)'|"((?:[^"\\]|\\.)*)")\s*:\s*(\[[^\[\]{}]*\]|[^,\[\]{}]+)""")
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


def parse_step_dict(text: str) -> dict[str, Any]:
    """`{'train/acc_0': 0.5, 'eval/per_position_acc': [0.7, nan]}` -> {key: value as read}.

    Reads Python reprs and JSON alike without evaluating anything. Fast path: a repr of str keys and finite
    numbers is JSON once its quotes are swapped (values then are whatever JSON holds; callers keep the
    numbers). Otherwise a regex scan takes quoted keys, numbers (bare nan/inf too) and flat lists of numbers
    (an item that is not a number is NaN), and skips the rest.
    """
    try:
        parsed = json.loads(text.replace("'", '"'))
    except (ValueError, RecursionError):  # RecursionError: absurdly nested brackets
        parsed = None
    return parsed if isinstance(parsed, dict) else _scan_step_dict(text)


def _scan_step_dict(text: str) -> dict[str, Any]:
    items: dict[str, Any] = {}
    for single, double, raw in _DICT_ITEM.findall(text):
        if raw.startswith("["):
            value: float | list[float] | None = [_number(item, math.nan) for item in raw[1:-1].split(",") if item.strip()]
        else:
            value = _number(raw, None)
        if value is not None:
            items[single or double] = value
    return items


@overload
def _number(text: str, default: float) -> float: ...


@overload
def _number(text: str, default: None) -> float | None: ...


def _number(text: str, default: float | None) -> float | None:
    try:
        return float(text)
    except ValueError:
        return default


class SpecForgeLogSource(_ChunkedSource):
    """A SpecForge training console log -> records.

    Current SpecForge prints `step S: {...}` for each train log interval and each evaluation; the keys say
    the split, and each line becomes its records at once. Older logs: mode of the "Eval - Step S [..]" lines
    (SpecForge printed that prefix for train and eval alike): eval when a tqdm "Evaluating Epoch" line came
    since the previous block, or when a train block of step S was already seen; train otherwise.
    Epoch-summary lines ("Train Epoch [E/N]") get step = E * steps per epoch when a tqdm "Training Epoch e:
    ... n/M" line told M, else step = E. An "lr=<x>" on any other line (e.g. "Restored optimizer/scheduler
    state: ... lr=...") goes into the next train block. The
    logging prefix "%m/%d/%Y %H:%M:%S" gives `time` (local time).
    """

    CHUNK_BYTES = 1 << 20
    # plain attributes over the base's read-only properties (a class value comes first in the lookup, so they are writable)
    offset: int = 0
    size: int = -1
    at_end: bool = False

    def __init__(self, path: Path):
        super().__init__(path)
        self.skipped_bytes = 0
        self.block: tuple[str, int] | None = None  # (split, step) of the block being read
        self.block_keys: set[tuple[str, int]] = set()  # (key, position) values already in the block
        self.last_train_step: int | None = None
        self.eval_marker = False
        self.epoch: int | None = None
        self.steps_per_epoch: int | None = None
        self.pending_lr: float | None = None

    def _read_chunk(self, max_bytes: int) -> list[dict[str, Any]]:
        start = self.offset
        size, data, self.offset = read_complete_lines(self.path, self.offset, max_bytes, b"\n\r")
        if size is None:
            self.at_end = True
            return []
        start = start if size >= start else 0  # a shrunk file is read again from its start
        self.size = size
        self.at_end = size - start <= max_bytes
        if not data and not self.at_end and max_bytes >= self.CHUNK_BYTES:
            self.offset = start + max_bytes  # a whole chunk without a line end holds no log line we read
            self.skipped_bytes += max_bytes
            return []
        records: list[dict[str, Any]] = []
        for line in data.decode("utf-8", "replace").splitlines():
            records += self._line(line)
        return records

    def _line(self, line: str) -> list[dict[str, Any]]:
        if ": {" in line:
            match = _STEP_DICT_LINE.search(line)
            if match:
                return self._step_dict(int(match.group(1)), match.group(2), self._asctime(line))
        if "position" in line:
            return self._position_line(line)
        if line.strip():
            self._side_info(line)
        return []

    @staticmethod
    def _asctime(line: str) -> float | None:
        stamp = _ASCTIME.match(line) if line[:1].isdigit() else None
        return _parse_asctime(stamp.group(1)) if stamp else None

    @staticmethod
    def _step_dict(step: int, text: str, when: float | None) -> list[dict[str, Any]]:
        """One `step S: {...}` line is whole (split, step) records: handed out at once, not grouped."""
        parsed = parse_step_dict(text)
        values = list(parsed.values())
        records = []
        for split, scalars, lists, extras in _layout_of(tuple(parsed), values).fields:
            record: dict[str, Any] = {"split": split, "step": step}
            for name, pos in scalars:
                value = values[pos]
                if type(value) is float or (type(value) is int and abs(value) < 1 << 53):  # not bool, str, None...
                    record[name] = value
            for name, slots in lists:
                record[name] = [_as_float(values[pos] if i < 0 else values[pos][i]) if pos >= 0 else math.nan for pos, i in slots]
            kept = {tag: float(values[pos]) for tag, pos in extras if type(values[pos]) is float or type(values[pos]) is int}
            if kept:
                record["extras"] = kept
            if when is not None:
                record["time"] = when
            if len(record) > 2:
                records.append(_finished(record))
        return records

    def _position_line(self, line: str) -> list[dict[str, Any]]:
        when = self._asctime(line)
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

    def _value(self, split: str | None, step: int, name: str, index: int, text: str, when: float | None, epoch: int | None = None) -> list[dict[str, Any]]:
        """One per-position value; split None means an "Eval - Step S [..]" line whose mode must be inferred."""
        key = _KEYS[name.lower()]
        block = self.block
        continues = block is not None and block[1] == step and (key, index) not in self.block_keys and split in (None, block[0])
        if block is None or not continues:
            if split is None:
                split = "val" if self.eval_marker or step == self.last_train_step else "train"
            self.eval_marker = False
            block = (split, step)
            self.block, self.block_keys = block, set()
            if split == "train":
                self.last_train_step = step
        self.block_keys.add((key, index))
        extra = {"time": when, "epoch": epoch if epoch is not None else self.epoch}
        if block[0] == "train" and self.pending_lr is not None:
            extra["lr"], self.pending_lr = self.pending_lr, None
        return self.assembler.add(block[0], step, key, index, float(text), **extra)


# ---------------------------------------------------------------- plain-text training logs

# What `w` reads, for the operator (the watch modal and a refusal say it).
WATCH_FORMATS = (
    "tensorboard: a directory of *tfevents* files (up to 4 levels down), or one tfevents file",
    "specforge: a SpecForge console log (`step S: {...}` lines, or `Eval - Step S, position i, Acc: a` lines)",
    "text: a plain-text log whose lines hold `name value` pairs with a step, e.g. "
    "`[train] step 260/300 loss 6.4713 acc0 0.784 lr 4.40e-04` or `epoch 1 step 200 loss 8.38 acc0 0.246 lr 1.2e-04`",
    "regex: any text log, through a line regex with named groups: step (required), split, epoch, loss, lr, grad_norm, "
    "acc0, acc1, ..., ploss0, ... (e.g. `it=(?P<step>\\d+) l=(?P<loss>\\S+)`)",
)
SNIFF_BYTES = 1 << 20  # a log with no line in a known format in this much of its start is "unknown"
_TEXT_TOKEN = re.compile(r"([A-Za-z][A-Za-z0-9_./-]*)|([-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?)(?:/\d+)?")
_STEP_NAMES = frozenset({"step", "global_step", "iter", "iteration"})
_VAL_WORDS = frozenset({"val", "valid", "validation", "eval", "evaluation", "evaluating", "test"})
_TEXT_INDEXED = re.compile(r"^(acc|ploss|acceptance_rate)_?(\d+)$")
_TEXT_ALIASES = {"grad": "grad_norm", "gnorm": "grad_norm", "time": "step_time"}
_TEXT_LISTS = {"acc": "acc", "ploss": "ploss", "plosses": "ploss", "acceptance_rate": "acceptance_rate"}
_NOT_NUMBERS = frozenset({"nan", "inf"})


class _TextRecord:
    """The values of one plain-text line being read: `name value` pairs folded into a record."""

    def __init__(self) -> None:
        self.split = "train"
        self.step: int | None = None
        self.values: dict[str, Any] = {}
        self.positions: dict[str, dict[int, float]] = {}

    def add(self, name: str, numbers: list[float]) -> None:
        name = name.lower().strip("[]:,")
        if name in _STEP_NAMES:
            if numbers[0] >= 0 and numbers[0] == int(numbers[0]):
                self.step = int(numbers[0])
            return
        indexed = _TEXT_INDEXED.match(name)
        if indexed:
            self.positions.setdefault(indexed.group(1), {})[int(indexed.group(2))] = numbers[0]
            return
        if name in _TEXT_LISTS and len(numbers) > 1:  # "acc 0.70 0.61 0.52": every position
            self.positions.setdefault(_TEXT_LISTS[name], {}).update(enumerate(numbers))
            return
        mapped = map_tag(_TEXT_ALIASES.get(name, name))
        if mapped is None:
            return
        split, key, index = mapped
        if split == "val":
            self.split = "val"
        if index is None:
            self.values.setdefault(key, numbers[0])
        else:
            self.positions.setdefault(key, {})[index] = numbers[0]

    def record(self) -> dict[str, Any] | None:
        if self.step is None or not (self.values or self.positions):
            return None
        record: dict[str, Any] = {"split": self.split, "step": self.step, **self.values}
        for key, slots in self.positions.items():
            record[key] = [slots.get(i, math.nan) for i in range(max(slots) + 1)]
        return _finished(record)


def parse_text_line(line: str) -> dict[str, Any] | None:
    """A `name value ...` line with a step -> one record, else None: `[train] step 260/300 loss 6.47 acc0 0.78 lr 4.4e-04`.

    Names are the record's keys or their common spellings (lr, learning_rate, grad, grad_norm, acc0, acc_0, eval/loss);
    a name followed by several numbers is a per-position list ("acc 0.70 0.61"); "val"/"eval"/"validation" anywhere makes
    it a val record; "260/300" reads as 260; names not known (units, "s/step") are skipped."""
    found = _TextRecord()
    name: str | None = None
    numbers: list[float] = []
    for match in _TEXT_TOKEN.finditer(line):
        word, number = match.groups()
        if word is not None and word.lower() not in _NOT_NUMBERS:
            if name is not None and numbers:
                found.add(name, numbers)
            name, numbers = word, []
            if word.lower().strip("[]") in _VAL_WORDS:
                found.split = "val"
            continue
        numbers.append(float(number if number is not None else word))
    if name is not None and numbers:
        found.add(name, numbers)
    return found.record()


def compile_line_format(pattern: str) -> re.Pattern[str]:
    """A user's line regex, checked: it compiles and has a `step` group; ValueError says what is wrong."""
    try:
        compiled = re.compile(pattern)
    except re.error as exc:
        raise ValueError(f"line format {pattern!r} is not a regular expression: {exc}") from None
    if "step" not in compiled.groupindex:
        raise ValueError(f"line format {pattern!r} has no (?P<step>...) group; every record needs its step")
    if len(compiled.groupindex) < 2:
        raise ValueError(f"line format {pattern!r} names no value besides the step (e.g. (?P<loss>\\S+))")
    return compiled


def parse_format_line(pattern: re.Pattern[str], line: str) -> dict[str, Any] | None:
    """One line through a user's line regex: its named groups are the record's names (step, split, loss, acc0...)."""
    match = pattern.search(line)
    if match is None:
        return None
    found = _TextRecord()
    for name, text in match.groupdict().items():
        if text is None:
            continue
        if name == "split":
            found.split = "val" if text.strip("[] ").lower() in _VAL_WORDS else "train"
            continue
        numbers = [float(n) for n in re.findall(_NUM, text, re.IGNORECASE)]
        if numbers:
            found.add(name, numbers)
    return found.record()


class TextLogSource(SpecForgeLogSource):
    """A plain-text training log -> records, a line at a time: the built-in `name value` reading, or a line regex."""

    def __init__(self, path: Path, line_format: re.Pattern[str] | None = None):
        super().__init__(path)
        self.line_format = line_format

    def _line(self, line: str) -> list[dict[str, Any]]:
        record = parse_format_line(self.line_format, line) if self.line_format is not None else parse_text_line(line)
        if record is None:
            return []
        when = self._asctime(line)
        if when is not None:
            record["time"] = when
        return [record]


def _is_specforge_line(line: str) -> bool:
    if ": {" in line and _STEP_DICT_LINE.search(line):
        return True
    return "position" in line and any(p.search(line) for p in (_STEP_LINE, _STEP_BRACKET_LINE, _EPOCH_LINE))


def sniff_log_format(path: Path, line_format: re.Pattern[str] | None = None) -> tuple[str | None, int]:
    """(the format of a log file: "specforge", "text", "regex" or None while no line of its start is in one, the bytes
    looked at). ValueError for a file that is not text (NUL bytes near its start)."""
    with open(path, "rb") as handle:
        head = handle.read(SNIFF_BYTES)
    if b"\x00" in head[:4096]:
        raise ValueError(f"{path} holds binary data, not a text log; w reads: " + "; ".join(WATCH_FORMATS))
    lines = (head if len(head) < SNIFF_BYTES else head[: max(head.rfind(b"\n"), 0)]).decode("utf-8", "replace").splitlines()
    if line_format is not None:
        return ("regex" if any(parse_format_line(line_format, line) for line in lines) else None), len(head)
    if any(_is_specforge_line(line) for line in lines):  # first: a SpecForge log's side lines may read as `name value` pairs
        return "specforge", len(head)
    return ("text" if any(parse_text_line(line) for line in lines) else None), len(head)


class _Layout(NamedTuple):
    """Where each record field sits in a step dict: per split, scalar fields (name, item position) and list
    fields (name, per TTT position (item position, list index, or -1 for a scalar item; (-1, -1) when absent)).
    `shape` holds (item position, length) of the list items the layout was worked out for."""

    shape: tuple[tuple[int, int], ...]
    fields: tuple[tuple[str, tuple[tuple[str, int], ...], tuple[tuple[str, tuple[tuple[int, int], ...]], ...], tuple[tuple[str, int], ...]], ...]

    def fits(self, values: list[Any]) -> bool:
        return all(type(values[pos]) is list and len(values[pos]) == length for pos, length in self.shape)


_LAYOUTS: dict[tuple[str, ...], _Layout] = {}


def _layout_of(keys: tuple[str, ...], values: list[Any]) -> _Layout:
    """SpecForge logs the same keys every time, so a layout is worked out once per kind of line and reused."""
    layout = _LAYOUTS.get(keys)
    if layout is None or not layout.fits(values):
        if len(_LAYOUTS) >= 256:
            _LAYOUTS.clear()
        shape = tuple((pos, len(value)) for pos, value in enumerate(values) if type(value) is list)
        layout = _LAYOUTS[keys] = _layout(keys, shape)
    return layout


@functools.lru_cache(maxsize=256)
def _layout(keys: tuple[str, ...], shape: tuple[tuple[int, int], ...]) -> _Layout:
    """A list value stands for the tracker's "<key>/<i>" scalars."""
    lengths = dict(shape)
    scalars: dict[str, dict[str, int]] = {}
    lists: dict[str, dict[str, dict[int, tuple[int, int]]]] = {}
    extras: dict[str, dict[str, int]] = {}  # scalar items with no key in the schema: kept under "extras"
    for pos, key in enumerate(keys):
        tags = [(f"{key}/{i}", i) for i in range(lengths[pos])] if pos in lengths else [(key, -1)]
        for tag, item in tags:
            mapped = map_tag(tag)
            if mapped is None:
                kept = extras.setdefault(extra_split(tag), {})
                if item < 0 and len(kept) < EXTRAS_MAX:
                    kept[tag] = pos
                continue
            split, name, index = mapped
            if index is None:
                scalars.setdefault(split, {})[name] = pos
            else:
                lists.setdefault(split, {}).setdefault(name, {})[index] = (pos, item)
    fields = []
    for split in dict.fromkeys([*scalars, *lists, *extras]):
        list_fields = tuple((name, tuple(slots.get(i, (-1, -1)) for i in range(max(slots) + 1))) for name, slots in lists.get(split, {}).items())
        fields.append((split, tuple(scalars.get(split, {}).items()), list_fields, tuple(extras.get(split, {}).items())))
    return _Layout(shape, tuple(fields))


def _as_float(value: Any) -> float:
    if type(value) is float:
        return value
    try:
        return float(value) if type(value) is int else math.nan
    except OverflowError:
        return math.nan


def _parse_asctime(text: str) -> float | None:
    try:
        return time.mktime(time.strptime(text, "%m/%d/%Y %H:%M:%S"))
    except (ValueError, OverflowError):
        return None


# ---------------------------------------------------------------- the reader the agent uses


def _is_event_file(path: Path) -> bool:
    return "tfevents" in path.name


class ExternalRunReader:
    """Follows a foreign run read-only; `poll()` returns the new cleaned records (metrics schema) since the last poll.

    path: a directory (all *tfevents* files below it, up to 4 levels, new ones included), a tfevents file,
    or a SpecForge console log file. Raises FileNotFoundError when the path does not exist. One poll reads at
    most MAX_BYTES_PER_POLL bytes over all files (older event files first) and stops after POLL_SECONDS;
    `bytes_read` / `bytes_total` say how far the reader got. Records that fail normalize_record are counted in
    `bad_records` and left out.
    """

    MAX_DEPTH = 4
    MAX_PROBLEMS = 20

    def __init__(
        self,
        path: str | os.PathLike,
        max_bytes_per_poll: int = MAX_BYTES_PER_POLL,
        poll_seconds: float = POLL_SECONDS,
        line_format: str | None = None,
    ):
        self.path = Path(path)
        if not self.path.exists():
            raise FileNotFoundError(f"nothing to watch at {self.path} (no such file or directory); nothing was read")
        self.sources: dict[Path, TensorBoardSource | SpecForgeLogSource] = {}
        self.kind = "tensorboard" if self.path.is_dir() or _is_event_file(self.path) else "log"
        if max_bytes_per_poll < SpecForgeLogSource.CHUNK_BYTES:
            raise ValueError(f"max_bytes_per_poll must be at least {SpecForgeLogSource.CHUNK_BYTES} (one log chunk)")
        self.line_format = compile_line_format(line_format) if line_format else None
        if self.line_format is not None and self.kind != "log":
            raise ValueError(f"a line format reads text logs; {self.path} is TensorBoard data; nothing is watched")
        self.max_bytes_per_poll = max_bytes_per_poll
        self.poll_seconds = poll_seconds
        self.bad_records = 0
        self.problems: list[str] = []
        self.format: str | None = "tensorboard" if self.kind == "tensorboard" else None
        self.sniffed_bytes = 0
        if self.kind == "log":
            self._sniff()

    @property
    def warning(self) -> str | None:
        """Why the watch may show nothing: a log with no line in a format w reads (yet); None once one is found."""
        if self.format is not None:
            return None
        if self.sniffed_bytes == 0:
            return None  # empty so far: the first lines decide
        seen = f"the first {self.sniffed_bytes:,} bytes of {self.path}"
        what = f"line format {self.line_format.pattern!r}" if self.line_format is not None else "a format w reads"
        ending = "; read as a SpecForge log from here on" if self.sniffed_bytes >= SNIFF_BYTES else "; records appear once such a line comes"
        return f"no line in {seen} is in {what} ({'; '.join(WATCH_FORMATS)}){ending}"

    def _sniff(self) -> None:
        """Decide a log's format from its start, while undecided and the start is still being written."""
        if self.format is not None or self.sniffed_bytes >= SNIFF_BYTES:
            return
        self.format, self.sniffed_bytes = sniff_log_format(self.path, self.line_format)
        undecided = self.format is None and self.sniffed_bytes >= SNIFF_BYTES  # then read as the user's regex, or SpecForge's as before
        if self.format == "specforge" or (undecided and self.line_format is None):
            self.sources[self.path] = SpecForgeLogSource(self.path)
        elif self.format is not None or undecided:
            self.sources[self.path] = TextLogSource(self.path, self.line_format)

    @property
    def bytes_read(self) -> int:
        """Bytes consumed so far, over all followed files."""
        return sum(source.offset for source in self.sources.values())

    @property
    def bytes_total(self) -> int:
        """Sizes of the followed files when last looked at."""
        return sum(max(source.size, source.offset) for source in self.sources.values())

    def _discover(self) -> None:
        if self.kind == "log":
            self._sniff()
            return
        if self.path.is_file():
            if self.path not in self.sources:
                self.sources[self.path] = TensorBoardSource(self.path)
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
        budget = _Budget(self.max_bytes_per_poll, self.poll_seconds)
        records: list[dict[str, Any]] = []
        for path in sorted(self.sources, key=_event_file_order):
            if budget.spent:
                break  # the rest waits for the next poll; older files come first, as a resumed run wrote them
            records += self.sources[path].poll(budget)
        return self._cleaned(records)

    def _cleaned(self, records: list[dict[str, Any]]) -> list[dict[str, Any]]:
        out = []
        for record in records:
            if plainly_clean(record):
                out.append(record)
                continue
            clean, problems = normalize_record(record)
            if clean is None:
                self.bad_records += 1
                note = f"step {record.get('step')!r} ({record.get('split')}): " + "; ".join(problems)
                self.problems = (self.problems + [note])[-self.MAX_PROBLEMS :]
            else:
                out.append(clean)
        return out

    def status(self) -> dict[str, Any]:
        """What is being followed and what was skipped, for the operator."""
        files = []
        for path, source in self.sources.items():
            entry: dict[str, Any] = {"path": str(path), "offset": source.offset, "size": max(source.size, 0)}
            if isinstance(source, TensorBoardSource):
                follower = source.follower
                entry.update(
                    kind="tensorboard",
                    skipped_records=follower.skipped,
                    skipped_bytes=follower.skipped_bytes,
                    bad_events=source.bad_events,
                    notes=follower.notes,
                )
            else:
                entry.update(kind="log", format=self.format, skipped_bytes=source.skipped_bytes)
            files.append(entry)
        return {
            "path": str(self.path),
            "kind": self.kind,
            "format": self.format,
            "warning": self.warning,
            "files": files,
            "bytes_read": self.bytes_read,
            "bytes_total": self.bytes_total,
            "bad_records": self.bad_records,
            "problems": list(self.problems),
        }


def plainly_clean(record: dict[str, Any]) -> bool:
    """True only when normalize_record would accept the record and hand it back unchanged.

    A cheap check of exact builtin types (int/float, lists of float) in the schema's shapes; anything else
    (other keys, other types) answers False and goes through normalize_record, which costs ~50x more per record.
    """
    step = record.get("step")
    if type(step) is not int or step < 0 or record.get("split") not in SPLITS:
        return False
    for key, value in record.items():
        if key in _SCALAR_KEY_SET:
            if (type(value) is not float and type(value) is not int) or (key in _NONNEGATIVE_KEY_SET and value < 0):
                return False
        elif key in _LIST_KEY_SET:
            if type(value) is not list or not all(type(item) is float for item in value):
                return False
        elif key == "tokens":
            if type(value) is not int or value < 0:
                return False
        elif key != "step" and key != "split":
            return False
    return True


_SCALAR_KEY_SET, _LIST_KEY_SET = frozenset(SCALAR_KEYS), frozenset(LIST_KEYS)
_NONNEGATIVE_KEY_SET = frozenset(NONNEGATIVE_KEYS)


def _event_file_order(path: Path) -> tuple[float, str]:
    """events.out.tfevents.<unix time>.<host>...: older files first, so a resumed run's records come later."""
    parts = path.name.split(".")
    try:
        stamp = float(parts[parts.index("tfevents") + 1])
    except (ValueError, IndexError):
        stamp = math.inf
    return stamp, str(path)
