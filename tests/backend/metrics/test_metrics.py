"""Metrics schema: validator names the wrong key, writer encodes non-finite floats, reader resumes, series splits."""

import errno
import json
import math

import pytest
import torch

from backend.metrics.records import MetricsReader, MetricsRecordError, MetricsWriter, check_record, read_metrics, record_loss, series, validate_record


def strict_json(line: str):
    """json.loads that refuses bare NaN/Infinity, as a strict JSON reader would."""

    def refuse(token):
        raise ValueError(f"non-standard JSON token {token}")

    return json.loads(line, parse_constant=refuse)


def full_record(**overrides):
    record = {
        "step": 10,
        "epoch": 0,
        "split": "train",
        "loss": 2.5,
        "ploss": [2.0, 0.5],
        "acc": [0.7, 0.4],
        "lr": 1e-4,
        "grad_norm": 0.3,
        "weight_norm": 12.0,
        "weight_norm_modules": {"fc": 3.0, "lm_head": 9.0},
        "tokens": 40960,
        "time": 1700000000.0,
        "step_time": 0.2,
    }
    record.update(overrides)
    return record


def test_full_record_is_valid_and_optional_keys_may_be_absent():
    assert check_record(full_record()) == []
    assert check_record({"step": 0, "split": "val"}) == []
    assert check_record({"step": 3, "split": "train", "future_key": {"anything": 1}}) == []


@pytest.mark.parametrize(
    "overrides, key",
    [
        ({"split": "eval"}, "'split'"),
        ({"step": -1}, "'step'"),
        ({"step": 1.5}, "'step'"),
        ({"step": True}, "'step'"),
        ({"loss": "high"}, "'loss'"),
        ({"lr": -1e-4}, "'lr'"),
        ({"acc": 0.5}, "'acc'"),
        ({"acc": [0.5, "x"]}, "'acc[1]'"),
        ({"ploss": {"0": 1.0}}, "'ploss'"),
        ({"weight_norm_modules": {"fc": "big"}}, "weight_norm_modules['fc']"),
        ({"weight_norm_modules": [1.0]}, "'weight_norm_modules'"),
        ({"tokens": 12.5}, "'tokens'"),
        ({"grad_norm": [0.1]}, "'grad_norm'"),
    ],
)
def test_validator_names_the_wrong_key(overrides, key):
    problems = check_record(full_record(**overrides))
    assert len(problems) == 1 and key in problems[0], problems


def test_missing_required_keys_and_non_object():
    assert any("'step' is missing" in p for p in check_record({"split": "train"}))
    assert any("'split'" in p for p in check_record({"step": 1}))
    assert check_record([1, 2]) == ["record must be a JSON object, got list"]


def test_writer_encodes_nonfinite_as_strings_and_reader_restores_them(tmp_path):
    path = tmp_path / "run" / "metrics.jsonl"
    writer = MetricsWriter(path)
    writer.write(full_record(loss=math.nan, ploss=[math.inf, 1.0], grad_norm=-math.inf * -1))
    lines = path.read_text().splitlines()
    assert len(lines) == 1
    raw = strict_json(lines[0])  # strict JSON: no bare NaN
    assert raw["loss"] == "NaN" and raw["ploss"] == ["Infinity", 1.0] and raw["grad_norm"] == "Infinity"
    records, offset = read_metrics(path)
    assert offset == path.stat().st_size
    assert math.isnan(records[0]["loss"]) and records[0]["ploss"][0] == math.inf and records[0]["ploss"][1] == 1.0


def test_reader_accepts_bare_nan_tokens_and_null(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "split": "train", "loss": NaN, "lr": null, "acc": [null, 0.5]}\n{"step": 2, "split": "train", "loss": "-inf"}\n')
    records, _ = read_metrics(path)
    assert math.isnan(records[0]["loss"]) and math.isnan(records[0]["lr"]) and math.isnan(records[0]["acc"][0])
    assert records[1]["loss"] == -math.inf


def test_bad_record_raises_and_writes_nothing(tmp_path):
    path = tmp_path / "metrics.jsonl"
    writer = MetricsWriter(path)
    writer.write(step=1, split="train", loss=1.0)
    before = path.read_bytes()
    with pytest.raises(MetricsRecordError) as err:
        writer.write(step=2, split="training", loss=1.0, acc="0.5")
    assert "'split'" in str(err.value) and "'acc'" in str(err.value) and "nothing written" in str(err.value)
    assert path.read_bytes() == before


def test_writer_fills_time_drops_none_and_takes_tensor_scalars(tmp_path):
    path = tmp_path / "metrics.jsonl"
    written = MetricsWriter(path).write({"step": torch.tensor(5), "split": "train"}, loss=torch.tensor(0.25), acc=[torch.tensor(0.5)], grad_norm=None)
    assert written["step"] == 5 and written["loss"] == 0.25 and written["acc"] == [0.5]
    raw = strict_json(path.read_text())
    assert "grad_norm" not in raw and isinstance(raw["time"], float) and raw["step"] == 5


def test_reader_resumes_by_offset_waits_for_partial_line_and_skips_bad_records(tmp_path):
    path = tmp_path / "metrics.jsonl"
    writer = MetricsWriter(path)
    for step in range(3):
        writer.write(step=step, split="train", loss=1.0 / (step + 1))
    with open(path, "a") as handle:
        handle.write('{"step": -4, "split": "train"}\nnot json\n{"step": 3, "split": "tr')
    reader = MetricsReader(path)
    assert [r["step"] for r in reader.poll()] == [0, 1, 2]
    assert reader.bad_records == 1 and "'step'" in reader.problems[0]
    with open(path, "a") as handle:
        handle.write('ain", "loss": 0.2}\n')
    assert [r["step"] for r in reader.poll()] == [3]
    records, offset = read_metrics(path, offset=reader.offset)
    assert records == [] and offset == reader.offset
    writer.write(step=4, split="val", loss=0.3)
    records, _ = read_metrics(path, offset=offset)
    assert [(r["step"], r["split"]) for r in records] == [(4, "val")]


def test_series_splits_sorts_dedupes_and_indexes():
    records = [
        {"step": 20, "split": "train", "loss": 2.0, "acc": [0.5, 0.2]},
        {"step": 10, "split": "train", "loss": 3.0, "acc": [0.4]},
        {"step": 10, "split": "val", "loss": 3.5, "acc": [0.3, 0.1]},
        {"step": 20, "split": "train", "loss": 1.5, "acc": [0.6, 0.3]},  # resumed run re-logged step 20
        {"step": 30, "split": "train", "ploss": [1.0, 1.0, 1.0]},
        {"step": 30, "split": "train", "weight_norm_modules": {"fc": 2.0}},
    ]
    steps, losses = series(records, "loss")
    assert steps == [10, 20, 30] and losses == pytest.approx([3.0, 1.5, 1.0 + 0.8 + 0.64])
    assert series(records, "loss", split="val") == ([10], [3.5])
    assert series(records, "acc", index=1) == ([20], [0.3])
    assert series(records, "acc", split="val", index=0) == ([10], [0.3])
    assert series(records, "weight_norm_modules", index="fc") == ([30], [2.0])
    assert series([], "loss") == ([], [])
    with pytest.raises(ValueError, match="index"):
        series(records, "acc")


def test_record_loss_prefers_logged_loss():
    assert record_loss({"loss": 1.25, "ploss": [9.0]}) == 1.25
    assert record_loss({"ploss": [1.0, 2.0]}) == pytest.approx(1.0 + 0.8 * 2.0)
    assert record_loss({}) is None


def test_validate_record_returns_clean_copy():
    clean = validate_record({"step": 4.0, "split": "val", "acc": ["NaN", 0.5]})
    assert clean["step"] == 4 and isinstance(clean["step"], int) and math.isnan(clean["acc"][0])


def test_writer_holds_records_on_a_full_disk_and_loses_none(tmp_path):
    from tests.fixtures.disks import fill_up, mounted_tmpfs

    told = []
    with mounted_tmpfs(tmp_path, "64k") as disk:
        path = disk / "run" / "metrics.jsonl"
        writer = MetricsWriter(path, on_error=told.append)
        writer.write(step=0, split="train", loss=1.0)
        filler = fill_up(disk)
        for step in range(1, 40):  # the rest of the file's last page takes ~10; the next is cut short; none raises
            writer.write(step=step, split="train", loss=1.0, note="z" * 300)
        assert writer.written + writer.pending == 40 and writer.pending >= 20 and writer.lost_records == 0
        assert writer.failed_writes == writer.pending  # each later write retried the oldest held record once
        assert writer.last_error is not None and writer.last_error.errno == errno.ENOSPC
        assert len(told) == 1 and str(path) in told[0] and "disk full" in told[0] and "1 held" in told[0]
        filler.unlink()
        writer.write(step=40, split="train", loss=1.0)
        assert writer.written == 41 and writer.pending == 0 and writer.last_error is None
        assert "writable again" in told[-1] and len(told) == 2
        reader = MetricsReader(path)
        assert [r["step"] for r in reader.poll()] == list(range(41))
        assert reader.follower.bad_lines <= 1  # at most the one torn line


def test_writer_drops_the_oldest_beyond_max_pending_and_counts_them(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.mkdir()  # a real unwritable target: open() fails with EISDIR
    told = []
    writer = MetricsWriter(path, on_error=told.append, max_pending=3)
    for step in range(5):
        writer.write(step=step, split="train", loss=1.0)
    assert writer.pending == 3 and writer.lost_records == 2 and writer.written == 0
    assert any("dropping the oldest" in line for line in told)
    path.rmdir()
    assert writer.flush() is True
    assert [r["step"] for r in read_metrics(path)[0]] == [2, 3, 4]
    assert "2 record(s) were dropped" in told[-1]
