"""JSON-lines writer and follower: partial last lines wait, bad lines are skipped, offsets resume."""
import json
import multiprocessing

from backend.jsonl import JsonlFollower, append_record


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
