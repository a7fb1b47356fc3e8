"""The whole-history series summary: per series, min/max/first/last/sum/count/non-finite buckets over the step axis, with coarser levels.

Standard library only. A series is one plotted quantity ("train.loss", "val.acc.3", "lr", ...). Each value
lands in one fine bucket of its step: BUCKETS_PER_OCTAVE log-spaced buckets per octave below FINE_LINEAR_FROM
(so a log-step plot of a long run still has points in its first decades), FINE_WIDTH-step buckets above.
Level L merges LEVEL_FANOUT**L neighbouring fine buckets; levels are rebuilt lazily from the first changed
fine bucket. A query ("steps [a, b] at N buckets", linear or log-spaced) reads the coarsest level whose
buckets fit the narrowest interval, with array slices per interval (its edges snap to that level's buckets),
so a million-step history answers in milliseconds.

Bucket semantics (what a brute-force pass over the records gives): `count` finite values, `nonfinite`
NaN/inf values (never in min/max/sum), `min`/`max`, `first`/`last` the finite value at the lowest/highest
step (ties: the earlier/later in file order), `step_lo`/`step_hi` the lowest/highest step with any value.
"""

from __future__ import annotations

import math
from array import array
from bisect import bisect_left, bisect_right
from typing import Any, Iterator, Sequence

FINE_WIDTH = 128  # steps per fine bucket in the linear part
FINE_LINEAR_FROM = 8192  # below this step, buckets are log-spaced
BUCKETS_PER_OCTAVE = 64
LEVEL_FANOUT_BITS = 2  # level L+1 merges 4 buckets of level L
MAX_LEVELS = 12
MAX_QUERY_POINTS = 4096
FIELDS = ("step_lo", "step_hi", "first_step", "first", "last_step", "last", "min", "max", "sum", "count", "nonfinite")
LO, HI, FIRST_STEP, FIRST, LAST_STEP, LAST, MIN, MAX, SUM, COUNT, NONFINITE = range(len(FIELDS))


def _log_starts() -> list[int]:
    """Start steps of the fine buckets below FINE_LINEAR_FROM: 0, 1, 2, ... then about 64 per octave."""
    starts = [0]
    octaves = int(math.log2(FINE_LINEAR_FROM))
    for i in range(BUCKETS_PER_OCTAVE * octaves):
        start = int(2 ** (i / BUCKETS_PER_OCTAVE))
        if starts[-1] < start < FINE_LINEAR_FROM:
            starts.append(start)
    return starts


_LOG_STARTS = _log_starts()
_LINEAR_BASE = len(_LOG_STARTS)  # id of the first linear bucket, which starts at FINE_LINEAR_FROM


def bucket_of(step: int) -> int:
    """Fine bucket id of a step (ids grow with step)."""
    if step >= FINE_LINEAR_FROM:
        return _LINEAR_BASE + (step - FINE_LINEAR_FROM) // FINE_WIDTH
    return bisect_right(_LOG_STARTS, step) - 1


def bucket_start(bucket: int) -> int:
    """The lowest step of a fine bucket."""
    if bucket >= _LINEAR_BASE:
        return FINE_LINEAR_FROM + (bucket - _LINEAR_BASE) * FINE_WIDTH
    return _LOG_STARTS[max(0, bucket)]


def first_bucket_from(step: int) -> int:
    """The smallest fine bucket id whose start is >= step."""
    bucket = bucket_of(max(0, step))
    return bucket if bucket_start(bucket) >= step else bucket + 1


def row_of(steps: Sequence[int], values: Sequence[float]) -> tuple:
    """One partial bucket from aligned points, steps ascending (ties in file order)."""
    total = sum(values)
    if total - total == 0.0:  # every value finite (NaN/inf, or an overflow, make the sum non-finite)
        finite_steps, finite = steps, values
    else:
        pairs = [(s, v) for s, v in zip(steps, values) if v - v == 0.0]
        finite_steps, finite = [s for s, _ in pairs], [v for _, v in pairs]
        total = sum(finite)
    count = len(finite)
    if not count:
        return (steps[0], steps[-1], math.inf, math.nan, -math.inf, math.nan, math.inf, -math.inf, 0.0, 0.0, float(len(values)))
    return (
        steps[0],
        steps[-1],
        finite_steps[0],
        finite[0],
        finite_steps[-1],
        finite[-1],
        min(finite),
        max(finite),
        total,
        float(count),
        float(len(values) - count),
    )


def column_rows(steps: Sequence[int], values: Sequence[float]) -> Iterator[tuple[int, tuple]]:
    """(fine bucket, partial bucket) of aligned points, steps ascending: one row per bucket, buckets ascending."""
    n = len(steps)
    i = 0
    while i < n:
        bucket = bucket_of(steps[i])
        end = bisect_left(steps, bucket_start(bucket + 1), i) if steps[-1] >= bucket_start(bucket + 1) else n
        yield bucket, row_of(steps[i:end], values[i:end])
        i = end


def merge_rows(a: Sequence[float], b: Sequence[float]) -> tuple:
    """Two partial buckets -> one; b is later in file order, so it wins ties of `last` and loses ties of `first`."""
    first = (b[FIRST_STEP], b[FIRST]) if b[FIRST_STEP] < a[FIRST_STEP] else (a[FIRST_STEP], a[FIRST])
    last = (b[LAST_STEP], b[LAST]) if b[COUNT] and b[LAST_STEP] >= a[LAST_STEP] else (a[LAST_STEP], a[LAST])
    return (
        min(a[LO], b[LO]),
        max(a[HI], b[HI]),
        first[0],
        first[1],
        last[0],
        last[1],
        min(a[MIN], b[MIN]),
        max(a[MAX], b[MAX]),
        a[SUM] + b[SUM],
        a[COUNT] + b[COUNT],
        a[NONFINITE] + b[NONFINITE],
    )


class Level:
    """Buckets of one resolution sorted by id: an id array and one float array per field."""

    def __init__(self) -> None:
        self.ids = array("q")
        self.cols = [array("d") for _ in FIELDS]

    def __len__(self) -> int:
        return len(self.ids)

    def row(self, i: int) -> tuple:
        return tuple(col[i] for col in self.cols)

    def find(self, bucket: int) -> int:
        """Position of `bucket` in ids, or where it would be inserted."""
        ids = self.ids
        if not ids or ids[-1] < bucket:
            return len(ids)
        return bisect_left(ids, bucket)

    def merge(self, bucket: int, row: Sequence[float]) -> None:
        """Fold a partial bucket into bucket `bucket` (appending is the common case)."""
        i = self.find(bucket)
        if i < len(self.ids) and self.ids[i] == bucket:
            for col, value in zip(self.cols, merge_rows(self.row(i), row)):
                col[i] = value
        elif i == len(self.ids):
            self.ids.append(bucket)
            for col, value in zip(self.cols, row):
                col.append(value)
        else:
            self.ids.insert(i, bucket)
            for col, value in zip(self.cols, row):
                col.insert(i, value)

    def truncate(self, position: int) -> None:
        del self.ids[position:]
        for col in self.cols:
            del col[position:]

    def to_bytes(self) -> bytes:
        return self.ids.tobytes() + b"".join(col.tobytes() for col in self.cols)

    @classmethod
    def from_bytes(cls, data: bytes, count: int) -> "Level":
        level = cls()
        id_bytes = count * level.ids.itemsize
        col_bytes = count * level.cols[0].itemsize
        if len(data) != id_bytes + col_bytes * len(FIELDS):
            raise ValueError(f"level of {count} buckets needs {id_bytes + col_bytes * len(FIELDS)} bytes, got {len(data)}")
        level.ids.frombytes(data[:id_bytes])
        for i, col in enumerate(level.cols):
            start = id_bytes + i * col_bytes
            col.frombytes(data[start : start + col_bytes])
        return level


class Series:
    """One series: fine buckets (level 0) and lazily rebuilt coarser levels."""

    def __init__(self, fine: Level | None = None, coarser: list[Level] | None = None) -> None:
        self.levels = [fine or Level(), *(coarser or [])]
        self.dirty_from: int | None = None if coarser else 0

    @property
    def fine(self) -> Level:
        return self.levels[0]

    def add(self, steps: Sequence[int], values: Sequence[float]) -> None:
        """Fold points; steps must be ascending (ties in file order)."""
        fine = self.fine
        first_changed = None
        for bucket, row in column_rows(steps, values):
            fine.merge(bucket, row)
            if first_changed is None:
                first_changed = bucket
        if first_changed is not None:
            self._touched(first_changed)

    def add_rows(self, ids: Sequence[int], cols: Sequence[Sequence[float]]) -> None:
        """Fold partial buckets in the order they were made (what `add` would fold, row i = ids[i] and cols[f][i]).

        A run of ids past the last fine bucket, each above the one before, is appended whole (what merge does
        one by one); anything else merges row by row, so the result is `add`'s to the bit.
        """
        fine = self.fine
        i, n = 0, len(ids)
        if n:
            self._touched(min(ids))
        while i < n:
            top = fine.ids[-1] if len(fine) else -1
            j = i
            while j < n and ids[j] > top:
                top = ids[j]
                j += 1
            if j > i:
                fine.ids.extend(ids[i:j])
                for col, source in zip(fine.cols, cols):
                    col.extend(source[i:j])
                i = j
            else:
                fine.merge(ids[i], tuple(source[i] for source in cols))
                i += 1

    def _touched(self, bucket: int) -> None:
        self.dirty_from = bucket if self.dirty_from is None else min(self.dirty_from, bucket)

    def level(self, number: int) -> Level:
        self._rebuild()
        return self.levels[min(number, len(self.levels) - 1)]

    def _rebuild(self) -> None:
        """Recompute coarser levels from the first fine bucket changed since the last rebuild."""
        if self.dirty_from is None:
            return
        dirty = self.dirty_from
        self.dirty_from = None
        for number in range(1, MAX_LEVELS):
            child = self.levels[number - 1]
            if len(child) <= 1 and number >= len(self.levels):
                break
            if number >= len(self.levels):
                self.levels.append(Level())
            parent = self.levels[number]
            first_parent = dirty >> (LEVEL_FANOUT_BITS * number)
            parent.truncate(parent.find(first_parent))
            _merge_up(child, child.find(first_parent << LEVEL_FANOUT_BITS), parent)
        while len(self.levels) > 1 and len(self.levels[-1]) == 0:
            self.levels.pop()

    def span(self) -> tuple[int, int] | None:
        """First and last step with a value: fine buckets are in step order, so the first and the last bucket hold them."""
        fine = self.fine
        if not len(fine):
            return None
        return int(fine.cols[LO][0]), int(fine.cols[HI][-1])


def _merge_up(child: Level, start: int, parent: Level) -> None:
    """Append to `parent` the merge of child buckets from position `start` on (ids ascending, so parents are too)."""
    ids, cols = child.ids, child.cols
    if start >= len(child):
        return
    current = ids[start] >> LEVEL_FANOUT_BITS
    row = tuple(col[start] for col in cols)
    for i in range(start + 1, len(child)):
        bucket = ids[i] >> LEVEL_FANOUT_BITS
        found = tuple(col[i] for col in cols)
        if bucket == current:
            row = merge_rows(row, found)
        else:
            parent.merge(current, row)
            current, row = bucket, found
    parent.merge(current, row)


def edges(step_from: int, step_to: int, points: int, log_x: bool) -> list[int]:
    """points+1 ascending integer edges splitting [step_from, step_to] (log-spaced from max(step_from, 1) when log_x)."""
    points = max(1, min(points, MAX_QUERY_POINTS))
    end = step_to + 1
    if log_x:
        lo = math.log10(max(step_from, 1))
        hi = math.log10(max(end, 2))
        raw = [int(math.ceil(10 ** (lo + (hi - lo) * i / points))) for i in range(points + 1)]
        raw[0] = step_from
    else:
        raw = [step_from + (end - step_from) * i // points for i in range(points + 1)]
    raw[-1] = end
    out = [raw[0]]
    for edge in raw[1:]:
        if edge > out[-1]:
            out.append(edge)
    return out


def to_bucket(row: Sequence[float]) -> dict[str, Any]:
    """A merged row as the wire's bucket: JSON numbers, None where nothing finite was seen."""
    count = int(row[COUNT])
    finite = count > 0
    return {
        "step_lo": int(row[LO]),
        "step_hi": int(row[HI]),
        "min": row[MIN] if finite else None,
        "max": row[MAX] if finite else None,
        "first": row[FIRST] if finite else None,
        "last": row[LAST] if finite else None,
        "mean": row[SUM] / count if finite else None,
        "count": count,
        "nonfinite": int(row[NONFINITE]),
    }


def query_plan(series: Series, step_from: int, step_to: int, points: int, log_x: bool = False) -> tuple[int, list[int]]:
    """(level, cuts): the coarsest level whose buckets are no wider than half the narrowest interval, and the
    interval edges as fine-bucket ids snapped to that level's boundaries (so every bucket falls in one interval)."""
    fine_cuts = sorted({first_bucket_from(edge) for edge in edges(step_from, step_to, points, log_x)})
    widths = [b - a for a, b in zip(fine_cuts, fine_cuts[1:])]
    narrowest = min(widths) if widths else 1
    number = 0
    series.level(0)  # rebuild coarser levels if needed
    while number + 1 < len(series.levels) and (1 << (LEVEL_FANOUT_BITS * (number + 1))) * 2 <= narrowest:
        number += 1
    shift = LEVEL_FANOUT_BITS * number
    last = ((fine_cuts[-1] + (1 << shift) - 1) >> shift) << shift  # the end rounds up, the other edges down
    snapped = sorted({(cut >> shift) << shift for cut in fine_cuts[:-1]} | {last})
    return number, snapped


def query_cuts(series: Series, step_from: int, step_to: int, points: int, log_x: bool = False) -> list[int]:
    """The interval edges (as steps) a query of these arguments uses: what a brute-force check must use too."""
    return [bucket_start(cut) for cut in query_plan(series, step_from, step_to, points, log_x)[1]]


def query(series: Series, step_from: int, step_to: int, points: int, log_x: bool = False) -> list[dict[str, Any]]:
    """Buckets of `series` over [step_from, step_to], at most `points` of them (empty intervals left out).

    One level is read with array slices per interval (min/max/sum in C), never point by point.
    """
    number, cuts = query_plan(series, step_from, step_to, points, log_x)
    level = series.level(number)
    shift = LEVEL_FANOUT_BITS * number
    ids, cols = level.ids, level.cols
    out = []
    start = bisect_left(ids, cuts[0] >> shift)
    for cut in cuts[1:]:
        end = bisect_left(ids, cut >> shift, start)
        if end > start:
            out.append(to_bucket(_slice_row(cols, start, end)))
        start = end
    return out


def _slice_row(cols: list[array], start: int, end: int) -> tuple:
    """The merged row of buckets start..end-1 of one level, by whole-slice reductions."""
    first_steps = cols[FIRST_STEP][start:end]
    last_steps = cols[LAST_STEP][start:end]
    first_at = start + first_steps.index(min(first_steps))
    latest = max(last_steps)
    last_at = end - 1 - last_steps[::-1].index(latest)  # ties: the later bucket (later in file order)
    return (
        min(cols[LO][start:end]),
        max(cols[HI][start:end]),
        cols[FIRST_STEP][first_at],
        cols[FIRST][first_at],
        latest,
        cols[LAST][last_at],
        min(cols[MIN][start:end]),
        max(cols[MAX][start:end]),
        sum(cols[SUM][start:end]),
        sum(cols[COUNT][start:end]),
        sum(cols[NONFINITE][start:end]),
    )
