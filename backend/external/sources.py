"""The machinery every watched file shares: values grouped into records, a poll's budget, reading in bounded chunks, log lines."""

from __future__ import annotations

import math
import re
import time
from pathlib import Path
from typing import Any

from backend.external.tags import EXTRAS_MAX, extra_split
from backend.jsonl import read_complete_lines
from backend.metrics.records import PLOSS_DECAY

# ---------------------------------------------------------------- grouping values into records


class Assembler:
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
        return finished_record(record)


def finished_record(record: dict[str, Any]) -> dict[str, Any]:
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


class Budget:
    """What one reader poll may still read: bytes left and a deadline."""

    def __init__(self, max_bytes: int = MAX_BYTES_PER_POLL, seconds: float = POLL_SECONDS):
        self.bytes_left = max_bytes
        self.deadline = time.monotonic() + seconds

    def spend(self, count: int) -> None:
        self.bytes_left -= max(0, count)

    @property
    def spent(self) -> bool:
        return self.bytes_left <= 0 or time.monotonic() >= self.deadline


class ChunkedSource:
    """Reads one growing file chunk by chunk within a budget; subclasses parse a chunk into records.

    Subclasses provide `offset`, `size` (-1 before the first look), `at_end` and `_read_chunk`.
    """

    CHUNK_BYTES = 1 << 20

    def __init__(self, path: Path):
        self.path = path
        self.assembler = Assembler()

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

    def poll(self, budget: Budget | None = None) -> list[dict[str, Any]]:
        budget = budget or Budget()
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


# ---------------------------------------------------------------- text logs: read a line at a time

# A number as a log prints it, bare nan/inf included.
NUMBER = r"([-+]?(?:\d+\.?\d*(?:[eE][-+]?\d+)?|\.\d+(?:[eE][-+]?\d+)?|nan|inf|-inf))"
_ASCTIME = re.compile(r"^\s*(\d{2}/\d{2}/\d{4} \d{2}:\d{2}:\d{2})")


class LineLogSource(ChunkedSource):
    """A growing text log read in chunks of whole lines; subclasses turn one line into records (`_line`).

    A chunk with no line end in it is skipped and counted in `skipped_bytes`. A logging prefix
    "%m/%d/%Y %H:%M:%S" on a line gives its `time` (local time), see `_asctime`.
    """

    CHUNK_BYTES = 1 << 20
    # plain attributes over the base's read-only properties (a class value comes first in the lookup, so they are writable)
    offset: int = 0
    size: int = -1
    at_end: bool = False

    def __init__(self, path: Path):
        super().__init__(path)
        self.skipped_bytes = 0

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
        raise NotImplementedError

    @staticmethod
    def _asctime(line: str) -> float | None:
        stamp = _ASCTIME.match(line) if line[:1].isdigit() else None
        return _parse_asctime(stamp.group(1)) if stamp else None


def _parse_asctime(text: str) -> float | None:
    try:
        return time.mktime(time.strptime(text, "%m/%d/%Y %H:%M:%S"))
    except (ValueError, OverflowError):
        return None
