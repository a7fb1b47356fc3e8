"""Following a job's log reads a bounded amount per tick however long its lines: a 1 GiB line is shown cut once and
jumped over, so the lines after it arrive within a few ticks (the old follower read it a megabyte a tick: 17 minutes)."""

from pathlib import Path

import pytest
from tests.fixtures.agent import PY, AgentProcess

from backend.jobs.registry import JobRegistry


@pytest.fixture
def agent(tmp_path):
    process = AgentProcess(tmp_path / "run", interval=0.2)
    yield process
    process.close()
    JobRegistry(tmp_path / "run").stop(all_jobs=True, grace=1)


def collect_until(agent: AgentProcess, job: str, text: str, seen: list[str], start: int = 0, timeout: float = 30) -> int:
    def got(message) -> bool:
        if message["type"] == "log" and message["job"] == job:
            seen.extend(message["lines"])
        return any(text in line for line in seen)

    index, _ = agent.wait(got, timeout=timeout, start=start)
    return index + 1


def grow_sparse(path: Path, head: bytes, to_size: int, tail: bytes = b"") -> None:
    """Append `head`, extend the file to `to_size` with a hole (zeros: no line end), then append `tail`."""
    with open(path, "ab") as handle:
        handle.write(head)
    with open(path, "r+b") as handle:
        handle.truncate(to_size)
    if tail:
        with open(path, "ab") as handle:
            handle.write(tail)


def test_a_1_gib_single_line_log_is_followed_in_bounded_time(agent, tmp_path):
    agent.ok("start_job", name="quiet", kind="other", argv=[PY, "-c", "import time; time.sleep(120)"])
    path = Path(agent.ok("follow_log", name="quiet", stream="stdout")["path"])
    start = path.stat().st_size
    grow_sparse(path, b"head of a long line ", start + (1 << 30), b"\nafter the long line\n")
    seen: list[str] = []
    mark = collect_until(agent, "quiet", "after the long line", seen, timeout=20)  # 0.2 s ticks: the old way took 205 s
    cut = [line for line in seen if line.startswith("head of a long line")]
    assert len(cut) == 1 and cut[0].endswith("cut)") and len(cut[0]) < 5000, seen[:3]

    # A long line still being written when the agent looks: read past it, and the next line end closes it.
    size = path.stat().st_size
    grow_sparse(path, b"second long line ", size + (1 << 30))
    mark = collect_until(agent, "quiet", "second long line", seen, start=mark, timeout=20)
    with open(path, "ab") as handle:
        handle.write(b" its end\nthe last line\n")
    collect_until(agent, "quiet", "the last line", seen, start=mark, timeout=20)
    assert not any("its end" in line for line in seen)  # the rest of a line shown cut is not shown as a line of its own
    assert sum("cut)" in line for line in seen) == 2
