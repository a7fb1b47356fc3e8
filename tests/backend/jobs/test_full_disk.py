"""Jobs on a real full disk (a 1 MiB tmpfs filled to ENOSPC): a start refused in one line, a stop's verdict kept until space returns."""

import json
import os
import sqlite3
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from backend.jobs import registry as jobs
from backend.host import procs
from backend.jobs.records import JobError, JobNoSpace
from backend.jobs.registry import JobRegistry
from tests.fixtures.waiting import wait_for
from tests.fixtures.env import ROOT

PY = sys.executable
IGNORE_TERM = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('ready', flush=True); time.sleep(600)"
MARK = "eagle3-full-disk-test-marker"


@pytest.fixture
def disk(tmp_path):
    """A 1 MiB tmpfs (mounting needs root here; elsewhere the test is skipped, it cannot be faked)."""
    path = tmp_path / "disk"
    path.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(path)], capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    yield path
    for db in path.glob("*/jobs.db"):  # a failed test must not leave its job running
        JobRegistry(db.parent).stop(all_jobs=True, grace=0)
    subprocess.run(["umount", "-l", str(path)], check=False)


def fill(disk: Path) -> Path:
    """Write a real file until the disk says ENOSPC."""
    filler = disk / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        while os.write(fd, b"\0" * 4096):
            pass
    except OSError:
        pass
    finally:
        os.close(fd)
    assert os.statvfs(disk).f_bavail == 0
    return filler


def cli(run_dir: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([PY, "-m", "backend", "job", args[0], "--run-dir", str(run_dir), *args[1:]], cwd=ROOT, capture_output=True, text=True, timeout=90)


def marked_processes() -> list[int]:
    return [pid for pid in procs.list_pids() if procs.is_alive(pid) and MARK in procs.cmdline(pid)]


def test_job_start_on_a_full_disk_is_one_clear_line_and_leaves_nothing(disk):
    run = disk / "run"
    JobRegistry(run).close()
    filler = fill(disk)
    done = cli(run, "start", "--name", "late", "--", PY, "-c", f"import time; time.sleep(600)  # {MARK}")
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr and done.stderr.count("\n") == 1, done.stderr
    assert "no space" in done.stderr and str(run) in done.stderr and "Nothing was started" in done.stderr
    assert marked_processes() == []
    filler.unlink()
    assert JobRegistry(run).list_jobs() == [] and list((run / "jobs").iterdir()) == []  # no half record, no job dir


def test_a_start_whose_record_cannot_be_written_leaves_no_record_no_dir_no_process(disk, monkeypatch):
    """Past the up-front check (as when the disk fills between the check and the write): SQLite's own write fails."""
    run = disk / "run"
    registry = JobRegistry(run)
    registry.start_job("old", "other", [PY, "-c", "pass"])
    wait_for(lambda: registry.get("old").info.state == "exited", what="the first job to end")
    filler = fill(disk)
    monkeypatch.setattr(jobs, "START_MIN_FREE", 0)
    with pytest.raises(JobNoSpace, match="no record was written"):
        registry.start_job("old", "other", [PY, "-c", f"import time; time.sleep(600)  # {MARK}"])
    assert marked_processes() == []
    filler.unlink()
    registry.close()
    fresh = JobRegistry(run)
    assert [(j.name, j.state) for j in fresh.list_jobs()] == [("old", "exited")]
    assert [p.name for p in (run / "jobs").iterdir()] == ["old"]  # the old job's dir was put back, not left renamed aside
    assert Path(fresh.get("old").info.job_dir).is_dir()


def test_a_job_stopped_on_a_full_disk_settles_to_stopped_once_space_returns(disk):
    run = disk / "run"
    registry = JobRegistry(run)
    info = registry.start_job("full", "other", [PY, "-c", IGNORE_TERM])
    wait_for(lambda: "ready" in Path(info.stdout_path).read_text(), what="SIGTERM to be ignored")
    registry.close()
    filler = fill(disk)
    stopped = cli(run, "stop", "--name", "full", "--grace", "0.5", "--json")
    assert stopped.returncode == 0, stopped.stderr
    assert [(v["pid"], v["outcome"]) for v in json.loads(stopped.stdout)["verdicts"]] == [(info.pid, "killed")]
    assert not procs.is_alive(info.pid, info.start_time_ticks)
    while_full = {job["name"]: job for job in json.loads(cli(run, "list", "--json").stdout)}
    assert while_full["full"]["state"] == "stopped", while_full  # even before jobs.db can take it
    filler.unlink()
    listed = {job["name"]: job for job in json.loads(cli(run, "list", "--json").stdout)}["full"]
    assert (listed["state"], listed["exit_code"]) == ("stopped", -9) and "stopped by operator (grace 0.5s)" in listed["detail"], listed
    with sqlite3.connect(run / "jobs.db") as db:  # settled in jobs.db itself, not only in what a listing works out
        assert db.execute("SELECT state, exit_code FROM jobs WHERE name = 'full'").fetchall() == [("stopped", -9)]


def test_adopt_on_a_full_disk_is_one_clear_line_and_adopts_nothing(disk):
    run = disk / "run"
    JobRegistry(run).close()
    sleeper = subprocess.Popen([PY, "-c", f"import time; time.sleep(600)  # {MARK}"])
    try:
        filler = fill(disk)
        done = cli(run, "adopt", str(sleeper.pid), "--name", "mine", "--yes")
        assert done.returncode == 2 and "Traceback" not in done.stderr and done.stderr.count("\n") == 1, done.stderr
        assert "no space" in done.stderr and "Nothing was adopted" in done.stderr
        filler.unlink()
        assert JobRegistry(run).list_jobs() == [] and list((run / "jobs").iterdir()) == []
        assert sleeper.poll() is None
    finally:
        sleeper.kill()
        sleeper.wait()


def test_a_registry_opened_on_the_full_disk_stores_the_stop_once_space_returns(disk, monkeypatch):
    """Like an agent started while the disk was full: its read-only connection is retried, and the stop settles in jobs.db."""
    monkeypatch.setattr(jobs, "READ_ONLY_RETRY_S", 0.2)
    run = disk / "run"
    starter = JobRegistry(run)
    info = starter.start_job("late", "other", [PY, "-c", IGNORE_TERM])
    wait_for(lambda: "ready" in Path(info.stdout_path).read_text(), what="SIGTERM to be ignored")
    starter.close()
    filler = fill(disk)
    agent = JobRegistry(run)  # opened read-only: the disk is full
    verdicts = agent.stop(["late"], grace=0.3)
    assert [(v.pid, v.outcome) for v in verdicts] == [(info.pid, "killed")] and agent.unrecorded()
    filler.unlink()

    def stored() -> list:
        agent.refresh()  # only this registry may store it: a raw read below, no other registry's refresh
        with sqlite3.connect(f"file:{run / 'jobs.db'}?mode=ro", uri=True) as db:
            return db.execute("SELECT state, exit_code FROM jobs WHERE name = 'late'").fetchall()

    wait_for(lambda: stored() == [("stopped", -9)], what="the agent-like registry to store the stop")
    assert agent.start_job("again", "other", [PY, "-c", "pass"]).name == "again"  # and it can start jobs again


def test_a_leader_that_cannot_be_recorded_is_killed_again_not_left_running(tmp_path, monkeypatch):
    """The start's second write (the leader's PID) fails for real: another process holds jobs.db's write lock from
    the moment the start's record is committed. The job must not run on without a record that could stop it."""
    monkeypatch.setattr(jobs, "BUSY_TIMEOUT_S", 0.5)
    registry = JobRegistry(tmp_path / "run")
    holder = sqlite3.connect(registry.db_path, timeout=0, isolation_level=None, check_same_thread=False)
    locked = threading.Event()

    def hold_the_lock_once_the_record_is_in() -> None:
        while not locked.is_set():
            try:
                holder.execute("BEGIN IMMEDIATE")
            except sqlite3.OperationalError:
                continue
            if holder.execute("SELECT count(*) FROM jobs WHERE name = 'unrecordable'").fetchone()[0]:
                locked.set()
                return
            holder.execute("ROLLBACK")

    grabber = threading.Thread(target=hold_the_lock_once_the_record_is_in, daemon=True)
    grabber.start()
    try:
        with pytest.raises(JobError, match="could not be recorded; it was killed again") as raised:
            registry.start_job("unrecordable", "other", [PY, "-c", f"import time; time.sleep(600)  # {MARK}"])
        assert locked.is_set() and "nothing of it runs" in str(raised.value), raised.value
        assert marked_processes() == []
    finally:
        locked.set()
        grabber.join(5)
        if holder.in_transaction:
            holder.execute("ROLLBACK")
        holder.close()
    record = JobRegistry(tmp_path / "run").list_records()
    assert [(r.name, r.info.pid) for r in record] in ([], [("unrecordable", 0)])  # removed, or a record with no process behind it
