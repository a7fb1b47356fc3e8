"""The cold scan on worker processes builds the one-process index bit for bit (spikes, NaN/inf, torn lines, resumed
steps, an over-cap line, range borders mid-record, 1..5 ranges), and a real agent answers while its workers scan."""

import json
import math
import multiprocessing
import os
import random
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import pytest

from backend.jobs.registry import JobRegistry
from backend.jsonl import MAX_LINE_BYTES, LineReader
from backend.metrics.records import encode_nonfinite
from backend.metrics.index import MetricsFeed
from backend.metrics.scan import ChunkScanner
from backend.metrics.parallel import WORKERS_ENV, ColdScan, backlog_step, plan_chunks, worker_count
from tests.fixtures.metrics_records import trainer_record, val_record

PY = sys.executable
RESUME_FROM = 500  # the run is resumed from step 500's checkpoint after step 2500: steps 500..2500 appear twice


def line_of(record: dict) -> bytes:
    """One line as the trainer's writer encodes it (non-finite values as quoted strings)."""
    return json.dumps(encode_nonfinite(record), separators=(",", ":"), allow_nan=True).encode() + b"\n"


def write_history(path: Path, seed: int = 0) -> dict:
    """A history with every hard case; returns where the cases are."""
    rng = random.Random(seed)
    order = list(range(1, 2501)) + list(range(RESUME_FROM, 4001))
    lines: list[bytes] = []
    marks: dict = {}
    for number, step in enumerate(order):
        loss = 60.0 if step % 777 == 0 else math.nan if step % 613 == 0 else math.inf if step == 1999 else None
        record = trainer_record(step, rng, loss)
        if step % 401 == 0:
            record["grad_norm"] = math.nan  # a NaN in another series
        if number == 2500:
            marks["resumed_at"] = sum(map(len, lines))
        if step == RESUME_FROM and number < 2500:
            marks["first_pass_at"] = sum(map(len, lines))
        lines.append(line_of(record))
        if step % 250 == 0:
            lines.append(line_of(val_record(step, rng)))
        if number == 900:
            lines.append(line_of(trainer_record(step, rng))[:117] + b"\n")  # torn mid-file: a writer killed mid-line
        if number == 1300:  # another writer's shape: its chunk takes the regex path
            lines.append(b'{"step":%d,"split":"train","loss":1.5,"lr":0.001,"note":"other writer"}\n' % step)
            lines.append(b'{"step":%d,"split":"train","loss":NaN,"grad_norm":Infinity}\n' % step)  # bare tokens
        if number == 1700:
            lines.append(b'{"step":%d,"split":"train","loss":2.0,"blob":"%s"}\n' % (step, b"x" * (MAX_LINE_BYTES + 10)))  # over the cap
    data = b"".join(lines) + line_of(trainer_record(4001, rng))[:60]  # the last line half-written
    path.write_bytes(data)
    return marks


@pytest.fixture(scope="module")
def history(tmp_path_factory):
    path = tmp_path_factory.mktemp("cold") / "metrics.jsonl"
    return path, write_history(path)


@pytest.fixture(scope="module")
def pool():
    executor = ProcessPoolExecutor(max_workers=3, mp_context=multiprocessing.get_context("spawn"))
    yield executor
    executor.shutdown()


def one_process(path: Path, chunk_bytes: int) -> MetricsFeed:
    feed = MetricsFeed(path, None, live_from_end=True)
    while feed.index_step(chunk_bytes):
        pass
    return feed


def snapshot(feed: MetricsFeed) -> dict:
    """Everything the index holds, as bytes and exact values (NaN compares equal through its JSON text)."""
    index = feed.index
    return {
        "index": index.to_bytes({"source": "x"}),  # every level of every series, the counts and the val records
        "levels": {key: len(series.levels) for key, series in index.series.items()},
        "recent": json.dumps(list(index.recent_train), allow_nan=True),
        "problems": list(index.problems),
        "counts": (index.total_records, index.bad_lines),
        "offsets": (feed.indexed_offset, feed.live_offset, feed.index_lines._long),
    }


@pytest.mark.parametrize("chunk_bytes", [300, 4096, 65_537, 2 << 20])
def test_the_plan_is_the_one_process_scans_own_reads(history, chunk_bytes):
    path, _ = history
    feed = MetricsFeed(path, None, live_from_end=True)
    reads = []
    while True:
        start = feed.indexed_offset
        more = feed.index_step(chunk_bytes)
        if feed.indexed_offset != start:
            reads.append((start, feed.indexed_offset))
        if not more:
            break
    reader = LineReader()
    plan = plan_chunks(path, 0, feed.live_offset, chunk_bytes, reader)
    assert [(c.start, c.end) for c in plan] == reads
    assert reader._long == feed.index_lines._long
    assert any(c.long is not None for c in plan) or chunk_bytes > MAX_LINE_BYTES, "the over-cap line was read past"


@pytest.fixture(scope="module")
def one_process_of(history):
    """The one-process feed of the history per chunk size, built once for the module's tests."""
    built: dict[int, MetricsFeed] = {}
    return lambda chunk_bytes: built.setdefault(chunk_bytes, one_process(history[0], chunk_bytes))


@pytest.mark.parametrize("ranges", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("chunk_bytes", [16 << 10, 40_001])
def test_the_parallel_index_is_the_one_process_index_bit_for_bit(history, pool, one_process_of, ranges, chunk_bytes):
    path, marks = history
    expected = one_process_of(chunk_bytes)
    index = expected.index
    assert index.bad_lines == 2 and expected.indexed_offset < path.stat().st_size, "torn line and over-cap line; the half line waits"
    assert sum(int(s.fine.cols[10][i]) for s in [index.series["train.loss"]] for i in range(len(s.fine))) > 0, "NaN/inf counted"
    assert "time" in index.series, "the wall time of each step is indexed (the plots' time axis)"

    feed = MetricsFeed(path, None, live_from_end=True)
    scan = ColdScan(feed, workers=3, chunk_bytes=chunk_bytes, ranges_count=ranges, pool=pool)
    assert len(scan.ranges) == ranges
    data = path.read_bytes()
    nominal = [feed.live_offset * k // ranges for k in range(1, ranges)]
    assert all(data[n - 1 : n] != b"\n" for n in nominal), "the even split falls mid-record"
    for part in scan.ranges[1:]:  # a range starts on a line start, or inside the over-cap line with the reader's state
        assert data[part.start - 1 : part.start] == b"\n" or part.chunks[0].long is not None
    if ranges > 1:  # the resumed steps and their first pass are read by different workers
        range_of = [next(i for i, p in enumerate(scan.ranges) if p.start <= at < p.end) for at in (marks["first_pass_at"], marks["resumed_at"])]
        assert range_of[0] != range_of[1]
    while scan.step(1.0):
        pass
    assert not scan.error and not scan.ranges
    while feed.index_step(chunk_bytes):  # nothing is left: the workers covered the backlog
        pass
    assert snapshot(feed) == snapshot(expected)


def test_backlog_step_spawns_its_own_workers_and_the_agent_rule_counts_them(history, one_process_of):
    path, _ = history
    expected = one_process_of(64 << 10)
    feed = MetricsFeed(path, None, live_from_end=True)
    feed.cold_scan = ColdScan(feed, workers=2, chunk_bytes=64 << 10)  # what backlog_step starts for a large backlog
    seen_running = False
    while backlog_step(feed):
        seen_running = seen_running or feed.cold_scan is not None
    assert seen_running and feed.cold_scan is None
    assert snapshot(feed) == snapshot(expected)
    assert [worker_count(size << 20, cpus) for size, cpus in [(100, 16), (1024, 16), (1024, 2), (640, 4), (8192, 128)]] == [1, 15, 1, 3, 127]


def test_a_file_rewritten_under_the_workers_is_scanned_on_in_one_process(tmp_path, pool):
    path = tmp_path / "metrics.jsonl"
    rng = random.Random(1)
    path.write_bytes(b"".join(line_of(trainer_record(step, rng)) for step in range(1, 3001)))
    feed = MetricsFeed(path, None, live_from_end=True)
    busy = [pool.submit(time.sleep, 1.0) for _ in range(3)]  # the scan's ranges wait behind these
    scan = ColdScan(feed, workers=3, chunk_bytes=32 << 10, ranges_count=3, pool=pool)
    rewritten = path.read_bytes().replace(b'"split":"train"', b'"split":"train" ')  # other line ends under the same plan
    path.write_bytes(rewritten)
    for future in busy:
        future.result()
    while scan.step(1.0):
        pass
    assert "changed while it was indexed" in scan.error and feed.indexed_offset == 0
    while feed.index_step(32 << 10):
        pass
    assert feed.index.total_records == rewritten[: feed.live_offset].count(b"\n"), "every whole line before the stop, once"


def proc_children(pid: int) -> list[str]:
    """Command lines of a process's children (every thread's), from /proc."""
    out = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            kids = (task / "children").read_text().split()
        except OSError:
            continue
        for kid in kids:
            try:
                out.append(Path(f"/proc/{kid}/cmdline").read_bytes().replace(b"\0", b" ").decode())
            except OSError:
                pass
    return out


LIVE_WRITER = """\
import os, time
from backend.jsonl import append_record
job_dir = os.environ["EAGLE3_JOB_DIR"]
while not os.path.exists(os.path.join(job_dir, "go")):
    time.sleep(0.02)
for step in range(60_001, 60_101):  # live lines while the agent's workers scan the history
    append_record(os.path.join(job_dir, "metrics.jsonl"), {"step": step, "split": "train", "loss": 1.0 / step, "time": time.time()})
    time.sleep(0.02)
time.sleep(120)
"""


def test_a_real_agent_answers_live_requests_while_its_workers_index_a_cold_history(tmp_path):
    from tests.fixtures.agent import AgentProcess

    registry = JobRegistry(tmp_path / "run")
    info = registry.start_job("cold", "train", [PY, "-c", LIVE_WRITER])
    path = Path(info.job_dir) / "metrics.jsonl"
    rng = random.Random(2)
    last_step = 60_000
    with open(path, "wb") as handle:  # ~26 MiB the agent never saw
        for step in range(1, last_step + 1):
            handle.write(line_of(trainer_record(step, rng, math.nan if step % 9_999 == 0 else None)))
            if step % 1000 == 0 and step < last_step:
                handle.write(line_of(val_record(step, rng)))
    history_records = last_step + last_step // 1000 - 1
    agent = AgentProcess(tmp_path / "run", env={**os.environ, WORKERS_ENV: "2"})
    try:
        agent.wait(lambda m: m["type"] == "hello")
        (Path(info.job_dir) / "go").touch()
        workers_seen = answered_while_scanning = 0
        while True:
            window = agent.ok("metrics_window", name="cold", last=5, val=2)
            steps = [r["step"] for r in window["records"]]
            assert steps[0] >= last_step - 4 and steps == list(range(steps[0], steps[0] + 5)), "the newest records at once"
            series = agent.ok("metrics_series", name="cold", keys=["train.loss"], points=20)
            workers_seen = max(workers_seen, sum("spawn_main" in cmd for cmd in proc_children(agent.proc.pid)))
            if series["caught_up"]:
                break
            answered_while_scanning += 1
            time.sleep(0.05)
        assert workers_seen >= 1, "the backlog was scanned by worker processes"
        assert answered_while_scanning >= 3, "requests were answered while the workers scanned"
        deadline = time.monotonic() + 30
        while agent.ok("metrics_series", name="cold", keys=[], points=1)["total_records"] < history_records + 100:
            assert time.monotonic() < deadline, "the live lines reach the index"
            time.sleep(0.1)
        live = [r["step"] for m in list(agent.messages) if m["type"] == "metrics" and m["job"] == "cold" for r in m["records"]]
        assert live == list(range(60_001, 60_101)), "every live line streamed once, in order"
        expected = one_process(path, 2 << 20).index
        result = agent.ok("metrics_series", name="cold", keys=["train.loss", "val.acc.0", "lr"], points=64)
        assert result["total_records"] == expected.total_records == history_records + 100, "every line indexed once"
        for key in ("val.acc.0", "lr"):  # series the live lines do not touch: bit for bit
            assert json.dumps(result["series"][key]) == json.dumps(expected.buckets(key, None, None, 64)), key
        got, want = result["series"]["train.loss"], expected.buckets("train.loss", None, None, 64)
        assert [(b["count"], b["nonfinite"], b["min"], b["max"]) for b in got] == [(b["count"], b["nonfinite"], b["min"], b["max"]) for b in want]
        deadline = time.monotonic() + 10
        while any("spawn_main" in cmd for cmd in proc_children(agent.proc.pid)) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any("spawn_main" in cmd for cmd in proc_children(agent.proc.pid)), "the workers are gone once done"
    finally:
        agent.close()
        registry.stop(all_jobs=True, grace=1)


def test_a_chunk_scans_the_same_whatever_chunks_a_scanner_read_before():
    """A worker starts at any chunk with a fresh scanner: what it reads must not depend on the chunks before.

    Here a resumed run's writer has one key more, and one chunk holds both writers' lines at the same steps:
    which lines win the ties (first/last) must not depend on the order an earlier chunk learned the shapes in.
    """
    rng = random.Random(3)

    def lines(steps, extra: bool) -> bytes:
        records = [trainer_record(step, rng) for step in steps]
        return b"".join(line_of({**r, "seq_len": 2048} if extra else r) for r in records)

    chunks = [
        lines(range(1, 20), True) + lines(range(20, 40), False),  # the new writer's lines first: its shape is learned first
        lines(range(40, 90), False),
        lines(range(90, 120), False) + lines(range(90, 120), True),  # the old writer's lines first, same steps
    ]
    carried = ChunkScanner()
    before = [carried.scan(chunk) for chunk in chunks]
    fresh = [ChunkScanner().scan(chunk) for chunk in chunks]
    for old, new in zip(before, fresh):
        assert json.dumps(old.columns, allow_nan=True) == json.dumps(new.columns, allow_nan=True)
        assert old.slow_records == new.slow_records
