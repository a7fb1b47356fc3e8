"""A watched TensorBoard file cannot hold the agent: an over-cap length header, a zero-filled gap or garbage is skipped
with a note, reading resyncs on the next valid record, and memory stays bounded (a sparse file claiming 2 GiB)."""

import json
import os
import struct
import subprocess
import sys
from pathlib import Path

from torch.utils.tensorboard import SummaryWriter

from backend.external.reader import ExternalRunReader
from backend.external.tfrecord import MAX_RECORD_BYTES, TFRecordFollower, masked_crc32c
from tests.fixtures.env import ROOT


def event_records(tmp_path: Path, steps: range) -> list[bytes]:
    """The framed records of a real SummaryWriter file logging train/loss at `steps` (the first is the file version)."""
    out = tmp_path / f"src{steps.start}"
    writer = SummaryWriter(str(out))
    for step in steps:
        writer.add_scalar("train/loss", 1.0 / step, step)
    writer.close()
    data = next(out.glob("*tfevents*")).read_bytes()
    records, pos = [], 0
    while pos < len(data):
        end = pos + 12 + struct.unpack("<Q", data[pos : pos + 8])[0] + 4
        records.append(data[pos:end])
        pos = end
    return records


def length_header(length: int) -> bytes:
    """A length header whose CRC is valid: only its claim is wrong."""
    raw = struct.pack("<Q", length)
    return raw + struct.pack("<I", masked_crc32c(raw))


def poll_steps(reader: ExternalRunReader, polls: int = 30) -> list[int]:
    steps: list[int] = []
    for _ in range(polls):
        steps += [r["step"] for r in reader.poll()]
    return steps


def test_a_2_gib_length_header_in_a_sparse_file_costs_no_memory(tmp_path):
    """Records, a header claiming 2 GiB, records, a 3 GiB hole, records: everything valid is read in a few polls, the
    agent's process stays small (the old reader read the claimed 2 GiB whole: 4 GiB resident), the skips are noted."""
    path = tmp_path / "events.out.tfevents.1700000000.host"
    first, second, third = event_records(tmp_path, range(1, 4)), event_records(tmp_path, range(4, 7)), event_records(tmp_path, range(7, 10))
    with open(path, "wb") as handle:
        handle.write(b"".join(first) + length_header(2 << 30) + b"".join(second[1:]))
        handle.truncate(3 << 30)  # sparse: a hole, no disk
        handle.seek(0, os.SEEK_END)
        handle.write(b"".join(third[1:]))
    script = (
        "import json, re, resource, sys\n"
        "resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30))  # a reader that tries to hold the claim fails here\n"
        "from backend.external.reader import ExternalRunReader\n"
        "reader = ExternalRunReader(sys.argv[1])\nsteps, polls = [], 0\n"
        "while polls < 60 and (polls < 3 or reader.bytes_read < reader.bytes_total):\n"
        "    steps += [r['step'] for r in reader.poll()]\n    polls += 1\n"
        "steps += [r['step'] for r in reader.poll()]\n"
        "status = reader.status()['files'][0]\n"
        "print(json.dumps({'steps': steps, 'polls': polls, 'status': status, 'rss_kib': int(re.search(r'VmHWM:\\s+(\\d+)', open('/proc/self/status').read()).group(1))}))\n"
    )
    out = subprocess.run([sys.executable, "-c", script, str(path)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads(out.stdout)
    assert sorted(result["steps"]) == list(range(1, 10)), result
    assert result["polls"] <= 10, result  # the hole is seeked past, not read
    assert result["rss_kib"] < 300 << 10, result  # VmHWM: the reader process's own peak (ru_maxrss survives exec)
    notes = " | ".join(result["status"]["notes"])
    assert "claiming 2147483648 bytes" in notes and "zero-filled" in notes, notes
    assert result["status"]["offset"] == path.stat().st_size


def test_a_zero_filled_gap_is_skipped_and_the_records_after_it_are_read(tmp_path):
    path = tmp_path / "events.out.tfevents.1700000001.host"
    before, after = event_records(tmp_path, range(1, 6)), event_records(tmp_path, range(6, 11))
    gap_start = len(b"".join(before))
    path.write_bytes(b"".join(before) + bytes(256 << 10) + b"".join(after[1:]))  # 256 KiB of written zeros
    reader = ExternalRunReader(path)
    assert sorted(set(poll_steps(reader))) == list(range(1, 11))
    follower = reader.sources[path].follower
    assert follower.offset == path.stat().st_size and follower.skipped == 0
    assert follower.notes == [f"bytes {gap_start}..{gap_start + (256 << 10)} ({256 << 10}): zero-filled, skipped"]


def test_a_zero_filled_tail_waits_for_records_appended_after_it(tmp_path):
    """A file that ends in zeros (preallocated, or a crash before the data reached the disk): the records after it,
    once written, are read."""
    path = tmp_path / "events.out.tfevents.1700000002.host"
    before, after = event_records(tmp_path, range(1, 4)), event_records(tmp_path, range(4, 7))
    path.write_bytes(b"".join(before) + bytes(1 << 20))
    reader = ExternalRunReader(path)
    assert sorted(set(poll_steps(reader, 5))) == [1, 2, 3]
    with open(path, "ab") as handle:
        handle.write(b"".join(after[1:]))
    assert sorted(set(poll_steps(reader, 5))) == [4, 5, 6]


def test_a_real_record_over_the_cap_is_skipped_unread(tmp_path):
    """A valid header of MAX_RECORD_BYTES + 1 with a valid record where it says it ends: jumped over, not read."""
    path = tmp_path / "events.out.tfevents.1700000003.host"
    before, after = event_records(tmp_path, range(1, 4)), event_records(tmp_path, range(4, 7))
    length = MAX_RECORD_BYTES + 1
    with open(path, "wb") as handle:
        handle.write(b"".join(before) + length_header(length))
        handle.seek(length + 4, os.SEEK_CUR)  # its data (a hole) and data CRC
        handle.write(b"".join(after[1:]))
    reader = ExternalRunReader(path)
    assert sorted(set(poll_steps(reader))) == list(range(1, 7))
    follower = reader.sources[path].follower
    assert follower.skipped == 1 and f"a record of {length} bytes, over the {MAX_RECORD_BYTES}-byte cap" in follower.notes[0]


def test_garbage_between_records_is_resynced_within_bounded_polls(tmp_path):
    path = tmp_path / "events.out.tfevents.1700000004.host"
    before, after = event_records(tmp_path, range(1, 4)), event_records(tmp_path, range(4, 7))
    garbage = bytes((i * 7919 + 13) % 251 + 1 for i in range(2 << 20))  # no zeros, no valid header
    path.write_bytes(b"".join(before) + garbage + b"".join(after[1:]))
    follower = TFRecordFollower(path, max_bytes_per_poll=256 << 10)
    payloads = []
    for _ in range(12):  # 2 MiB in 256 KiB polls: 8 of them, each bounded by its chunk
        payloads += follower.poll()
    assert len(payloads) == len(before) + len(after) - 1 and follower.offset == path.stat().st_size
    assert follower.skipped_bytes == len(garbage) and "bad length CRC" in follower.notes[0]
