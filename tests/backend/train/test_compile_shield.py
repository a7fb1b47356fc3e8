"""A stop's SIGTERM to the job's process group leaves inductor's compile workers alive, so compiles after it still run."""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tests.fixtures.env import ROOT, subprocess_env

JOB = textwrap.dedent(
    """
    import signal, sys, time
    import torch
    from backend.train.attention import shield_compile_workers

    stopped = []
    signal.signal(signal.SIGTERM, lambda *_: stopped.append(1))
    shield_compile_workers()
    before = torch.compile(lambda x: (x * 2).sin() + x.cos())
    before(torch.randn(8))
    print("READY", flush=True)
    while not stopped:
        time.sleep(0.05)
    after = torch.compile(lambda x: (x + 3).cos() * x.exp())  # a new graph, compiled after the group's SIGTERM
    print("AFTER", round(float(after(torch.ones(16)).sum()), 3), flush=True)
    """
)


def group_members(pgid: int) -> set[int]:
    members = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[2]) == pgid:
                members.add(int(entry.name))
    return members


@pytest.mark.slow
def test_compile_workers_survive_the_groups_sigterm_and_the_next_compile_runs(tmp_path):
    env = subprocess_env() | {"EAGLE3_INDUCTOR_THREADS": "2", "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}
    job = subprocess.Popen([sys.executable, "-c", JOB], cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert job.stdout.readline().strip() == "READY"
        workers = group_members(job.pid) - {job.pid}
        assert workers, "no compile worker process was started in the job's group"
        os.killpg(job.pid, signal.SIGTERM)  # what a stop does first
        time.sleep(1.0)
        assert all(Path(f"/proc/{pid}").exists() for pid in workers), "a compile worker died of the stop's SIGTERM"
        line = job.stdout.readline().strip()
        assert line == f"AFTER {round(16 * math.cos(4) * math.e, 3)}", line
        assert job.wait(timeout=120) == 0
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
            job.wait()
    deadline = time.monotonic() + 30
    while group_members(job.pid) and time.monotonic() < deadline:  # the job's exit ends its pool
        time.sleep(0.2)
    assert not group_members(job.pid)
