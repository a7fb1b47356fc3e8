"""The cold backlog scan on worker processes: a metrics.jsonl cut into ranges of whole chunks, merged in order into the one-process index, bit for bit.

Standard library only (the agent path). `MetricsFeed.index_step()` reads a backlog one chunk at a time: a
LineReader read of up to INDEX_STEP_BYTES ending at a line end, scanned (backend.metrics.scan, whose result
depends on the chunk's bytes alone) and folded into the series as partial buckets. Float sums depend on how
the points are grouped, so the parallel scan keeps the very same chunks: `plan_chunks` finds where each of
those reads would end by peeking at the last bytes before each chunk's limit (a few KiB per chunk, not the
file; a chunk without a newline there is read whole, as the one-process reader would), `scan_range` (in a
worker) reads and scans its chunks and logs each partial bucket it would fold, and `ColdScan` merges the
ranges' logs in file order into the feed's index under its lock, with the rows in the order the one-process
scan folds them. Min/max/first/last/count merge in any grouping; the sums are added in the same order. Repeated
steps (a run resumed from a checkpoint) keep their rule across ranges: every value counts, `first` is the
earlier and `last` the later in file order, because rows are merged in file order.

Workers: min(CPUs - 1, backlog / 64 MiB) (one CPU is left to the agent's live path); one means no processes,
the feed's own index_step. Workers are started with the spawn context (the agent has threads: no fork).
"""

from __future__ import annotations

import os
import sys
import time
from array import array
from concurrent.futures import Future, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

from backend.jsonl import LineReader
from backend.metrics.index import INDEX_STEP_BYTES, MetricsFeed, MetricsIndex
from backend.metrics.scan import ChunkScanner
from backend.metrics.series import FIELDS, column_rows

if TYPE_CHECKING:
    from concurrent.futures import ProcessPoolExecutor

BYTES_PER_WORKER = 64 << 20  # a backlog smaller than two of these is scanned in one process
MIN_RANGE_BYTES = 16 << 20  # ranges per worker: up to RANGES_PER_WORKER, none smaller than this
RANGES_PER_WORKER = 4  # more ranges than workers: progress moves and a slow range does not hold the rest
PEEK_BYTES = 64 << 10  # under LineReader's line cap: a newline in the peek ends the chunk as the reader would

WORKERS_ENV = "EAGLE3_INDEX_WORKERS"
WORKER_NICE = 10

LongState = tuple[int, int] | None  # LineReader's "reading past an over-cap line" state before a chunk


def available_cpus() -> int:
    """CPUs this process may run on (the affinity mask where the OS has one, else os.cpu_count())."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def worker_count(backlog_bytes: int, cpus: int | None = None) -> int:
    """min(cpus - 1, backlog / 64 MiB), at least 1 (1: scan in this process)."""
    cpus = available_cpus() if cpus is None else cpus
    return max(1, min(cpus - 1, backlog_bytes // BYTES_PER_WORKER))


@dataclass(frozen=True)
class Chunk:
    """One read of the one-process backlog scan: [start, end), and the reader's state before it."""

    start: int
    end: int
    long: LongState = None


def plan_chunks(path: Path, start: int, stop: int, chunk_bytes: int, reader: LineReader) -> list[Chunk]:
    """The chunks `MetricsFeed.index_step(chunk_bytes)` reads from `start` to `stop`, without reading them.

    `reader` is the feed's backlog reader (its state at `start`); it is left in its state at the end of the
    last chunk. A chunk that starts after a newline with the reader in its plain state ends after the last
    newline before its limit: the peek finds it. Anything else (an over-cap line, a mid-line start, no newline
    in the peek) is read by the reader itself, exactly as the one-process scan would.
    """
    chunks: list[Chunk] = []
    offset = start
    peek_bytes = min(PEEK_BYTES, reader.max_line)
    with open(path, "rb") as handle:
        after_newline = offset == 0 or _byte_before(handle, offset) == b"\n"
        while offset < stop:
            if reader._long is None and after_newline:
                limit = min(stop, offset + chunk_bytes)
                peek_from = max(offset, limit - peek_bytes)
                handle.seek(peek_from)
                peek = handle.read(limit - peek_from)
                newline = peek.rfind(b"\n")
                if newline >= 0 and len(peek) == limit - peek_from:
                    end = peek_from + newline + 1
                    chunks.append(Chunk(offset, end))
                    offset = end
                    continue
            state = reader._long
            read = reader.read(path, offset, chunk_bytes, stop=stop)
            if read.offset == offset:
                break  # the one-process scan stops here too (a partial last line waits)
            end = min(read.offset, stop)
            chunks.append(Chunk(offset, end, state))
            offset = end
            after_newline = _byte_before(handle, offset) == b"\n"
    return chunks


def _byte_before(handle, offset: int) -> bytes:
    handle.seek(offset - 1)
    return handle.read(1)


class RowLog:
    """A series' partial buckets in the order the one-process scan folds them (ids and one column per field)."""

    def __init__(self) -> None:
        self.ids = array("q")
        self.cols = [array("d") for _ in FIELDS]

    def add(self, steps: Sequence[int], values: Sequence[float]) -> None:
        for bucket, row in column_rows(steps, values):
            self.ids.append(bucket)
            for col, value in zip(self.cols, row):
                col.append(value)


class PartialIndex(MetricsIndex):
    """What one range adds to an index: MetricsIndex's own folding, with each series logging its rows."""

    def __init__(self) -> None:
        super().__init__()
        self.logs: dict[str, RowLog] = {}
        self.cpu_s = 0.0  # the worker's CPU time for the range

    def _series(self, key: str) -> Any:
        log = self.logs.get(key)
        if log is None:
            log = self.logs[key] = RowLog()
        return log


def absorb(index: MetricsIndex, partial: PartialIndex) -> None:
    """Merge a range's partial index into `index`, as if its chunks had been folded there one by one."""
    for key, log in partial.logs.items():
        index._series(key).add_rows(log.ids, log.cols)
    index.val_records.extend(partial.val_records)
    index.recent_train.extend(partial.recent_train)
    index.total_records += partial.total_records
    index.bad_lines += partial.bad_lines
    index.problems = (index.problems + partial.problems)[-5:]
    index.version += partial.version + 1


def scan_range(path: str, chunks: list[Chunk], chunk_bytes: int, stop: int) -> PartialIndex:
    """(In a worker) read and scan `chunks` as the one-process scan would; raises ValueError if the file changed."""
    started = time.process_time()
    partial = PartialIndex()
    scanner = ChunkScanner()
    file = Path(path)
    for chunk in chunks:
        reader = LineReader()
        reader._long = chunk.long
        read = reader.read(file, chunk.start, chunk_bytes, stop=stop)
        if min(read.offset, stop) != chunk.end:
            raise ValueError(f"{path} changed while it was indexed: bytes {chunk.start}..{chunk.end} read as {chunk.start}..{read.offset}")
        if read.data:
            partial.fold_scan(scanner.scan(read.data))
        partial.fold_dropped(read.dropped)
    partial.cpu_s = time.process_time() - started
    return partial


def _lower_priority(nice: int) -> None:
    """Workers yield to the trainer and to the agent's live path when the CPUs are busy."""
    try:
        os.nice(nice)
    except OSError:
        pass


@dataclass
class Range:
    chunks: list[Chunk]
    long_after: LongState  # the reader's state after the range's last chunk
    future: Future | None = None

    @property
    def start(self) -> int:
        return self.chunks[0].start

    @property
    def end(self) -> int:
        return self.chunks[-1].end


def split_ranges(chunks: list[Chunk], count: int, long_after: LongState) -> list[Range]:
    """`count` runs of whole chunks of about equal bytes (fewer when there are fewer chunks)."""
    if not chunks:
        return []
    total = chunks[-1].end - chunks[0].start
    groups: list[list[Chunk]] = [[]]
    for chunk in chunks:
        if groups[-1] and chunk.start - chunks[0].start >= total * len(groups) / count:
            groups.append([])
        groups[-1].append(chunk)
    return [Range(group, (groups[i + 1][0].long if i + 1 < len(groups) else long_after)) for i, group in enumerate(groups)]


@dataclass
class ColdScan:
    """A feed's backlog scanned by worker processes; `step()` merges the finished ranges in file order."""

    feed: MetricsFeed
    workers: int
    chunk_bytes: int = INDEX_STEP_BYTES
    ranges_count: int | None = None
    nice: int = WORKER_NICE  # added to the workers' niceness
    pool: "ProcessPoolExecutor | None" = None  # a caller's pool (tests); else one of `workers` spawned processes
    ranges: list[Range] = field(default_factory=list)
    error: str = ""
    worker_cpu_s: float = 0.0  # CPU time the merged ranges took in the workers
    _own_pool: bool = False

    def __post_init__(self) -> None:
        feed = self.feed
        with feed.lock:
            start, stop, index = feed.indexed_offset, feed.live_offset, feed.index
            reader = LineReader(feed.index_lines.max_line)
            reader._long = feed.index_lines._long
        self.index = index
        chunks = plan_chunks(feed.path, start, stop, self.chunk_bytes, reader)
        count = self.ranges_count or self._default_ranges(stop - start)
        self.ranges = split_ranges(chunks, count, reader._long)
        self.stop = stop
        if not self.ranges:
            return
        if self.pool is None:
            import multiprocessing  # here, not at import: the agent loads it only when it scans a cold backlog
            from concurrent.futures import ProcessPoolExecutor

            spawn = multiprocessing.get_context("spawn")
            self.pool = ProcessPoolExecutor(max_workers=self.workers, mp_context=spawn, initializer=_lower_priority, initargs=(self.nice,))
            self._own_pool = True
        for part in self.ranges:
            part.future = self.pool.submit(scan_range, str(feed.path), part.chunks, self.chunk_bytes, stop)

    def _default_ranges(self, size: int) -> int:
        per_worker = max(1, min(RANGES_PER_WORKER, size // max(1, self.workers * MIN_RANGE_BYTES)))
        return self.workers * per_worker

    @property
    def running(self) -> bool:
        return bool(self.ranges) and not self.error

    def step(self, wait_s: float = 0.05) -> bool:
        """Merge the ranges that are done, in order (waiting up to wait_s for the next); True while some remain."""
        while self.running:
            part = self.ranges[0]
            assert part.future is not None
            if not part.future.done():
                wait([part.future], timeout=wait_s)
                if not part.future.done():
                    return True
            try:
                partial = part.future.result()
            except Exception as exc:  # a worker's OSError, a file that changed, a worker that died: scan on in-process
                self._abandon(f"a worker failed ({type(exc).__name__}: {exc}); indexing on in one process")
                return False
            if not self._merge(part, partial):
                return False
            self.ranges.pop(0)
        self.close()
        return False

    def _merge(self, part: Range, partial: PartialIndex) -> bool:
        feed = self.feed
        with feed.lock:
            if feed.index is not self.index or feed.indexed_offset != part.start:
                self._abandon("the file changed while it was indexed")
                return False
            absorb(feed.index, partial)
            self.worker_cpu_s += partial.cpu_s
            feed.indexed_offset = part.end
            feed.index_lines._long = part.long_after
            feed._note_head()
        return True

    def _abandon(self, why: str) -> None:
        self.error = why
        print(f"metrics index {self.feed.path}: {why}", file=sys.stderr, flush=True)
        self.close()

    def close(self) -> None:
        """Cancel what has not started and let the pool go without waiting (a running range ends within seconds,
        then its worker exits)."""
        for part in self.ranges:
            if part.future is not None:
                part.future.cancel()
        if self._own_pool and self.pool is not None:
            self.pool.shutdown(wait=False, cancel_futures=True)
        self.pool = None


def configured_workers(backlog_bytes: int) -> int:
    """Workers for a backlog: EAGLE3_INDEX_WORKERS when set (1: never processes; used from 4 chunks of backlog on),
    else worker_count()."""
    forced = os.environ.get(WORKERS_ENV, "").strip()
    if not forced:
        return worker_count(backlog_bytes)
    try:
        count = max(1, int(forced))
    except ValueError:
        print(f"{WORKERS_ENV}={forced!r} is not a number: workers follow the CPU count", file=sys.stderr, flush=True)
        return worker_count(backlog_bytes)
    return count if backlog_bytes >= 4 * INDEX_STEP_BYTES else 1


def backlog_step(feed: MetricsFeed, workers: int | None = None, wait_s: float = 0.05) -> bool:
    """One step of indexing the feed's backlog: on worker processes when it is large, else `feed.index_step()`.

    True while backlog remains (call again). A range that fails leaves the rest to the one-process scan.
    """
    scan = feed.cold_scan
    if scan is None:
        count = configured_workers(feed.backlog_bytes()) if workers is None else workers
        if count <= 1:
            return feed.index_step()
        scan = ColdScan(feed, count)
        if not scan.running:
            return feed.index_step()
        feed.cold_scan = scan
    if scan.step(wait_s):
        return True
    feed.cold_scan = None
    return feed.index_step()


def close_scan(feed: MetricsFeed) -> None:
    """Stop the feed's worker processes, if any (what they had merged stays: the next step scans on from there)."""
    scan, feed.cold_scan = feed.cold_scan, None
    if scan is not None:
        scan.close()


def index_backlog(feed: MetricsFeed, workers: int | None = None, **options: Any) -> None:
    """Index the whole backlog now (blocking): on `workers` processes (default: worker_count), then in-process."""
    count = worker_count(feed.backlog_bytes()) if workers is None else workers
    if count > 1 or workers is not None:
        scan = ColdScan(feed, count, **options)
        while scan.step(1.0):
            pass
    chunk_bytes = options.get("chunk_bytes", INDEX_STEP_BYTES)
    while feed.index_step(chunk_bytes):
        pass
