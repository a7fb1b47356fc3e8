"""Foreign runs, read-only: real tfevents files written by torch's SummaryWriter, and SpecForge console logs."""

import math
import os
import struct

import pytest
from tensorboard.compat.proto import summary_pb2, tensor_pb2, types_pb2
from tensorboard.compat.tensorflow_stub import pywrap_tensorflow as tb_crc
from torch.utils.tensorboard import SummaryWriter

from backend.external.reader import ExternalRunReader, plainly_clean
from backend.external.specforge_log import parse_step_dict
from backend.external.tags import map_tag
from backend.external.tfevent import parse_event
from backend.external.tfrecord import TFRecordFollower, crc32c, masked_crc32c
from backend.metrics.records import check_record, normalize_record
from backend.metrics.signals import estimate_tau

TTT = 3
VAL_ACC = [0.75, 0.5, 0.25]  # exact in float32, so TensorBoard values compare exactly


def log_specforge_step(writer, step, mode="train", base=1.0):
    """Old SpecForge tag names (scripts/train_eagle3.py, 2025): per-position acc_i/ploss_i under train/ and eval/."""
    if mode == "train":
        writer.add_scalar("train/lr", 1e-4 / (1 + step / 100), step)
        writer.add_scalar("train/grad_norm", 0.25 + step / 1000, step)
    for i in range(TTT):
        writer.add_scalar(f"{mode}/acc_{i}", 0.75 - 0.1 * i, step)
        writer.add_scalar(f"{mode}/ploss_{i}", base + i, step)


# SpecForge 0.2/0.3 (specforge/training/controller.py, specforge/eval/evaluator.py) hands its logger these dicts;
# the helpers below build them from their documented shape, with our own values.


def specforge_train_metrics(step, base=1.0):
    """What TrainerController logs every log_interval optimizer steps (EAGLE-3 strategy): bare names."""
    metrics = {f"acc_{i}": 0.875 - 0.125 * i for i in range(TTT)}
    metrics.update({f"ploss_{i}": base + i for i in range(TTT)})
    metrics["acc"] = sum(metrics[f"acc_{i}"] for i in range(TTT)) / TTT
    metrics["loss"] = sum(0.8**i * (base + i) for i in range(TTT))
    metrics.update({f"acceptance_rate_{i}": 0.625 - 0.125 * i for i in range(TTT)})
    metrics["acceptance_rate"] = 0.5
    metrics["grad_norm"] = 0.25 + step / 1000
    metrics["lr"] = 1e-4 / (1 + step / 100)
    metrics.update(
        {
            "perf/optimizer_steps_per_hour": 3600.0,
            "perf/optimizer_step_time_s": 1.5,
            "perf/data_wait_time_s": 0.125,
            "perf/train_compute_time_s": 1.25,
            "perf/durable_ack_time_s": 0.0,
            "perf/global_samples_per_second": 8.0,
        }
    )
    return metrics


def specforge_eval_metrics(step, acc=VAL_ACC, base=2.0):
    """What the Evaluator returns after an eval pass (already eval/ prefixed; per_position_acc is a list)."""
    tau_minus_one, product = 0.0, 1.0
    for a in acc:
        product *= a
        tau_minus_one += product
    metrics = {
        "eval/avg_loss": sum(0.8**i * (base + i) for i in range(len(acc))),
        "eval/avg_acc": acc[0],
        "eval/per_position_acc": list(acc),
        "eval/simulated_acc_len": tau_minus_one,
    }
    metrics.update({f"eval/acceptance_rate_{i}": 0.5 - 0.125 * i for i in range(len(acc))})
    metrics.update({f"eval/ploss_{i}": base + i for i in range(len(acc))})
    return metrics


def tracked(metrics):
    """The names an external tracker gets: lists expanded to <name>/<i>, bare names put under train/."""
    flat = {}
    for key, value in metrics.items():
        items = [(f"{key}/{i}", v) for i, v in enumerate(value)] if isinstance(value, list) else [(key, value)]
        for name, item in items:
            flat[name if name.startswith(("train/", "eval/")) else f"train/{name}"] = float(item)
    return flat


def write_specforge_step(writer, step, metrics):
    """SpecForge's TensorboardTracker: one add_scalar per tracked key, at the optimizer step."""
    for key, value in tracked(metrics).items():
        writer.add_scalar(key, value, global_step=step)


def console_line(step, metrics):
    """SpecForge's console logger: `step S: {dict repr}`, lists kept as lists."""
    return f"step {step}: {metrics}\n"


def poll_until_quiet(reader, limit=10):
    """Poll until two polls in a row bring nothing (the newest step is handed out on the first quiet poll)."""
    records, empty = [], 0
    for _ in range(limit):
        batch = reader.poll()
        records += batch
        empty = 0 if batch else empty + 1
        if empty == 2:
            return records
    raise AssertionError("reader never went quiet")


def keyed(records):
    return {(r["split"], r["step"]): r for r in records}


def event_files(directory):
    return sorted(p for p in directory.rglob("*") if "tfevents" in p.name)


# ---------------------------------------------------------------- framing and protobuf


def test_crc32c_matches_known_vector_and_tensorboards_implementation():
    assert crc32c(b"123456789") == 0xE3069283
    assert crc32c(b"") == 0
    for payload in (b"\x00", os.urandom(37), os.urandom(1000)):
        assert masked_crc32c(payload) == tb_crc.masked_crc32c(payload)


def test_map_tag():
    assert map_tag("train/acc_3") == ("train", "acc", 3)
    assert map_tag("eval/ploss_0") == ("val", "ploss", 0)
    assert map_tag("eval/acceptance_rate_2") == ("val", "acceptance_rate", 2)
    assert map_tag("train/lr") == ("train", "lr", None)
    assert map_tag("eval/grad_norm") == ("val", "grad_norm", None)
    assert map_tag("acc_1") == ("train", "acc", 1)  # no mode prefix: train
    assert map_tag("lr") == ("train", "lr", None)
    assert map_tag("train/epochacc_2") == ("train", "acc", 2)  # early SpecForge names
    assert map_tag("eval/step_ploss_1") == ("val", "ploss", 1)
    assert map_tag("myrun/eval/acc_0") == ("val", "acc", 0)
    assert map_tag("train/something_else") is None and map_tag("images/x/acc_0") is None


def test_map_tag_current_specforge_names():
    assert map_tag("eval/per_position_acc/0") == ("val", "acc", 0)
    assert map_tag("eval/per_position_acc/6") == ("val", "acc", 6)
    assert map_tag("eval/avg_loss") == ("val", "loss", None)
    assert map_tag("eval/acceptance_rate_2") == ("val", "acceptance_rate", 2)
    assert map_tag("train/loss") == ("train", "loss", None)
    assert map_tag("train/perf/optimizer_step_time_s") == ("train", "step_time", None)
    assert map_tag("perf/optimizer_step_time_s") == ("train", "step_time", None)  # console log without a tracker
    assert map_tag("train/plosses/1") == ("train", "ploss", 1)
    # means over positions and derived values have no home in a record (acc and acceptance_rate are lists there)
    for tag in (
        "train/acc",
        "train/acceptance_rate",
        "eval/avg_acc",
        "eval/simulated_acc_len",
        "train/perf/global_samples_per_second",
        "eval/per_position_acc",
        "train/loss/0",
    ):
        assert map_tag(tag) is None, tag


# ---------------------------------------------------------------- tensorboard event files


def test_reads_specforge_tags_incrementally_from_a_directory(tmp_path):
    writer = SummaryWriter(str(tmp_path / "runs"))
    for step in (10, 20, 30):
        log_specforge_step(writer, step)
        if step == 20:
            log_specforge_step(writer, step, mode="eval", base=2.0)
    writer.flush()
    reader = ExternalRunReader(tmp_path)
    first = reader.poll()
    assert [(r["split"], r["step"]) for r in first] == [("train", 10), ("train", 20), ("val", 20)]
    records = first + poll_until_quiet(reader)
    got = keyed(records)
    assert set(got) == {("train", 10), ("train", 20), ("val", 20), ("train", 30)}
    for record in records:
        assert check_record(record) == [], record
    train = got[("train", 20)]
    assert train["acc"] == pytest.approx([0.75, 0.65, 0.55], abs=1e-6)  # float32 simple_value
    assert train["ploss"] == pytest.approx([1.0, 2.0, 3.0])
    assert train["loss"] == pytest.approx(1.0 + 0.8 * 2.0 + 0.64 * 3.0)  # SpecForge weights 0.8**i
    assert train["lr"] == pytest.approx(1e-4 / 1.2, rel=1e-6) and train["grad_norm"] == pytest.approx(0.27)
    assert abs(train["time"] - os.path.getmtime(event_files(tmp_path)[0])) < 120
    val = got[("val", 20)]
    assert val["ploss"] == pytest.approx([2.0, 3.0, 4.0]) and "lr" not in val

    for step in (40, 50):  # the run goes on: only the new steps come back
        log_specforge_step(writer, step)
    writer.flush()
    more = poll_until_quiet(reader)
    assert [(r["split"], r["step"]) for r in more] == [("train", 40), ("train", 50)]
    assert reader.poll() == []
    writer.close()


def test_current_specforge_tensorboard_run_fills_the_accuracy_table_and_tau(tmp_path):
    writer = SummaryWriter(str(tmp_path / "out" / "runs"))  # TensorboardTracker: <output_dir>/runs
    for step in (50, 100, 150, 200):
        write_specforge_step(writer, step, specforge_train_metrics(step, base=2.0 - step / 400))
        if step % 100 == 0:
            write_specforge_step(writer, step, specforge_eval_metrics(step, base=2.5 - step / 400))
    writer.close()
    records = poll_until_quiet(ExternalRunReader(tmp_path / "out"))
    got = keyed(records)
    assert list(got) == [("train", 50), ("train", 100), ("val", 100), ("train", 150), ("train", 200), ("val", 200)]
    for record in records:
        assert check_record(record) == [], record
    val = got[("val", 200)]
    assert val["acc"] == VAL_ACC  # the per-step accuracy table's source: acc[i] of val records
    assert val["acceptance_rate"] == [0.5, 0.375, 0.25]
    assert val["ploss"] == pytest.approx([2.0, 3.0, 4.0]) and val["loss"] == pytest.approx(2.0 + 0.8 * 3 + 0.64 * 4)
    assert set(val) == {"split", "step", "time", "acc", "acceptance_rate", "ploss", "loss", "extras"}
    simulated = specforge_eval_metrics(200)["eval/simulated_acc_len"]  # float32 in the event file
    assert val["extras"] == {"eval/avg_acc": 0.75, "eval/simulated_acc_len": pytest.approx(simulated, rel=1e-6)}
    train = got[("train", 200)]
    assert train["extras"] == {  # every tag with no key in the schema is kept as written: none of the 56 is dropped
        "train/acc": pytest.approx(0.75),
        "train/acceptance_rate": 0.5,
        "train/perf/optimizer_steps_per_hour": 3600.0,
        "train/perf/data_wait_time_s": 0.125,
        "train/perf/train_compute_time_s": 1.25,
        "train/perf/durable_ack_time_s": 0.0,
        "train/perf/global_samples_per_second": 8.0,
    }
    tags = len(tracked(specforge_train_metrics(200))) + len(tracked(specforge_eval_metrics(200)))
    kept = sum(len(r) - 2 - ("time" in r) - ("extras" in r) + len(r.get("extras", {})) for r in (train, val))
    per_position = sum(len(r[k]) - 1 for r in (train, val) for k in ("acc", "ploss", "acceptance_rate"))
    assert kept + per_position == tags
    assert train["acc"] == [0.875, 0.75, 0.625] and train["acceptance_rate"] == [0.625, 0.5, 0.375]
    assert train["ploss"] == pytest.approx([1.5, 2.5, 3.5])
    assert train["loss"] == pytest.approx(1.5 + 0.8 * 2.5 + 0.64 * 3.5)
    assert train["lr"] == pytest.approx(1e-4 / 3, rel=1e-6) and train["grad_norm"] == pytest.approx(0.45)
    assert train["step_time"] == 1.5
    latest_val = [r for r in records if r["split"] == "val"][-1]
    simulated_acc_len = specforge_eval_metrics(200)["eval/simulated_acc_len"]
    assert estimate_tau(latest_val["acc"]) == pytest.approx(1 + simulated_acc_len)  # SpecForge's number + bonus token


def test_newest_step_waits_one_quiet_poll(tmp_path):
    writer = SummaryWriter(str(tmp_path))
    for step in (1, 2):
        log_specforge_step(writer, step)
    writer.flush()
    reader = ExternalRunReader(tmp_path)
    assert [r["step"] for r in reader.poll()] == [1]  # step 2 may still be mid-dict
    assert [r["step"] for r in reader.poll()] == [2]  # nothing new arrived: step 2 is complete
    writer.close()


def test_new_event_files_are_picked_up(tmp_path):
    first = SummaryWriter(str(tmp_path / "runs" / "a"))
    log_specforge_step(first, 5)
    first.close()
    reader = ExternalRunReader(tmp_path)
    assert [r["step"] for r in poll_until_quiet(reader)] == [5]
    second = SummaryWriter(str(tmp_path / "runs" / "b"))  # e.g. a resumed run writes a new file
    log_specforge_step(second, 6)
    second.close()
    assert [r["step"] for r in poll_until_quiet(reader)] == [6]
    assert len(reader.status()["files"]) == 2


def test_tensor_encoded_scalars_and_unprefixed_tags(tmp_path):
    writer = SummaryWriter(str(tmp_path))
    writer.add_scalar("train/acc_0", 0.5, 7, new_style=True)  # TensorProto float_val
    writer.add_scalar("train/ploss_0", 1.25, 7, new_style=True, double_precision=True)  # double_val
    tensor = tensor_pb2.TensorProto(dtype=types_pb2.DT_FLOAT, tensor_content=struct.pack("<f", 0.375))
    summary = summary_pb2.Summary(value=[summary_pb2.Summary.Value(tag="train/grad_norm", tensor=tensor)])
    writer._get_file_writer().add_summary(summary, 7)  # tensor_content, as TF2 writers store scalars
    writer.add_scalar("acc_1", 0.25, 7)
    writer.add_scalar("lr", 3e-5, 7)
    writer.add_scalar("images/not_a_metric", 1.0, 7)
    writer.close()
    (record,) = poll_until_quiet(ExternalRunReader(event_files(tmp_path)[0]))
    assert record["split"] == "train" and record["step"] == 7
    assert record["acc"] == pytest.approx([0.5, 0.25]) and record["ploss"] == [1.25]
    assert record["grad_norm"] == 0.375 and record["lr"] == pytest.approx(3e-5)


def test_parse_event_agrees_with_tensorboards_protobuf(tmp_path):
    from tensorboard.compat.proto import event_pb2

    writer = SummaryWriter(str(tmp_path))
    for step in (0, 1, 300, 2**40):  # step 0 is left out of the event; a large step takes a long varint
        write_specforge_step(writer, step, specforge_eval_metrics(step))
    writer.add_scalar("train/ploss_0", 1.25, 9, new_style=True)
    writer.close()
    follower = TFRecordFollower(event_files(tmp_path)[0])
    payloads = follower.poll()
    assert len(payloads) == 1 + 4 * 12 + 1
    for payload in payloads[1:]:
        event = event_pb2.Event.FromString(payload)
        (value,) = event.summary.value
        expected = value.simple_value if value.HasField("simple_value") else value.tensor.float_val[0]
        assert parse_event(payload) == (event.wall_time, event.step, [(value.tag, expected)])


def written_run(tmp_path, steps=5):
    writer = SummaryWriter(str(tmp_path / "src"))
    for step in range(1, steps + 1):
        log_specforge_step(writer, step)
    writer.close()
    return event_files(tmp_path / "src")[0].read_bytes()


def record_offsets(data):
    offsets, pos = [], 0
    while pos < len(data):
        offsets.append(pos)
        pos += 12 + struct.unpack("<Q", data[pos : pos + 8])[0] + 4
    return offsets


def test_torn_last_record_waits_and_resumes(tmp_path):
    data = written_run(tmp_path)
    last = record_offsets(data)[-1]
    path = tmp_path / "events.out.tfevents.1.host"
    for cut in (last + 5, last + 20, len(data) - 1):  # inside the header, the data, the footer CRC
        path.write_bytes(data[:cut])
        reader = ExternalRunReader(path)
        records = poll_until_quiet(reader)
        assert [r["step"] for r in records] == [1, 2, 3, 4, 5]  # step 5 minus its torn last value
        assert records[-1]["ploss"][:2] == [1.0, 2.0] and len(records[-1]["ploss"]) == TTT - 1
        follower = reader.sources[path].follower
        assert follower.offset == last and follower.skipped == 0
        with open(path, "ab") as handle:
            handle.write(data[cut:])
        rest = poll_until_quiet(reader)
        assert [(r["step"], r["ploss"]) for r in rest] == [(5, [1.0, 2.0, 3.0])]  # handed out again, whole


def test_corrupt_records_are_skipped_and_reading_continues(tmp_path):
    data = bytearray(written_run(tmp_path))
    offsets = record_offsets(bytes(data))
    data[offsets[3] + 14] ^= 0xFF  # inside the data of record 3: data CRC fails
    data[offsets[9]] ^= 0x01  # inside the length of record 9: header CRC fails, reader resyncs
    path = tmp_path / "events.out.tfevents.2.host"
    path.write_bytes(bytes(data))
    follower = TFRecordFollower(path)
    payloads = follower.poll()
    assert len(payloads) == len(offsets) - 2 and follower.skipped == 2 and follower.offset == len(data)
    assert all(parse_event(p)[1] >= 0 for p in payloads)


def test_record_larger_than_the_poll_budget(tmp_path):
    data = written_run(tmp_path, steps=2)
    path = tmp_path / "events.out.tfevents.3.host"
    path.write_bytes(data)
    follower = TFRecordFollower(path, max_bytes_per_poll=16)
    count = 0
    while True:
        batch = follower.poll()
        if not batch:
            break
        count += len(batch)
    assert count == len(record_offsets(data)) and follower.offset == len(data)


def test_missing_path_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="nothing to watch"):
        ExternalRunReader(tmp_path / "nope")


# ---------------------------------------------------------------- SpecForge console logs

PREFIX = "03/16/2026 10:00:{sec:02d} - INFO - specforge.utils - "


def step_block(step, accs, plosses, sec=0, rates=None, epochs=10):
    lines = [PREFIX.format(sec=sec) + f"Eval - Step {step} [{step + 1}/{epochs}], position {i},  Acc: {a:.2f}" for i, a in enumerate(accs)]
    for i, r in enumerate(rates or []):
        lines.append(PREFIX.format(sec=sec) + f"Eval - Step {step} [{step + 1}/{epochs}], position {i},  Acceptance Rate: {r:.4f}")
    lines += [PREFIX.format(sec=sec) + f"Eval - Step {step} [{step + 1}/{epochs}], position {i}, pLoss: {p}" for i, p in enumerate(plosses)]
    return "\n".join(lines) + "\n"


def tqdm(kind, epoch, n, total):
    return f"\r{kind} Epoch {epoch}: {100 * n // total:3d}%|##        | {n}/{total} [00:10<01:30,  5.00it/s, loss=1.2]"


def test_specforge_log_train_and_eval_blocks(tmp_path):
    log = tmp_path / "train.log"
    text = (
        "\n -----------【args】-----------\nlearning_rate ·········· 0.0001\n"
        + tqdm("Training", 0, 49, 500)
        + tqdm("Training", 0, 50, 500)
        + step_block(50, [0.61, 0.42], [1.5, 2.25], sec=1, rates=[0.7, 0.5])
        + tqdm("Training", 0, 100, 500)
        + step_block(100, [0.65, 0.45], [1.4, 2.0], sec=2)
        + tqdm("Evaluating", 0, 20, 20)
        + "\n"
        + step_block(100, [0.55, 0.35], [1.9, 2.8], sec=3)
        + "03/16/2026 10:00:04 - INFO - specforge.utils - Restored optimizer/scheduler state: epoch=0, step=150, lr=0.000050\n"
        + step_block(150, [0.7, 0.5], [1.3, 1.9], sec=5)
        + step_block(150, [0.6, 0.4], [1.8, 2.6], sec=6)  # eval block without a tqdm marker: same step again
        + "03/16/2026 10:00:07 - INFO - specforge.utils - Eval - Step 180, position 0,  Acc: 0.66\n"  # older: eval only
    )
    log.write_text(text)
    records = poll_until_quiet(ExternalRunReader(log))
    got = keyed(records)
    assert list(got) == [("train", 50), ("train", 100), ("val", 100), ("train", 150), ("val", 150), ("val", 180)]
    for record in records:
        assert check_record(record) == [], record
    first = got[("train", 50)]
    assert first["acc"] == [0.61, 0.42] and first["ploss"] == [1.5, 2.25] and first["acceptance_rate"] == [0.7, 0.5]
    assert first["loss"] == pytest.approx(1.5 + 0.8 * 2.25) and first["epoch"] == 0
    assert got[("val", 100)]["acc"] == [0.55, 0.35] and got[("train", 100)]["acc"] == [0.65, 0.45]
    assert got[("train", 150)]["lr"] == 0.00005 and "lr" not in got[("train", 100)]
    assert got[("val", 150)]["ploss"] == [1.8, 2.6]
    assert got[("train", 100)]["time"] - first["time"] == 1.0


def test_parse_step_dict_reads_reprs_and_json_without_evaluating():
    text = "{'train/acc_0': 0.5, 'lr': 1e-05, 'x': nan, 'y': -inf, \"z\": Infinity, 'eval/per_position_acc': [0.7, 0.25, nan]}"
    items = parse_step_dict(text)
    assert items["train/acc_0"] == 0.5 and items["lr"] == 1e-05 and math.isnan(items["x"]) and items["y"] == -math.inf
    assert items["z"] == math.inf and items["eval/per_position_acc"][:2] == [0.7, 0.25]
    assert math.isnan(items["eval/per_position_acc"][2])
    assert parse_step_dict("{'acc_0': 0.5, 'lr': 2e-05}") == {"acc_0": 0.5, "lr": 2e-05}  # the JSON fast path
    hostile = "{'acc_0': __import__('os').system('false'), 'note': 'text', 'ok': None, 'acc_1': 0.5}"
    assert parse_step_dict(hostile) == {"acc_1": 0.5}
    assert parse_step_dict("{'a': " + "[" * 100000 + "]" * 100000 + ", 'acc_0': 0.5}") == {"acc_0": 0.5}


def test_step_lines_keep_only_numbers(tmp_path):
    log = tmp_path / "train.log"
    log.write_text(
        'step 3: {"train/lr": "high", "train/acc_0": 0.5, "train/acc_1": true, "train/grad_norm": null, '
        '"eval/per_position_acc": [0.5, "x", 0.25]}\n'  # JSON: read by the fast path
        "step 4: {'note': 'nothing we keep', 'train/lr': None}\n"
        "step 5: {'eval/per_position_acc': [0.5, 0.25, 0.125, 0.0625], 'train/acc_0': True}\n"
        "step 6: {'train/acc_0': " + "9" * 400 + "}\n"
    )  # an int no float holds: NaN
    train, val, later, huge = poll_until_quiet(ExternalRunReader(log))
    assert set(train) == {"split", "step", "acc"} and train["acc"][0] == 0.5 and math.isnan(train["acc"][1])
    assert val["acc"][0] == 0.5 and math.isnan(val["acc"][1]) and val["acc"][2] == 0.25
    assert (later["split"], later["step"], later["acc"]) == ("val", 5, [0.5, 0.25, 0.125, 0.0625])  # a new layout
    assert huge["step"] == 6 and math.isnan(huge["acc"][0])


def test_current_specforge_console_log_with_and_without_a_tracker(tmp_path):
    for name, shape in (("no_tracker", lambda m: m), ("tensorboard", tracked)):
        log = tmp_path / f"{name}.log"
        text = "[rank0]: loading target...\n"
        for step in (50, 100, 150):
            text += console_line(step, shape(specforge_train_metrics(step)))
            if step == 100:
                text += console_line(step, shape(specforge_eval_metrics(step, acc=[0.8, 0.6, 0.4])))
        text += "Training:  50%|#####     | 150/300 [01:00<01:00,  2.50step/s]\r"  # a tqdm redraw, no newline
        text += console_line(200, shape(specforge_eval_metrics(200)))
        log.write_text(text)
        records = poll_until_quiet(ExternalRunReader(log))
        got = keyed(records)
        assert list(got) == [("train", 50), ("train", 100), ("val", 100), ("train", 150), ("val", 200)], name
        for record in records:
            assert check_record(record) == [], record
        assert got[("val", 100)]["acc"] == [0.8, 0.6, 0.4] and got[("val", 200)]["acc"] == VAL_ACC
        assert got[("val", 200)]["loss"] == pytest.approx(2.0 + 0.8 * 3 + 0.64 * 4)
        train = got[("train", 100)]
        assert train["acc"] == [0.875, 0.75, 0.625] and train["ploss"] == [1.0, 2.0, 3.0]
        assert train["lr"] == 1e-4 / 2 and train["grad_norm"] == 0.35 and train["step_time"] == 1.5
        assert estimate_tau(got[("val", 200)]["acc"]) == 1 + 0.75 + 0.75 * 0.5 + 0.75 * 0.5 * 0.25
        prefix = "train/" if name == "tensorboard" else ""
        assert train["extras"][prefix + "acceptance_rate"] == 0.5 and train["extras"][prefix + "perf/global_samples_per_second"] == 8.0
        assert got[("val", 200)]["extras"]["eval/simulated_acc_len"] == specforge_eval_metrics(200)["eval/simulated_acc_len"]


def test_console_log_non_finite_values_pass_the_schema(tmp_path):
    log = tmp_path / "train.log"
    metrics = specforge_train_metrics(10)
    metrics.update(loss=math.nan, grad_norm=math.inf, ploss_1=math.nan)
    log.write_text(console_line(10, metrics) + console_line(10, specforge_eval_metrics(10)))
    got = keyed(poll_until_quiet(ExternalRunReader(log)))
    train = got[("train", 10)]
    assert math.isnan(train["loss"]) and train["grad_norm"] == math.inf and math.isnan(train["ploss"][1])
    assert got[("val", 10)]["acc"] == VAL_ACC


def test_plainly_clean_records_are_exactly_what_normalize_record_returns():
    good = [
        {"step": 0, "split": "val"},
        {
            "step": 5,
            "split": "train",
            "acc": [0.5, math.nan],
            "ploss": [1.0],
            "acceptance_rate": [],
            "loss": math.nan,
            "lr": 0.0,
            "grad_norm": math.inf,
            "step_time": 1.5,
            "epoch": 2,
            "time": 1.0e9,
            "weight_norm": 3,
            "tokens": 10,
        },
    ]
    bad_or_coerced = [
        {"step": -1, "split": "train"},
        {"step": 1.0, "split": "train"},
        {"step": 1, "split": "eval"},
        {"step": 1, "split": "val", "lr": -1e-4},
        {"step": 1, "split": "val", "grad_norm": -math.inf},
        {"step": 1, "split": "val", "acc": [1]},
        {"step": 1, "split": "val", "acc": (0.5,)},
        {"step": 1, "split": "val", "loss": "NaN"},
        {"step": 1, "split": "val", "loss": True},
        {"step": 1, "split": "val", "tokens": 1.0},
        {"step": 1, "split": "val", "other": 1},
        {"step": 1, "split": "val", "weight_norm_modules": {"fc": 1.0}},
    ]
    for record in good:
        assert plainly_clean(record) and normalize_record(record) == (record, []), record
    for record in bad_or_coerced:
        assert not plainly_clean(record), record


def test_big_console_log_is_read_in_bounded_polls(tmp_path):
    log = tmp_path / "train.log"
    steps = 0
    with open(log, "w") as handle:
        while handle.tell() < 5 * (1 << 20) + 12345:  # a bit over 5 MiB
            steps += 1
            handle.write(console_line(steps, tracked(specforge_train_metrics(steps))))
            if steps % 10 == 0:
                handle.write(console_line(steps, specforge_eval_metrics(steps)))
    size = log.stat().st_size
    reader = ExternalRunReader(log, max_bytes_per_poll=2 << 20)
    records, read_before = [], 0
    for _ in range(20):
        records += reader.poll()
        assert reader.bytes_read - read_before <= 2 << 20 and reader.bytes_total == size
        read_before = reader.bytes_read
        if reader.bytes_read == size:
            break
    assert reader.bytes_read == size
    records += poll_until_quiet(reader)
    pairs = [(r["split"], r["step"]) for r in records]
    assert len(pairs) == len(set(pairs)) == steps + steps // 10  # catching up hands nothing out twice
    assert [r["step"] for r in records if r["split"] == "val"][-1] == steps - steps % 10


def test_big_event_file_is_read_in_bounded_polls(tmp_path):
    writer = SummaryWriter(str(tmp_path))
    for step in range(1, 1001):
        write_specforge_step(writer, step, specforge_train_metrics(step))
    writer.close()
    size = event_files(tmp_path)[0].stat().st_size
    reader = ExternalRunReader(tmp_path, max_bytes_per_poll=1 << 20)
    first = reader.poll()
    assert 0 < reader.bytes_read <= 1 << 20 < size == reader.bytes_total
    records = first + poll_until_quiet(reader, limit=20)
    assert reader.bytes_read == size and [r["step"] for r in records] == list(range(1, 1001))


def test_specforge_log_partial_lines_and_growth(tmp_path):
    log = tmp_path / "train.log"
    block = step_block(10, [0.5, 0.25], [2.0, 3.0])
    cut = block.index("pLoss: 3.0") + 7  # mid-number of the last line
    log.write_text(block[:cut])
    reader = ExternalRunReader(log)
    partial = poll_until_quiet(reader)
    assert [(r["step"], r["ploss"]) for r in partial] == [(10, [2.0])]  # the unterminated line waits
    with open(log, "a") as handle:
        handle.write(block[cut:] + step_block(20, [0.55, 0.3], [1.9, 2.9]))
    rest = poll_until_quiet(reader)
    assert [(r["split"], r["step"], r["ploss"]) for r in rest] == [("train", 10, [2.0, 3.0]), ("train", 20, [1.9, 2.9])]
    assert rest[0]["acc"] == [0.5, 0.25]  # the re-sent record is whole


def test_specforge_log_old_epoch_format(tmp_path):
    log = tmp_path / "train.log"
    lines = [tqdm("Training", 0, 500, 500), "\n"]
    lines += [f"Train Epoch [1/3], position {i},  Acc: {a:.2f}\n" for i, a in enumerate([0.5, 0.3])]
    lines += [f"Train Epoch [1/3], position {i}, pLoss: {p:.2f}\n" for i, p in enumerate([2.0, 2.5])]
    lines += [tqdm("Evaluating", 0, 10, 10), "\n"]
    lines += [f"Eval Epoch [1/3], position {i},  Acc: {a:.2f}\n" for i, a in enumerate([0.4, 0.2])]
    lines += ["Test Epoch [2/3], position 0, pLoss: 2.10\n"]
    log.write_text("".join(lines))
    got = keyed(poll_until_quiet(ExternalRunReader(log)))
    assert list(got) == [("train", 500), ("val", 500), ("val", 1000)]  # step = epochs done * 500 batches
    assert got[("train", 500)]["acc"] == [0.5, 0.3] and got[("train", 500)]["epoch"] == 0
    assert got[("val", 1000)]["ploss"] == [2.1] and got[("val", 1000)]["epoch"] == 1


def test_watched_tensorboard_run_feeds_the_grokking_signals(tmp_path):
    from backend.metrics.signals import compute_signals

    writer = SummaryWriter(str(tmp_path / "runs"))
    for step in range(10, 210, 10):
        log_specforge_step(writer, step, base=2.0 - step / 200)
        if step % 50 == 0:
            log_specforge_step(writer, step, mode="eval", base=2.5 - step / 400)
    writer.close()
    records = poll_until_quiet(ExternalRunReader(tmp_path))
    assert len(records) == 20 + 4
    signals = compute_signals(records, num_steps=TTT)
    acc = [0.75, 0.65, 0.55]  # float32 round trip, so compare approximately
    assert signals["tau_hat"] == pytest.approx(1 + acc[0] + acc[0] * acc[1] + acc[0] * acc[1] * acc[2], rel=1e-6)
    assert signals["tau_hat_step"] == 200 and signals["gap"] > 0
    assert signals["latest"]["lr"] == pytest.approx(1e-4 / 3, rel=1e-6)


# -- plain-text logs: the built-in `name value` reading, a user's line regex, and a word when the format is unknown --


def test_the_trainers_own_stderr_and_a_hand_written_scripts_log_are_read_as_text(tmp_path):
    own = tmp_path / "stderr.log"
    own.write_text(
        "[train] output: /r/jobs/train-x (world size 1, device cpu)\n"
        "[train] step 260/300 loss 6.4713 acc0 0.784 lr 4.40e-04 grad 0.512 0.123 s/step\n"
        "[train] validation at step 260: loss 6.9000 acc 0.700 0.600 0.500\n"
        "[train] checkpoint: /r/jobs/train-x/checkpoints/epoch_0_step_260\n"
    )
    reader = ExternalRunReader(own)
    assert reader.format == "text" and reader.warning is None
    train, val = poll_until_quiet(reader)
    assert train == {"split": "train", "step": 260, "loss": 6.4713, "acc": [0.784], "lr": 4.4e-4, "grad_norm": 0.512}
    assert val == {"split": "val", "step": 260, "loss": 6.9, "acc": [0.7, 0.6, 0.5]}
    script = tmp_path / "train.out"
    script.write_text("loading data\nepoch 1 step 200 loss 8.38 acc0 0.246 lr 1.2e-04\nepoch 1 step 210 loss 8.30 acc0 0.25 lr 1.1e-04\n")
    first, second = poll_until_quiet(ExternalRunReader(script))
    assert first == {"split": "train", "step": 200, "epoch": 1.0, "loss": 8.38, "acc": [0.246], "lr": 1.2e-4}
    assert second["step"] == 210 and second["loss"] == 8.3


def test_a_line_regex_reads_a_log_no_built_in_format_knows(tmp_path):
    log = tmp_path / "odd.log"
    log.write_text("it=5 | L=2.50 | a@0=0.41 a@1=0.2\nit=6 | L=2.25 | a@0=0.43 a@1=0.21\nit=6 VALID L=2.75\n")
    assert ExternalRunReader(log).warning is not None  # no built-in format reads it
    pattern = r"it=(?P<step>\d+)\s*\|?\s*(?P<split>VALID)?.*?L=(?P<loss>\S+)(?:.*a@0=(?P<acc0>\S+))?(?:.*a@1=(?P<acc1>\S+))?"
    reader = ExternalRunReader(log, line_format=pattern)
    assert reader.format == "regex"
    records = poll_until_quiet(reader)
    assert records[0] == {"split": "train", "step": 5, "loss": 2.5, "acc": [0.41, 0.2]}
    assert records[-1] == {"split": "val", "step": 6, "loss": 2.75}
    with pytest.raises(ValueError, match="no \\(\\?P<step>"):
        ExternalRunReader(log, line_format=r"L=(?P<loss>\S+)")
    with pytest.raises(ValueError, match="is not a regular expression"):
        ExternalRunReader(log, line_format=r"(?P<step>\d+")


def test_a_log_in_no_format_w_reads_is_warned_about_and_binary_data_refused(tmp_path):
    log = tmp_path / "notes.txt"
    log.write_text("starting\nall good so far\n")
    reader = ExternalRunReader(log)
    assert reader.poll() == [] and reader.format is None
    assert "no line in the first 25 bytes" in reader.warning and "text: a plain-text log" in reader.warning
    assert "records appear once such a line comes" in reader.warning
    with open(log, "a") as handle:
        handle.write("step 3 loss 1.5\n")
    assert poll_until_quiet(reader) == [{"split": "train", "step": 3, "loss": 1.5}] and reader.warning is None
    blob = tmp_path / "model.bin"
    blob.write_bytes(b"\x00\x01\x02" * 100)
    with pytest.raises(ValueError, match="binary data, not a text log; w reads: tensorboard"):
        ExternalRunReader(blob)
