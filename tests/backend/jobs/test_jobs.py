"""Owned jobs with real processes: stop kills the job's whole tree and nothing else, stale records are never signalled."""

import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

from backend.host import procs
from backend.jobs.records import JobBadParams, JobConflict, JobError, JobNotFound, JobRefused
from backend.jobs.registry import JobRegistry
from backend.protocol import GpuProcess, GpuSample
from tests.fixtures.waiting import wait_for
from tests.fixtures.env import ROOT

PY = sys.executable
SLEEPER = "import time; time.sleep(600)"


def cli(run_dir: Path, *args: str, timeout: float = 90) -> subprocess.CompletedProcess:
    """The real `eagle3-host` command line in a separate process."""
    command = (
        [PY, "-m", "backend", *args[:2], "--run-dir", str(run_dir), *args[2:]]
        if args[0] == "job"
        else [PY, "-m", "backend", args[0], "--run-dir", str(run_dir), *args[1:]]
    )
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def read_pid(path: Path) -> int:
    wait_for(lambda: path.exists() and path.read_text().strip(), what=str(path))
    return int(path.read_text())


@pytest.fixture
def registry(tmp_path):
    reg = JobRegistry(tmp_path / "run")
    yield reg
    reg.stop(all_jobs=True, grace=1)  # whatever a failed test left behind


def test_stop_all_spares_a_decoy_with_the_same_command(tmp_path):
    run = tmp_path / "run"
    marks = tmp_path / "marks"
    marks.mkdir()
    grandchild = f"import os, time; os.setsid(); open({str(marks / 'grandchild')!r}, 'w').write(str(os.getpid())); time.sleep(600)"
    child = f"import os, subprocess, sys, time; subprocess.Popen([sys.executable, '-c', {grandchild!r}]); open({str(marks / 'child')!r}, 'w').write(str(os.getpid())); time.sleep(600)"
    leader = (
        "import subprocess, sys, time\n"
        f"twin = subprocess.Popen([sys.executable, '-c', {SLEEPER!r}])\n"
        f"open({str(marks / 'twin')!r}, 'w').write(str(twin.pid))\n"
        f"subprocess.Popen([sys.executable, '-c', {child!r}])\n"
        "time.sleep(600)\n"
    )
    decoy = subprocess.Popen([PY, "-c", SLEEPER], start_new_session=True)  # same user, same command line, not ours
    try:
        started = cli(run, "job", "start", "--name", "train1", "--kind", "train", "--json", "--", PY, "-c", leader)
        assert started.returncode == 0, started.stderr
        job = json.loads(started.stdout)
        twin, child_pid, grand_pid = (read_pid(marks / name) for name in ("twin", "child", "grandchild"))
        assert procs.cmdline_args(twin) == procs.cmdline_args(decoy.pid)
        ours = {job["pid"]: "leader", twin: "group", child_pid: "group", grand_pid: "descendant"}
        starts = {pid: procs.start_time(pid) for pid in ours}

        stopped = cli(run, "job", "stop", "--all", "--grace", "10", "--json")
        assert stopped.returncode == 0, stopped.stderr
        verdicts = {v["pid"]: v for v in json.loads(stopped.stdout)["verdicts"]}
        assert set(verdicts) == set(ours)
        for pid, role in ours.items():
            assert verdicts[pid]["role"] == role
            assert verdicts[pid]["outcome"] in ("exited_on_term", "killed")
            assert not procs.is_alive(pid, starts[pid]), f"{role} {pid} survived"
        assert decoy.poll() is None and procs.is_alive(decoy.pid), "the decoy was signalled"
        listed = json.loads(cli(run, "job", "list", "--json").stdout)
        assert [(j["name"], j["state"], j["exit_code"]) for j in listed] == [("train1", "stopped", -signal.SIGTERM)]
    finally:
        decoy.kill()
        decoy.wait()
        JobRegistry(run).stop(all_jobs=True, grace=1)


def test_record_whose_pid_is_another_program_is_stale_and_never_signalled(registry, tmp_path):
    info = registry.start_job("old", "train", [PY, "-c", SLEEPER])
    real_start = info.start_time_ticks
    try:
        with sqlite3.connect(registry.db_path) as db:
            db.execute("UPDATE jobs SET start_time_ticks = start_time_ticks - 1000 WHERE name = 'old'")
        (job,) = registry.list_records()
        assert job.info.state == "stale" and "another program" in job.detail
        plan = registry.stop_plan(all_jobs=True)
        assert plan.will_signal == [] and [s["pid"] for s in plan.stale] == [info.pid]
        assert plan.checkpoint_first is False
        stopped = cli(registry.run_dir, "job", "stop", "--all", "--grace", "1", "--json")
        assert stopped.returncode == 0, stopped.stderr
        assert [(v["pid"], v["outcome"]) for v in json.loads(stopped.stdout)["verdicts"]] == [(info.pid, "stale_not_signalled")]
        time.sleep(0.3)
        assert procs.is_alive(info.pid, real_start), "a stale record's PID was signalled"
    finally:
        os.killpg(info.pgid, signal.SIGKILL)


def test_trapped_sigterm_gets_its_grace_period(registry):
    code = (
        "import os, signal, sys, time\n"
        "def checkpoint(*_):\n"
        "    time.sleep(0.5)\n"
        "    open(os.path.join(os.environ['EAGLE3_JOB_DIR'], 'checkpointed'), 'w').write('ok')\n"
        "    sys.exit(0)\n"
        "signal.signal(signal.SIGTERM, checkpoint)\n"
        "print('ready', flush=True)\n"
        "time.sleep(600)\n"
    )
    info = registry.start_job("trap", "train", [PY, "-c", code])
    wait_for(lambda: "ready" in Path(info.stdout_path).read_text(), what="the handler to be installed")
    (verdict,) = registry.stop(["trap"], grace=10)
    assert (verdict.pid, verdict.role, verdict.outcome) == (info.pid, "leader", "exited_on_term")
    assert (Path(info.job_dir) / "checkpointed").read_text() == "ok"
    job = registry.get("trap").info
    assert (job.state, job.exit_code) == ("stopped", 0)


def test_ignored_sigterm_is_killed_after_the_grace_period(registry):
    code = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('ready', flush=True); time.sleep(600)"
    info = registry.start_job("stubborn", "serve", [PY, "-c", code])
    wait_for(lambda: "ready" in Path(info.stdout_path).read_text(), what="SIGTERM to be ignored")
    began = time.monotonic()
    (verdict,) = registry.stop(["stubborn"], grace=1)
    assert time.monotonic() - began >= 1.0
    assert (verdict.pid, verdict.outcome) == (info.pid, "killed")
    job = registry.get("stubborn").info
    assert (job.state, job.exit_code) == ("stopped", -signal.SIGKILL)


def test_stop_plan_lists_exact_pids_and_signals_nothing(registry, tmp_path):
    mark = tmp_path / "child"
    code = (
        f"import subprocess, sys, time; p = subprocess.Popen([sys.executable, '-c', {SLEEPER!r}]); open({str(mark)!r}, 'w').write(str(p.pid)); time.sleep(600)"
    )
    train = registry.start_job("t", "train", [PY, "-c", code])
    other = registry.start_job("o", "bench", [PY, "-c", SLEEPER])
    child = read_pid(mark)
    plan = registry.stop_plan(all_jobs=True)
    assert plan.jobs == ["t", "o"] and plan.checkpoint_first is True
    assert sorted((w["pid"], w["job"], w["role"]) for w in plan.will_signal) == sorted(
        [(train.pid, "t", "leader"), (child, "t", "group"), (other.pid, "o", "leader")]
    )
    assert registry.stop_plan(["o"]).checkpoint_first is False
    assert all(procs.is_alive(pid) for pid in (train.pid, child, other.pid))
    with pytest.raises(JobNotFound):
        registry.stop_plan(["nope"])


def test_exit_code_is_known_after_the_starter_died(tmp_path):
    run = tmp_path / "run"
    started = cli(run, "job", "start", "--name", "short", "--", "sh", "-c", "sleep 0.3; echo done; exit 7")
    assert started.returncode == 0, started.stderr  # the starting process has exited: the job is nobody's child now
    registry = JobRegistry(run)
    job = wait_for(lambda: next((j for j in registry.list_jobs() if j.state != "running"), None), what="the job to end")
    assert (job.state, job.exit_code) == ("exited", 7)
    assert Path(job.stdout_path).read_text() == "done\n"


def test_orphans_stay_in_the_job_tree_and_are_stopped(registry, tmp_path):
    mark = tmp_path / "orphan"
    orphan = f"import os, time; os.setsid(); open({str(mark)!r}, 'w').write(str(os.getpid())); time.sleep(600)"
    info = registry.start_job("daemonizer", "serve", [PY, "-c", f"import subprocess, sys; subprocess.Popen([sys.executable, '-c', {orphan!r}])"])
    orphan_pid = read_pid(mark)
    job = wait_for(lambda: registry.get("daemonizer").info.state == "exited" and registry.get("daemonizer"), what="the leader to exit")
    assert job.info.exit_code == 0
    assert procs.ppid_of(orphan_pid) == job.watcher_pid  # the watcher is a subreaper: the orphan did not go to init
    plan = registry.stop_plan(["daemonizer"])
    assert [(w["pid"], w["role"]) for w in plan.will_signal] == [(orphan_pid, "descendant")]
    with pytest.raises(JobConflict, match="still run"):
        registry.start_job("daemonizer", "serve", [PY, "-c", "pass"])
    (verdict,) = registry.stop(["daemonizer"], grace=5)
    assert (verdict.pid, verdict.outcome) == (orphan_pid, "exited_on_term")
    assert registry.get("daemonizer").info.state == "exited"
    assert info.pid not in procs.list_pids() or not procs.is_alive(info.pid, info.start_time_ticks)


def test_a_job_started_by_another_job_is_not_part_of_it(registry):
    starter = f"import subprocess, sys, time; subprocess.run([sys.executable, '-m', 'backend', 'job', 'start', '--name', 'sub', '--', sys.executable, '-c', {SLEEPER!r}], check=True); time.sleep(600)"
    chain = registry.start_job("chain", "chain", [PY, "-c", starter])
    sub = wait_for(lambda: next((r for r in registry.list_records() if r.name == "sub" and r.info.state == "running"), None), timeout=30, what="the sub-job")
    chain_watcher = registry.get("chain").watcher_pid
    # The CLI that started it has exited, so the sub-job's watcher now hangs under the chain's subreaper watcher.
    wait_for(lambda: procs.ppid_of(sub.watcher_pid) == chain_watcher, what="re-parenting to the chain watcher")
    assert registry.owned_pids([sub.info.pid])[sub.info.pid] == "sub"
    assert [w["pid"] for w in registry.stop_plan(["chain"]).will_signal] == [chain.pid]
    registry.stop(["chain"], grace=5)
    assert procs.is_alive(sub.info.pid, sub.info.start_time_ticks) and procs.is_alive(sub.watcher_pid, sub.watcher_start)
    registry.stop(["sub"], grace=5)
    assert registry.get("sub").info.exit_code == -signal.SIGTERM  # its watcher survived to record it


def test_names_conflict_while_running_and_are_reused_after(registry):
    registry.start_job("busy", "other", [PY, "-c", SLEEPER])
    with pytest.raises(JobConflict, match="running"):
        registry.start_job("busy", "other", [PY, "-c", SLEEPER])
    first = registry.start_job("again", "other", ["sh", "-c", "echo first"])
    wait_for(lambda: registry.get("again").info.state == "exited", what="the first run to end")
    second = registry.start_job("again", "other", ["sh", "-c", "echo second"])
    archived = [p for p in Path(first.job_dir).parent.iterdir() if p.name.startswith("again.")]
    assert len(archived) == 1 and (archived[0] / "stdout.log").read_text() == "first\n"  # archived, never deleted
    assert second.job_dir == first.job_dir and second.pid != first.pid
    with sqlite3.connect(registry.db_path) as db:
        rows = db.execute("SELECT archived, job_dir FROM jobs WHERE name = 'again' ORDER BY id").fetchall()
    assert rows == [(1, str(archived[0])), (0, first.job_dir)]


def test_concurrent_starts_of_one_name_let_exactly_one_win(tmp_path):
    run = tmp_path / "run"
    JobRegistry(run)
    command = [PY, "-m", "backend", "job", "start", "--run-dir", str(run), "--name", "same", "--", PY, "-c", SLEEPER]
    racers = [subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(3)]
    try:
        codes = sorted(racer.wait(timeout=90) for racer in racers)
        assert codes == [0, 1, 1], [racer.stderr.read() for racer in racers]
    finally:
        JobRegistry(run).stop(all_jobs=True, grace=1)


def test_job_environment_and_eagle3_host_argv(registry, tmp_path):
    keys = ["EAGLE3_JOB_DIR", "EAGLE3_RUN_DIR", "EAGLE3_JOB_NAME", "PYTHONPATH", "EAGLE3_JOB_TOKEN", "EXTRA"]
    show = f"import json, os; print(json.dumps({{k: os.environ.get(k) for k in {keys!r}}}))"
    info = registry.start_job("env", "other", [PY, "-c", show], cwd=str(tmp_path), env={"EXTRA": "1"})
    wait_for(lambda: registry.get("env").info.state == "exited", what="env job")
    seen = json.loads(Path(info.stdout_path).read_text())
    assert seen["EAGLE3_JOB_DIR"] == info.job_dir and seen["EAGLE3_RUN_DIR"] == str(registry.run_dir)
    assert seen["EAGLE3_JOB_NAME"] == "env" and seen["EXTRA"] == "1" and len(seen["EAGLE3_JOB_TOKEN"]) == 32
    assert seen["PYTHONPATH"].split(os.pathsep)[0] == str(ROOT)
    host = registry.start_job("host", "other", ["eagle3-host", "gpus", "--json"], cwd=str(tmp_path))
    assert host.argv[:4] == [PY, "-P", "-m", "backend"]  # -P: the cwd never comes first on sys.path
    done = wait_for(lambda: registry.get("host").info.state == "exited" and registry.get("host").info, what="eagle3-host job")
    assert done.exit_code == 0, Path(done.stderr_path).read_text()
    assert "gpus" in json.loads(Path(done.stdout_path).read_text())


def test_adopt_needs_the_pid_typed_again(registry):
    stranger = subprocess.Popen([PY, "-c", SLEEPER], start_new_session=True)
    try:
        with pytest.raises(JobRefused, match="does not match"):
            registry.adopt(stranger.pid, "mine", confirm_pid=stranger.pid + 1)
        assert registry.list_jobs() == []
        info = registry.adopt(stranger.pid, "mine", confirm_pid=stranger.pid)
        assert (info.kind, info.adopted, info.pid, info.pgid) == ("adopted", True, stranger.pid, stranger.pid)
        with pytest.raises(JobConflict, match="already belongs"):
            registry.adopt(stranger.pid, "twice", confirm_pid=stranger.pid)
        with pytest.raises(JobRefused):
            registry.adopt(os.getpid(), "me", confirm_pid=os.getpid())
        (verdict,) = registry.stop(["mine"], grace=5)
        assert verdict.outcome == "exited_on_term"
        assert stranger.wait(timeout=10) == -signal.SIGTERM
        assert registry.get("mine").info.state == "stopped"
    finally:
        stranger.kill()
        stranger.wait()


def test_bad_start_parameters_leave_nothing_behind(registry):
    with pytest.raises(JobBadParams, match="name"):
        registry.start_job("../escape", "other", ["true"])
    with pytest.raises(JobBadParams, match="kind"):
        registry.start_job("k", "adopted", ["true"])
    with pytest.raises(JobBadParams, match="not found on PATH"):
        registry.start_job("missing", "other", ["no-such-program-eagle3"])
    with pytest.raises(JobBadParams, match="cwd"):
        registry.start_job("cwd", "other", ["true"], cwd="/no/such/dir")
    assert registry.list_jobs() == [] and list(registry.jobs_dir.iterdir()) == []
    with pytest.raises(JobError):
        registry.get("missing")


class ReplayGpu:
    """Stands in for the absent GPU: lists `pid` as a compute process while it runs, or forever when `sticky`."""

    name = "nvidia-smi"

    def __init__(self, pid: int, sticky: bool):
        self.pid, self.sticky = pid, sticky

    def sample(self) -> list[GpuSample]:
        holding = self.sticky or procs.is_alive(self.pid)
        return [GpuSample(0, "NVIDIA H200", processes=[GpuProcess(self.pid, 21446.0)] if holding else [])]


@pytest.mark.parametrize("sticky", [False, True])
def test_stop_confirms_gpu_memory_is_released(registry, sticky):
    info = registry.start_job("gpu", "train", [PY, "-c", SLEEPER])
    (verdict,) = registry.stop(["gpu"], grace=5, gpu_source=ReplayGpu(info.pid, sticky), gpu_release_timeout=0.5)
    assert verdict.outcome == "exited_on_term"
    if sticky:
        assert "GPU memory NOT released after 0.5s (21446.0 MiB still listed)" in verdict.detail
    else:
        assert verdict.detail.endswith("; GPU memory released")


def test_tail_lines_is_bounded_and_treats_carriage_returns_as_line_ends(tmp_path):
    from backend.jobs.logs import TAIL_LINE_SHOWN, tail_lines

    log = tmp_path / "progress.log"
    with open(log, "wb") as handle:
        handle.write(b"start\n")
        for i in range(200_000):  # a progress bar redrawn with \r: 3 MB, one "line" to a \n reader
            handle.write(f"\r{i:>8} it".encode())
        handle.write(b"\n" + b"x" * (3 << 20) + b"\ndone\n")
    started = time.monotonic()
    lines = tail_lines(log, 3)
    assert time.monotonic() - started < 5
    assert lines[-1] == "done" and lines[-2].startswith("x" * 100) and lines[-2].endswith(f"({3 << 20} characters)")
    assert len(lines[-2]) < TAIL_LINE_SHOWN + 40 and lines[-3] == "  199999 it"
    assert tail_lines(log, 5, max_bytes=1 << 20)[-1] == "done"  # a capped read still ends at the end


def test_an_older_jobs_db_gains_the_node_columns_and_keeps_its_records(tmp_path):
    """A jobs.db written before multi-node jobs: opened, migrated in place, its records listed with no node."""
    from backend.jobs.registry import SCHEMA

    old_schema = SCHEMA
    for column in ("run_id TEXT", "node_rank INTEGER", "nnodes INTEGER", "rdzv_endpoint TEXT", "cgroup TEXT"):
        old_schema = old_schema.replace(f",\n    {column}", "")
    assert "run_id" not in old_schema and "cgroup" not in old_schema
    tmp_path.mkdir(exist_ok=True)
    with sqlite3.connect(tmp_path / "jobs.db") as conn:
        conn.executescript(old_schema)
        conn.execute(
            "INSERT INTO jobs (name, kind, state, argv, job_dir, stdout_path, stderr_path, started_at, exit_code, ended_at)"
            " VALUES ('old', 'train', 'exited', '[\"true\"]', ?, ?, ?, 1.0, 0, 2.0)",
            (str(tmp_path / "jobs" / "old"), str(tmp_path / "o.log"), str(tmp_path / "e.log")),
        )
    registry = JobRegistry(tmp_path)
    (old,) = registry.list_jobs()
    assert (old.name, old.state, old.run_id, old.node_rank, old.nnodes, old.rdzv_endpoint) == ("old", "exited", None, None, None, None)
    columns = {row[1] for row in sqlite3.connect(tmp_path / "jobs.db").execute("PRAGMA table_info(jobs)")}
    assert {"run_id", "node_rank", "nnodes", "rdzv_endpoint", "cgroup"} <= columns
    node = {"run_id": "r1", "node_rank": 0, "nnodes": 2, "rdzv_endpoint": "127.0.0.1:29400"}
    info = registry.start_job("node0", "other", [sys.executable, "-c", "pass"], node=node)
    assert (info.run_id, info.node_rank, info.nnodes, info.rdzv_endpoint) == ("r1", 0, 2, "127.0.0.1:29400")
    assert JobRegistry(tmp_path).get("node0").info.run_id == "r1"  # a fresh registry reads it back
