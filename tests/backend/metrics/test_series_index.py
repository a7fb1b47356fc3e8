"""The whole-history index: buckets equal a brute-force pass (spikes, NaN, resumed steps), the fast scan equals the
slow decoder, and the feed survives appends while indexing, truncation, replacement, torn lines and old sidecars."""

import json
import math
import random
import subprocess
import sys
from pathlib import Path
from typing import Any, Sequence

import pytest

from backend.metrics.records import MetricsWriter, normalize_record
from backend.metrics.index import INDEX_FORMAT, MetricsFeed, MetricsIndex
from backend.metrics.scan import ChunkScanner, points_of_records
from backend.metrics.series import Series, bucket_start, first_bucket_from, query, query_cuts, row_of, to_bucket
from tests.fixtures.metrics_records import trainer_record, write_run
from tests.fixtures.env import ROOT


def brute_force_buckets(points: Sequence[tuple[int, float]], cuts: Sequence[int]) -> list[dict[str, Any]]:
    """What query() must answer, by a plain pass over (step, value) points in file order."""
    out = []
    for lo, hi in zip(cuts, cuts[1:]):
        start, end = bucket_start(first_bucket_from(lo)), bucket_start(first_bucket_from(hi))
        inside = [(s, v) for s, v in points if start <= s < end]
        if not inside:
            continue
        ordered = sorted(inside, key=lambda p: p[0])  # stable: ties keep file order
        row = row_of([s for s, _ in ordered], [v for _, v in ordered])
        out.append(to_bucket(row))
    return out


def brute_points(path: Path) -> dict[str, list[tuple[int, float]]]:
    records = []
    for line in path.read_bytes().splitlines():
        try:
            clean, _ = normalize_record(json.loads(line))
        except ValueError:
            continue
        if clean is not None:
            records.append(clean)
    out: dict[str, list[tuple[int, float]]] = {}
    for record in records:
        from backend.metrics.scan import record_points

        for key, value in record_points(record):
            out.setdefault(key, []).append((record["step"], value))
    return out


def same(a: dict, b: dict) -> bool:
    for k in a:
        x, y = a[k], b[k]
        if k == "mean" and x is not None and y is not None:
            if not math.isclose(x, y, rel_tol=1e-9, abs_tol=1e-12):
                return False
        elif x != y:
            return False
    return True


def assert_index_matches(index: MetricsIndex, truth: dict[str, list[tuple[int, float]]]) -> None:
    assert set(index.keys()) == set(truth)
    for key, points in truth.items():
        lo, hi = min(s for s, _ in points), max(s for s, _ in points)
        for step_from, step_to, count, log_x in [(lo, hi, 200, False), (lo, hi, 64, True), (lo + 7, lo + 900, 33, False), (hi - 300, hi, 10, True)]:
            got = query(index.series[key], step_from, step_to, count, log_x)
            expected = brute_force_buckets(points, query_cuts(index.series[key], step_from, step_to, count, log_x))
            assert len(got) == len(expected), key
            bad = [(g, e) for g, e in zip(got, expected) if not same(g, e)]
            assert not bad, f"{key} {step_from}..{step_to} log={log_x}: {bad[:2]}"


@pytest.fixture
def run_file(tmp_path) -> tuple[Path, dict]:
    path = tmp_path / "metrics.jsonl"
    write_run(path, 12_000, spikes={700, 9_001, 11_999}, nans={50, 8_500, 8_501}, infs={10_000}, resume_at=6_000)
    with open(path, "ab") as handle:  # lines the fast path must hand to the decoder, each as the decoder would
        handle.write(b'{"step": 12001, "split": "train", "loss": 1.5}\n')  # another writer's spacing and keys
        handle.write(b'{"step":12002,"split":"train","loss":"abc"}\n')  # bad: skipped and counted
        handle.write(b"not json at all\n")
        handle.write(b'{"step":12003,"split":"train","loss":2.0,"lr":-1}\n')  # bad: negative lr
        handle.write(b'{"step":12004,"split":"train","loss":null,"lr":0.5}\n')  # null loss is NaN
    return path, brute_points(path)


def test_buckets_equal_a_brute_force_pass_with_spikes_and_nans():
    rng = random.Random(3)
    points = []
    for step in range(0, 200_000, 3):
        value = rng.random()
        value = 1e6 if rng.random() < 0.001 else math.nan if rng.random() < 0.001 else value
        points.append((step, value))
    points += [(s, -5.0) for s in range(100_000, 100_300)]  # resumed steps with a dip
    series = Series()
    for i in range(0, len(points), 1000):
        part = sorted(points[i : i + 1000], key=lambda p: p[0])
        series.add([s for s, _ in part], [v for _, v in part])
    for step_from, step_to, count, log_x in [(0, 200_000, 300, False), (0, 200_000, 300, True), (99_000, 101_000, 50, False), (5, 300, 40, True)]:
        got = query(series, step_from, step_to, count, log_x)
        expected = brute_force_buckets(points, query_cuts(series, step_from, step_to, count, log_x))
        assert [same(g, e) for g, e in zip(got, expected)] == [True] * len(expected) and len(got) == len(expected)
    whole = query(series, 0, 200_000, 1)
    assert whole[0]["max"] == 1e6 and whole[0]["min"] == -5.0
    assert whole[0]["nonfinite"] == sum(1 for _, v in points if math.isnan(v))


def test_fast_scan_gives_the_points_the_decoder_gives(run_file):
    path, truth = run_file
    scanner = ChunkScanner()
    data = path.read_bytes()
    result = scanner.scan(data)
    assert result.fast_records > 10_000, "the trainer's lines should take the fast path"
    assert result.bad_lines == 3
    columns = {k: sorted(zip(*v)) for k, v in result.columns.items()}
    for key, (steps, values) in points_of_records(result.slow_records).items():
        columns[key] = sorted(columns.get(key, []) + list(zip(steps, values)))
    for key, points in truth.items():
        got = columns[key]
        want = sorted(points)
        assert len(got) == len(want), key
        assert all(a == b or (a[0] == b[0] and math.isnan(a[1]) and math.isnan(b[1])) for a, b in zip(got, want)), key


def test_cold_index_and_live_fold_agree_with_brute_force(run_file, tmp_path):
    path, truth = run_file
    cold = MetricsFeed(path, tmp_path / "cold.index", live_from_end=True)
    assert cold.backlog_bytes() == path.stat().st_size
    while cold.index_step(max_bytes=1 << 20):  # several chunks, so shapes and buckets span chunk borders
        pass
    assert cold.caught_up
    assert_index_matches(cold.index, truth)
    assert cold.index.total_records == sum(1 for _ in path.read_bytes().splitlines()) - 3
    assert cold.index.bad_lines == 3

    live = MetricsFeed(path, None, live_from_end=False)  # a job the agent started: every record streamed live
    streamed = 0
    while True:
        records, start, end = live.poll_live(max_bytes=256 << 10)
        streamed += len(records)
        if end == start:
            break
    assert_index_matches(live.index, truth)
    assert streamed == live.index.total_records == cold.index.total_records


def test_nan_and_spikes_are_visible_in_whole_history_buckets(run_file, tmp_path):
    path, _ = run_file
    feed = MetricsFeed(path, None, live_from_end=True)
    while feed.index_step():
        pass
    buckets = feed.index.buckets("train.loss", None, None, 100)
    assert sum(b["nonfinite"] for b in buckets) == 5  # 3 NaN, 1 inf, 1 null
    assert max(b["max"] for b in buckets if b["max"] is not None) == 50.0  # one-step spikes survive 100 buckets


def test_records_appended_while_indexing_are_streamed_and_indexed_once(run_file, tmp_path):
    path, _ = run_file
    feed = MetricsFeed(path, None, live_from_end=True)
    feed.index_step(max_bytes=1 << 20)  # part of the backlog
    writer = MetricsWriter(path)
    rng = random.Random(9)
    for step in range(20_000, 20_050):
        writer.write(trainer_record(step, rng))
    records, _, _ = feed.poll_live()  # the live stream sees the new records at once, before the backlog is done
    assert [r["step"] for r in records] == list(range(20_000, 20_050))
    while feed.index_step(max_bytes=1 << 20):
        pass
    assert_index_matches(feed.index, brute_points(path))


def test_tail_records_stop_at_the_offset_they_are_reported_with(tmp_path):
    """The window reply's records and offset must agree even when the live stream moves on in between: records past the
    offset would come again in the next live event (the console would hold them twice)."""
    path = tmp_path / "metrics.jsonl"
    writer = MetricsWriter(path)
    for step in (1, 2, 3):
        writer.write({"step": step, "split": "train", "loss": 1.0})
    feed = MetricsFeed(path, None, live_from_end=False)
    _, _, reported = feed.poll_live()
    writer.write({"step": 4, "split": "train", "loss": 1.0})
    feed.poll_live()  # the live stream moved on to step 4
    assert [r["step"] for r in feed.tail_records(10, end=reported)] == [1, 2, 3]
    assert [r["step"] for r in feed.tail_records(10)] == [1, 2, 3, 4]


def test_torn_last_line_waits_and_truncation_or_replacement_rebuilds(tmp_path):
    path = tmp_path / "metrics.jsonl"
    write_run(path, 600)
    feed = MetricsFeed(path, tmp_path / "metrics.index", live_from_end=False)
    feed.poll_live()
    with open(path, "ab") as handle:
        handle.write(b'{"step":601,"split":"train","lo')  # a writer mid-line
    assert feed.poll_live()[0] == []
    with open(path, "ab") as handle:
        handle.write(b'ss":0.25}\n')
    assert [r["step"] for r in feed.poll_live()[0]] == [601]
    assert_index_matches(feed.index, brute_points(path))

    write_run(path.with_name("short.jsonl"), 100, seed=5)
    path.write_bytes(path.with_name("short.jsonl").read_bytes())  # truncated and rewritten shorter
    feed.poll_live()
    assert_index_matches(feed.index, brute_points(path))
    assert "rebuilding" in feed.progress()["sidecar"]

    write_run(path.with_name("other.jsonl"), 300, seed=7)  # replaced by another run of a larger size
    path.with_name("other.jsonl").replace(path)
    feed.poll_live()
    assert_index_matches(feed.index, brute_points(path))


def test_sidecar_is_trusted_only_when_it_still_describes_the_file(tmp_path):
    path = tmp_path / "metrics.jsonl"
    sidecar = tmp_path / "metrics.index"
    write_run(path, 3_000, nans={77})
    first = MetricsFeed(path, sidecar, live_from_end=True)
    while first.index_step():
        pass
    assert first.save_sidecar() and sidecar.exists()

    again = MetricsFeed(path, sidecar, live_from_end=True)
    assert again.caught_up and again.indexed_offset == path.stat().st_size and "loaded" in again.sidecar_note
    assert_index_matches(again.index, brute_points(path))

    MetricsWriter(path).write(trainer_record(3_001, random.Random(1)))  # grew since the save: only the rest is scanned
    grown = MetricsFeed(path, sidecar, live_from_end=True)
    assert 0 < grown.backlog_bytes() < 2_000
    while grown.index_step():
        pass
    assert_index_matches(grown.index, brute_points(path))

    data = sidecar.read_bytes().replace(f'"format": {INDEX_FORMAT}'.encode(), b'"format": 1', 1)
    sidecar.write_bytes(data)  # an older agent's sidecar
    old = MetricsFeed(path, sidecar, live_from_end=True)
    assert old.indexed_offset == 0 and "rebuilding" in old.sidecar_note
    sidecar.write_bytes(b"garbage")
    assert MetricsFeed(path, sidecar, live_from_end=True).indexed_offset == 0

    write_run(path, 10, seed=99)  # the same name, another run (first bytes differ): the sidecar is not trusted
    first.save_sidecar()
    path.write_bytes(b"")
    write_run(path, 3_500, seed=42)
    assert MetricsFeed(path, sidecar, live_from_end=True).indexed_offset == 0


def test_signal_records_cover_a_long_history_with_few_records(tmp_path):
    path = tmp_path / "metrics.jsonl"
    write_run(path, 20_000)
    feed = MetricsFeed(path, None, live_from_end=True)
    while feed.index_step():
        pass
    records = feed.index.signal_records()
    assert len(records) < 5_000
    assert records[-1]["step"] == 20_000 and any(r["split"] == "val" for r in records)
    from backend.metrics.signals import compute_signals

    signals = compute_signals(records)
    assert signals["n_val"] == 80 and signals["latest"]["train_loss"] is not None


def test_cli_series_prints_the_documented_json(run_file, tmp_path):
    path, _ = run_file
    command = [sys.executable, "-m", "backend", "metrics", "series", "--file", str(path), "--key", "train.loss", "--points", "20", "--json"]
    document = json.loads(subprocess.run(command, cwd=ROOT, capture_output=True, text=True, check=True).stdout)
    assert {"job", "key", "buckets", "total_records", "indexed_bytes", "file_bytes"} <= set(document)
    assert document["indexed_bytes"] == document["file_bytes"] == path.stat().st_size
    assert len(document["buckets"]) == 20
    assert set(document["buckets"][0]) >= {"step_lo", "step_hi", "min", "max", "first", "last", "count", "nonfinite"}
    assert sum(b["nonfinite"] for b in document["buckets"]) == 5
    assert (path.parent / "metrics.index").exists()  # the next call reads the saved index
    missing = subprocess.run([*command[:-3], "--key", "val.nope", "--json"], cwd=ROOT, capture_output=True, text=True)
    assert missing.returncode == 1 and "no series 'val.nope'" in json.loads(missing.stdout)["error"]


def test_the_token_path_reads_the_trainers_lines_and_agrees_with_the_decoder(tmp_path):
    path = tmp_path / "metrics.jsonl"
    write_run(path, 5_000, spikes={1_234}, nans={4_321})
    scanner = ChunkScanner()
    data = path.read_bytes()
    folded = MetricsIndex()
    start = 0
    while start < len(data):  # 256 KiB chunks: val lines are cut out of most of them
        end = data.rfind(b"\n", start, start + (256 << 10)) + 1
        folded.fold_scan(scanner.scan(data[start:end]))
        start = end
    assert scanner.tokens is not None and not scanner.shapes, "every chunk took the token path"
    assert_index_matches(folded, brute_points(path))


def test_a_line_that_breaks_the_token_shape_sends_its_chunk_down_the_regex_path(tmp_path):
    path = tmp_path / "metrics.jsonl"
    write_run(path, 400)
    lines = path.read_bytes().splitlines(keepends=True)
    lines.insert(200, b'{"step":150,"epoch":0.03,"split":"train","loss":9.5,"ploss":[1,2],"acc":[0.5],"lr":0.001}\n')
    path.write_bytes(b"".join(lines))
    scanner = ChunkScanner()
    index = MetricsIndex()
    index.fold_scan(scanner.scan(path.read_bytes()))
    assert scanner.shapes, "the mixed chunk fell back to the per-shape regex"
    assert_index_matches(index, brute_points(path))


def test_the_wall_time_is_indexed_by_the_token_regex_and_decoder_paths(tmp_path):
    """`time` (MetricsWriter writes it last on every line) is a series whatever path reads the line: the token path
    reads a value that ends the line, the regex path and the decoder read it too, and all agree with a plain pass."""
    path = tmp_path / "metrics.jsonl"
    writer = MetricsWriter(path)
    rng = random.Random(3)
    for step in range(1, 301):
        record = trainer_record(step, rng)
        del record["time"]  # the writer adds it, last
        writer.write(record)
    assert json.loads(path.read_bytes().splitlines()[0]).popitem()[0] == "time"
    token_scanner = ChunkScanner()
    tokens = MetricsIndex()
    tokens.fold_scan(token_scanner.scan(path.read_bytes()))
    assert token_scanner.tokens is not None and not token_scanner.shapes
    lines = path.read_bytes().splitlines(keepends=True)
    mixed = lines[:150] + [b'{"step":150,"split":"train","loss":9.5,"time":1700000099.5,"lr":0.001}\n'] + lines[150:]
    regex_scanner = ChunkScanner()
    regex = MetricsIndex()
    regex.fold_scan(regex_scanner.scan(b"".join(mixed)))
    assert regex_scanner.shapes, "the mixed chunk took the regex path"
    decoded = points_of_records([normalize_record(json.loads(line))[0] for line in lines])
    truth = brute_points(path)
    assert decoded["time"] == ([s for s, _ in truth["time"]], [v for _, v in truth["time"]])
    assert_index_matches(tokens, truth)
    mixed_path = tmp_path / "mixed.jsonl"
    mixed_path.write_bytes(b"".join(mixed))
    assert_index_matches(regex, brute_points(mixed_path))
    assert len(brute_points(mixed_path)["time"]) == 301
