"""Foreign runs, read-only: real tfevents files written by torch's SummaryWriter, and SpecForge console logs."""
import math
import os
import struct

import pytest
from tensorboard.compat.proto import summary_pb2, tensor_pb2, types_pb2
from tensorboard.compat.tensorflow_stub import pywrap_tensorflow as tb_crc
from torch.utils.tensorboard import SummaryWriter

from backend.external import (ExternalRunReader, TFRecordFollower, crc32c, map_tag, masked_crc32c, parse_event)
from backend.metrics import check_record

TTT = 3


def log_specforge_step(writer, step, mode="train", base=1.0):
    """What SpecForge's record_metrcs hands tracker.log: per-position ploss/acc, lr and grad_norm for train."""
    if mode == "train":
        writer.add_scalar("train/lr", 1e-4 / (1 + step / 100), step)
        writer.add_scalar("train/grad_norm", 0.25 + step / 1000, step)
    for i in range(TTT):
        writer.add_scalar(f"{mode}/acc_{i}", 0.75 - 0.1 * i, step)
        writer.add_scalar(f"{mode}/ploss_{i}", base + i, step)


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
        pos += 12 + struct.unpack("<Q", data[pos:pos + 8])[0] + 4
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
    lines = [PREFIX.format(sec=sec) + f"Eval - Step {step} [{step + 1}/{epochs}], position {i},  Acc: {a:.2f}"
             for i, a in enumerate(accs)]
    for i, r in enumerate(rates or []):
        lines.append(PREFIX.format(sec=sec) + f"Eval - Step {step} [{step + 1}/{epochs}], position {i},  "
                     f"Acceptance Rate: {r:.4f}")
    lines += [PREFIX.format(sec=sec) + f"Eval - Step {step} [{step + 1}/{epochs}], position {i}, pLoss: {p}"
              for i, p in enumerate(plosses)]
    return "\n".join(lines) + "\n"


def tqdm(kind, epoch, n, total):
    return f"\r{kind} Epoch {epoch}: {100 * n // total:3d}%|##        | {n}/{total} [00:10<01:30,  5.00it/s, loss=1.2]"


def test_specforge_log_train_and_eval_blocks(tmp_path):
    log = tmp_path / "train.log"
    text = (
        "\n -----------【args】-----------\nlearning_rate ·········· 0.0001\n"
        + tqdm("Training", 0, 49, 500) + tqdm("Training", 0, 50, 500)
        + step_block(50, [0.61, 0.42], [1.5, 2.25], sec=1, rates=[0.7, 0.5])
        + tqdm("Training", 0, 100, 500)
        + step_block(100, [0.65, 0.45], [1.4, 2.0], sec=2)
        + tqdm("Evaluating", 0, 20, 20) + "\n"
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
    from backend.signals import compute_signals

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
