"""JSON-lines writer and follower: partial last lines wait, bad lines are skipped, offsets resume, a full disk glues nothing."""

import errno
import json
import multiprocessing

import pytest

from backend.jsonl import AppendError, JsonlFollower, append_record
from tests.fixtures.disks import fill_up, mounted_tmpfs


def test_partial_last_line_is_left_for_next_poll(tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_bytes(b'{"step": 1}\n{"step": 2')
    follower = JsonlFollower(path)
    assert follower.poll() == [{"step": 1}]
    with open(path, "ab") as handle:
        handle.write(b', "loss": 0.5}\n')
    assert follower.poll() == [{"step": 2, "loss": 0.5}]
    assert follower.poll() == []


def test_resume_from_offset_and_bad_lines(tmp_path):
    path = tmp_path / "m.jsonl"
    for step in range(3):
        append_record(path, {"step": step})
    with open(path, "ab") as handle:
        handle.write(b"garbage\n[1,2]\n")
    append_record(path, {"step": 3})
    first = JsonlFollower(path)
    assert [r["step"] for r in first.read_all()] == [0, 1, 2, 3]
    assert first.bad_lines == 2
    append_record(path, {"step": 4})
    resumed = JsonlFollower(path, offset=first.offset)
    assert resumed.poll() == [{"step": 4}]


def test_truncated_file_restarts(tmp_path):
    path = tmp_path / "m.jsonl"
    append_record(path, {"step": 1, "pad": "x" * 100})
    follower = JsonlFollower(path)
    follower.poll()
    path.write_text(json.dumps({"step": 9}) + "\n")
    assert follower.poll() == [{"step": 9}]


def _writer(path, start):
    for step in range(start, start + 300):
        append_record(path, {"step": step, "pad": "y" * 200})


def test_concurrent_writers_never_tear_lines(tmp_path):
    path = tmp_path / "m.jsonl"
    procs = [multiprocessing.Process(target=_writer, args=(path, k * 1000)) for k in range(3)]
    for p in procs:
        p.start()
    follower = JsonlFollower(path)
    seen = []
    while any(p.is_alive() for p in procs):
        seen.extend(follower.poll())
    for p in procs:
        p.join()
    seen.extend(follower.poll())
    assert follower.bad_lines == 0
    assert sorted(r["step"] for r in seen) == sorted(s for k in range(3) for s in range(k * 1000, k * 1000 + 300))


# --- full disk: real tmpfs mounts (root only; skipped with the reason otherwise) ----------------------------


def test_a_line_torn_by_a_killed_writer_is_terminated_not_glued(tmp_path):
    path = tmp_path / "m.jsonl"
    append_record(path, {"step": 1})
    with open(path, "ab") as handle:
        handle.write(b'{"step": 2, "lo')  # a writer that died mid-line
    append_record(path, {"step": 3})
    append_record(path, {"step": 4})
    follower = JsonlFollower(path)
    assert [r["step"] for r in follower.read_all()] == [1, 3, 4]
    assert follower.bad_lines == 1


def test_short_write_on_a_full_disk_raises_and_the_next_record_is_not_glued(tmp_path):
    with mounted_tmpfs(tmp_path, "64k") as disk:
        path = disk / "metrics.jsonl"
        append_record(path, {"step": 1})
        append_record(path, {"step": 2})
        filler = fill_up(disk)
        before = path.stat().st_size
        with pytest.raises(AppendError) as short:
            append_record(path, {"step": 3, "pad": "x" * 6000})  # only the rest of the file's last page fits
        error = short.value
        assert error.errno == errno.ENOSPC and 0 < error.written < error.needed
        assert path.stat().st_size == before + error.written  # a torn line is on disk
        assert str(path) in str(error) and f"disk full: {error.needed} bytes needed, 0 free" in str(error)
        with pytest.raises(AppendError, match=r"disk full: \d+ bytes needed, 0 free; nothing was written") as refused:
            append_record(path, {"step": 4})
        assert isinstance(refused.value, OSError) and refused.value.written == 0
        filler.unlink()
        append_record(path, {"step": 5})
        append_record(path, {"step": 6})
        follower = JsonlFollower(path)
        assert [r["step"] for r in follower.read_all()] == [1, 2, 5, 6]
        assert follower.bad_lines == 1  # just the torn line
        assert path.read_bytes().endswith(b'{"step":6}\n')
