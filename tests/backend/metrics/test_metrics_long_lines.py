"""A metrics line over the line cap (backend.jsonl.MAX_LINE_BYTES) is dropped and noted, never waited on: the live feed,
the backlog index and the plain follower all read the records after it, and the index fed live equals a fresh scan."""

import json
import subprocess
import sys
from pathlib import Path

from backend.jsonl import MAX_LINE_BYTES, JsonlFollower, LineReader
from backend.metrics.records import MetricsReader
from backend.metrics.index import MetricsFeed, MetricsIndex
from tests.fixtures.env import ROOT


def line(step: int, loss: float = 1.0) -> bytes:
    return json.dumps({"step": step, "split": "train", "loss": loss / (step + 1), "lr": 1e-4}).encode() + b"\n"


def long_line(size: int) -> bytes:
    """One JSON record padded to about `size` bytes: valid, just too long to be a metrics record we read."""
    head = b'{"step":999999,"split":"train","loss":0.5,"note":"'
    return head + b"x" * (size - len(head) - 3) + b'"}\n'


def write_run(path: Path, before: range, long: bytes, after: range) -> tuple[int, int]:
    """Records of `before`, the long line, records of `after`; returns the long line's byte range."""
    data = b"".join(line(s) for s in before)
    start = len(data)
    data += long + b"".join(line(s) for s in after)
    path.write_bytes(data)
    return start, start + len(long)


def poll_all(feed: MetricsFeed, max_polls: int = 100) -> list[dict]:
    records: list[dict] = []
    for _ in range(max_polls):
        batch, start, end = feed.poll_live()
        records += batch
        if end == start:
            return records
    raise AssertionError(f"the live feed did not catch up in {max_polls} polls (offset {feed.live_offset})")


def index_all(feed: MetricsFeed, max_steps: int = 100) -> None:
    for _ in range(max_steps):
        if not feed.index_step():
            return
    raise AssertionError(f"the index did not catch up in {max_steps} steps (offset {feed.indexed_offset})")


def summary(index: MetricsIndex) -> dict:
    """What the console can ask of an index: every series' buckets, counts."""
    series = {key: index.buckets(key, None, None, 64) for key in index.keys()}
    return {"series": series, "total_records": index.total_records, "bad_lines": index.bad_lines, "range": index.step_range()}


def test_a_9_mib_line_does_not_stop_the_live_feed(tmp_path):
    path = tmp_path / "metrics.jsonl"
    start, end = write_run(path, range(0, 50), long_line(9 << 20), range(50, 100))
    feed = MetricsFeed(path, None, live_from_end=False)  # a job the agent started: every record streamed live
    records = poll_all(feed)
    assert [r["step"] for r in records] == list(range(100))  # the records after the long line arrive
    assert feed.live_offset == path.stat().st_size and feed.caught_up
    assert feed.index.bad_lines == 1 and feed.index.total_records == 100
    assert f"bytes {start}..{end}" in feed.index.problems[-1] and "over the" in feed.index.problems[-1]

    fresh = MetricsFeed(path, None, live_from_end=True)  # one truth: a fresh scan of the same file agrees
    index_all(fresh)
    assert summary(fresh.index) == summary(feed.index)
    assert fresh.index.problems[-1] == feed.index.problems[-1]


def test_a_3_mib_line_does_not_stop_the_index(tmp_path):
    path = tmp_path / "metrics.jsonl"
    start, end = write_run(path, range(0, 300), long_line(3 << 20), range(300, 600))
    feed = MetricsFeed(path, None, live_from_end=True)  # met already large: a backlog for the indexer
    assert feed.backlog_bytes() == path.stat().st_size
    index_all(feed)
    assert feed.caught_up and feed.indexed_offset == path.stat().st_size
    assert feed.index.total_records == 600 and feed.index.bad_lines == 1
    assert feed.index.step_range() == (0, 599)
    assert f"bytes {start}..{end}" in feed.index.problems[-1]

    live = MetricsFeed(path, None, live_from_end=False)
    assert len(poll_all(live)) == 600
    assert summary(live.index) == summary(feed.index)


def test_a_line_between_the_cap_and_one_read_is_dropped_by_both_paths(tmp_path):
    """1.5 MiB: whole inside one live read and one index step, still over the cap, so both drop it (one truth)."""
    path = tmp_path / "metrics.jsonl"
    write_run(path, range(0, 10), long_line(MAX_LINE_BYTES + (MAX_LINE_BYTES >> 1)), range(10, 20))
    live = MetricsFeed(path, None, live_from_end=False)
    assert len(poll_all(live)) == 20
    cold = MetricsFeed(path, None, live_from_end=True)
    index_all(cold)
    assert summary(live.index) == summary(cold.index) and cold.index.bad_lines == 1
    assert [r["step"] for r in cold.tail_records(5)] == [15, 16, 17, 18, 19]


def test_a_long_line_written_while_followed_is_read_past_and_noted_when_it_ends(tmp_path):
    """The writer is still writing the long line: the feed reads past what is there, and counts it once it ends."""
    path = tmp_path / "metrics.jsonl"
    path.write_bytes(b"".join(line(s) for s in range(5)))
    feed = MetricsFeed(path, None, live_from_end=False)
    assert len(poll_all(feed)) == 5
    long = long_line(20 << 20)
    with open(path, "ab") as handle:
        handle.write(long[: 12 << 20])  # no newline yet
    assert poll_all(feed) == [] and feed.live_offset == path.stat().st_size and feed.index.bad_lines == 0
    with open(path, "ab") as handle:
        handle.write(long[12 << 20 :] + line(5) + line(6))
    assert [r["step"] for r in poll_all(feed)] == [5, 6]
    assert feed.index.bad_lines == 1 and feed.index.total_records == 7
    fresh = MetricsFeed(path, None, live_from_end=True)
    index_all(fresh)
    assert summary(fresh.index) == summary(feed.index)


def test_the_follower_and_history_reader_read_past_a_long_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    write_run(path, range(0, 3), long_line(9 << 20), range(3, 6))
    follower = JsonlFollower(path)
    assert [r["step"] for r in follower.read_all()] == list(range(6)) and follower.bad_lines == 1
    assert "over the" in follower.problems[-1]
    reader = MetricsReader(path)
    assert [r["step"] for r in reader.poll()] == list(range(6)) and reader.offset == path.stat().st_size


def test_reading_past_a_long_line_keeps_memory_bounded(tmp_path):
    """A 200 MiB line (a sparse file: no newline in it) costs reads of 8 MiB, not 200 MiB of memory."""
    path = tmp_path / "metrics.jsonl"
    path.write_bytes(line(0))
    with open(path, "r+b") as handle:
        handle.truncate(200 << 20)
    with open(path, "ab") as handle:
        handle.write(b"\n" + line(1))
    script = (
        "import json, re, sys\nfrom pathlib import Path\nfrom backend.metrics.index import MetricsFeed\n"
        "feed = MetricsFeed(Path(sys.argv[1]), None, live_from_end=False)\nsteps = []\n"
        "for _ in range(100):\n    records, start, end = feed.poll_live()\n    steps += [r['step'] for r in records]\n"
        "    if start == end: break\n"
        "print(json.dumps({'steps': steps, 'bad': feed.index.bad_lines, 'rss_kib': int(re.search(r'VmHWM:\\s+(\\d+)', open('/proc/self/status').read()).group(1))}))\n"
    )
    out = subprocess.run([sys.executable, "-c", script, str(path)], cwd=ROOT, capture_output=True, text=True, timeout=120, check=True)
    result = json.loads(out.stdout)
    assert result["steps"] == [0, 1] and result["bad"] == 1
    # VmHWM: this process's peak resident memory (ru_maxrss would carry the forking pytest's peak across exec)
    assert result["rss_kib"] < 150 << 10, result  # the interpreter and one 8 MiB read, a few copies at most


def test_line_reader_cuts_only_lines_over_the_cap():
    reader = LineReader(max_line=10)
    data = b"0123456789\n" + b"a" * 11 + b"\nshort\n" + b"b" * 25 + b"\n" + b"tail"
    chunk = reader._split(data, 100, None, len(data))  # as if read at byte 100
    assert chunk.data == b"0123456789\nshort\n"  # exactly at the cap: kept; one byte over: dropped
    assert chunk.dropped == [(111, 123), (129, 155)] and chunk.offset == 155  # "tail" waits for its newline
