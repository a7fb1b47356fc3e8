"""The stop as a guarantee: adversarial trees, a stopper inside the job, full disks, bad numbers, races, adopt refusals, file modes."""

import json
import os
import resource
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from backend.host import procs
from backend.jobs.records import JOB_TOKEN_ENV, JobBadParams, JobRefused
from backend.jobs.registry import JobRegistry
from tests.fixtures.waiting import wait_for
from tests.fixtures.env import ROOT

PY = sys.executable
SLEEPER = "import time; time.sleep(600)"
IGNORE_TERM = "import signal; signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"


def cli(run_dir: Path, *args: str, timeout: float = 90, **popen) -> subprocess.CompletedProcess:
    command = [PY, "-m", "backend", "job", args[0], "--run-dir", str(run_dir), *args[1:]]
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=timeout, **popen)


def token_holders(token: str) -> list[int]:
    """Every live process started with this job token: what a stop must leave at zero."""
    return [pid for pid in procs.list_pids() if procs.is_alive(pid) and procs.environ_value(pid, JOB_TOKEN_ENV) == token]


@pytest.fixture(params=["cgroup", "walk"])
def mode(request, monkeypatch):
    """Both stop paths: the job cgroup (where this host allows one) and the SIGSTOP walk."""
    monkeypatch.setenv("EAGLE3_CGROUPS", "1" if request.param == "cgroup" else "0")
    return request.param


@pytest.fixture
def registry(tmp_path):
    reg = JobRegistry(tmp_path / "run")
    yield reg
    reg.stop(all_jobs=True, grace=0)


def test_the_job_gets_its_own_cgroup_where_the_host_allows_it(registry, mode):
    info = registry.start_job("cg", "other", [PY, "-c", SLEEPER])
    record = registry.get("cg")
    if mode == "walk" or procs.job_cgroup_base() is None:
        assert record.cgroup is None
        return
    assert procs.is_job_cgroup(record.cgroup) and procs.cgroup_pids(record.cgroup) == [info.pid]
    assert record.watcher_pid not in procs.cgroup_pids(record.cgroup)  # the watcher outlives the cgroup's kill
    registry.stop(["cg"], grace=5)
    assert not Path(record.cgroup).exists()


def test_sigterm_ignoring_setsid_reforkers_leave_no_survivor(registry, mode):
    # Only the leader re-forks (bounded): every child double-forks a setsid grandchild that ignores SIGTERM and sleeps.
    reforker = IGNORE_TERM + (
        "import os, time\n"
        "for _ in range(400):\n"
        "    if os.fork() == 0:\n"
        "        os.setsid()\n"
        "        if os.fork() > 0:\n"
        "            os._exit(0)\n"
        "        time.sleep(600)\n"
        "        os._exit(0)\n"
        "    time.sleep(0.02)\n"
        "time.sleep(600)\n"
    )
    registry.start_job("forker", "other", [PY, "-c", reforker])
    token = registry.get("forker").token
    wait_for(lambda: len(token_holders(token)) > 20, what="the tree to grow")
    verdicts = registry.stop(["forker"], grace=0.3, kill_wait=5)
    assert token_holders(token) == []
    assert [v for v in verdicts if v.outcome == "survived"] == []
    assert {v.outcome for v in verdicts} <= {"killed", "already_gone", "exited_on_term"}
    assert registry.get("forker").info.state == "stopped"


def test_a_stop_run_inside_the_job_spares_itself_and_its_parents_and_kills_the_rest(tmp_path, mode):
    run = tmp_path / "run"
    report = tmp_path / "report.json"
    stubborn = IGNORE_TERM + SLEEPER
    leader = (
        "import json, subprocess, sys, time\n"
        f"child = subprocess.Popen([sys.executable, '-c', {stubborn!r}])\n"
        "time.sleep(0.5)\n"
        f"done = subprocess.run([sys.executable, '-m', 'backend', 'job', 'stop', '--run-dir', {str(run)!r}, '--name', 'self', '--grace', '0.5', '--json'],"
        " capture_output=True, text=True)\n"
        f"open({str(report)!r}, 'w').write(json.dumps({{'rc': done.returncode, 'out': done.stdout, 'err': done.stderr, 'child': child.pid}}))\n"
        "time.sleep(600)\n"
    )
    registry = JobRegistry(run)
    try:
        info = registry.start_job("self", "other", [PY, "-c", leader], cwd=str(ROOT))
        result = json.loads(wait_for(lambda: report.exists() and report.read_text(), timeout=60, what="the inside stop"))
        assert result["rc"] == 1, result["err"]
        verdicts = {v["pid"]: v for v in json.loads(result["out"])["verdicts"]}
        assert verdicts[result["child"]]["outcome"] == "killed"  # SIGKILL followed: the stopper did not kill itself
        assert verdicts[info.pid]["outcome"] == "survived" and "NOT signalled" in verdicts[info.pid]["detail"]
        assert str(info.pid) in result["err"]
        assert procs.is_alive(info.pid, info.start_time_ticks) and not procs.is_alive(result["child"])
        job = registry.get("self")
        assert job.info.state == "running" and "stop incomplete" in job.detail  # never "stopped" while its leader runs
    finally:
        registry.stop(["self"], grace=0)
    assert not procs.is_alive(info.pid, info.start_time_ticks)


def test_a_group_signal_never_reaches_a_stopper_in_the_group(registry, mode, tmp_path, monkeypatch):
    """killpg would hit the stopping process itself: the members are signalled one by one instead."""
    mark = tmp_path / "member"
    code = (
        f"import subprocess, sys, time; p = subprocess.Popen([sys.executable, '-c', {SLEEPER!r}]); open({str(mark)!r}, 'w').write(str(p.pid)); time.sleep(600)"
    )
    info = registry.start_job("grp", "other", [PY, "-c", code])
    member = int(wait_for(lambda: mark.exists() and mark.read_text(), what="the group member"))
    member_start = procs.start_time(member)
    from backend.jobs import discovery

    real = discovery.protected_pids
    monkeypatch.setattr(discovery, "protected_pids", lambda: real() | {member})  # as if that member ran this stop
    verdicts = {v.pid: v for v in registry.stop(["grp"], grace=2)}
    assert procs.is_alive(member, member_start), "the stopper was signalled"
    assert verdicts[info.pid].outcome == "exited_on_term" and verdicts[member].outcome == "survived"
    monkeypatch.setattr(discovery, "protected_pids", real)
    registry.stop(["grp"], grace=0)
    assert not procs.is_alive(member, member_start)


def test_adopt_refuses_kernel_threads_init_itself_its_ancestors_and_other_users(registry, tmp_path):
    for pid, why in [(2, "kernel thread"), (1, "init"), (os.getpid(), "this tool"), (os.getppid(), "this tool")]:
        with pytest.raises(JobRefused, match=why):
            registry.adopt(pid, "nope", confirm_pid=pid)
    kthread = next(pid for pid in procs.list_pids() if pid > 2 and procs.read_stat(pid) and procs.read_stat(pid).kernel_thread)
    with pytest.raises(JobRefused, match="kernel thread"):
        registry.adopt(kthread, "nope", confirm_pid=kthread)
    assert registry.list_jobs() == []
    refused = cli(registry.run_dir, "adopt", "2", "--name", "k", "--yes")
    assert refused.returncode == 1 and "kernel thread" in refused.stderr and "Nothing was adopted" in refused.stderr
    if os.getuid() != 0:
        return
    stranger = subprocess.Popen(["sleep", "600"], user=65534, start_new_session=True, cwd="/")
    try:
        wait_for(lambda: procs.uid_of(stranger.pid) == 65534, what="the other user's process")
        with pytest.raises(JobRefused, match="--other-user"):
            registry.adopt(stranger.pid, "theirs", confirm_pid=stranger.pid)
        assert cli(registry.run_dir, "adopt", str(stranger.pid), "--name", "theirs", "--yes").returncode == 1
        adopted = cli(registry.run_dir, "adopt", str(stranger.pid), "--name", "theirs", "--yes", "--other-user")
        assert adopted.returncode == 0, adopted.stderr
        (verdict,) = registry.stop(["theirs"], grace=5)
        assert verdict.outcome == "exited_on_term"
    finally:
        stranger.kill()
        stranger.wait()


def test_an_old_record_of_a_kernel_thread_signals_nothing(registry):
    with sqlite3.connect(registry.db_path) as db:
        stat = procs.read_stat(2)
        db.execute(
            "INSERT INTO jobs (name, kind, state, pid, pgid, start_time_ticks, argv, job_dir, stdout_path, stderr_path, started_at, adopted)"
            " VALUES ('kt', 'adopted', 'running', 2, 0, ?, '[]', '/nonexistent', '-', '-', ?, 1)",
            (stat.start_time, time.time()),
        )
    plan = registry.stop_plan(["kt"])
    assert plan.will_signal == []
    assert registry.stop(["kt"], grace=0) == []


@pytest.mark.parametrize("grace", [float("nan"), float("inf"), -1.0, 1e9])
def test_non_finite_or_negative_grace_is_refused_before_any_signal(registry, grace):
    info = registry.start_job("g", "other", [PY, "-c", SLEEPER])
    with pytest.raises(JobBadParams, match="grace"):
        registry.stop(["g"], grace=grace)
    done = cli(registry.run_dir, "stop", "--name", "g", "--grace", str(grace))
    assert done.returncode == 2 and "grace" in done.stderr and "nothing was signalled" in done.stderr
    assert procs.is_alive(info.pid, info.start_time_ticks)


def test_concurrent_stops_send_sigterm_once(registry, tmp_path):
    marks = tmp_path / "terms"
    code = (
        "import signal, sys, time\n"
        f"def term(*_):\n    open({str(marks)!r}, 'a').write('TERM\\n')\n    time.sleep(1.0)\n    sys.exit(0)\n"
        "signal.signal(signal.SIGTERM, term)\nprint('ready', flush=True)\ntime.sleep(600)\n"
    )
    info = registry.start_job("once", "train", [PY, "-c", code])
    wait_for(lambda: "ready" in Path(info.stdout_path).read_text(), what="the handler")
    racers = [
        subprocess.Popen(
            [PY, "-m", "backend", "job", "stop", "--run-dir", str(registry.run_dir), "--name", "once", "--grace", "10"],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    threads = [threading.Thread(target=registry.stop, args=(["once"],), kwargs={"grace": 10}) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert [racer.wait(60) for racer in racers] == [0, 0], [racer.stderr.read() for racer in racers]
    assert marks.read_text() == "TERM\n"
    assert registry.get("once").info.state == "stopped"


def test_nul_bytes_in_env_or_argv_are_refused_before_anything_is_recorded(registry):
    for env in ({"A": "x\0y"}, {"A\0B": "x"}, {"A=B": "x"}, {"": "x"}):
        with pytest.raises(JobBadParams, match="env"):
            registry.start_job("nul", "other", [PY, "-c", "pass"], env=env)
    with pytest.raises(JobBadParams, match="NUL"):
        registry.start_job("nul", "other", [PY, "-c", "pass\0"])
    assert registry.list_jobs() == [] and list(registry.jobs_dir.iterdir()) == []
    assert registry.start_job("nul", "other", [PY, "-c", "pass"], env={"A": "ok"}).name == "nul"


def test_jobs_db_and_job_dirs_are_private(registry, tmp_path):
    info = registry.start_job("secret", "other", [PY, "-c", "print('token')"])
    wait_for(lambda: registry.get("secret").info.state == "exited", what="the job to end")
    mode = lambda path: Path(path).stat().st_mode & 0o777
    assert mode(registry.db_path) == 0o600 and mode(registry.jobs_dir) == 0o700 and mode(info.job_dir) == 0o700
    assert {p.name: mode(p) for p in Path(info.job_dir).iterdir()} == dict.fromkeys(
        ["stdout.log", "stderr.log", "watcher.log", "leader.json", "exit_code", "stop_request"], 0o600
    )
    old = tmp_path / "old"
    old.mkdir()
    sqlite3.connect(old / "jobs.db").close()
    os.chmod(old / "jobs.db", 0o644)
    JobRegistry(old)
    assert mode(old / "jobs.db") == 0o600  # an existing world-readable one is tightened


def _full_disk(path: Path):
    """A 1 MiB tmpfs at path (root), or None where mounting is not allowed."""
    path.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(path)], capture_output=True)
    return done.returncode == 0


def _fill(path: Path) -> None:
    fd = os.open(path / "filler", os.O_WRONLY | os.O_CREAT)
    try:
        while os.write(fd, b"\0" * 4096):
            pass
    except OSError:
        pass
    finally:
        os.close(fd)
    assert os.statvfs(path).f_bavail == 0


def _no_file_growth():
    """Fallback when tmpfs cannot be mounted: every write that grows a file fails with EFBIG (a real failing write)."""
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (0, 0))


def test_stop_on_a_full_disk_signals_first_and_reports_what_was_not_recorded(tmp_path):
    disk = tmp_path / "disk"
    mounted = _full_disk(disk)
    run = disk / "run"
    registry = JobRegistry(run)
    try:
        info = registry.start_job("filler", "other", [PY, "-c", IGNORE_TERM + "print('ready', flush=True)\n" + SLEEPER])
        wait_for(lambda: "ready" in Path(info.stdout_path).read_text(), what="SIGTERM to be ignored")
        registry.close()
        if mounted:
            _fill(disk)
        limits = {} if mounted else {"preexec_fn": _no_file_growth}
        listed = cli(run, "list", "--json", **limits)
        assert listed.returncode == 0, listed.stderr
        stopped = cli(run, "stop", "--name", "filler", "--grace", "0.5", "--json", **limits)
        assert stopped.returncode == 0, stopped.stderr
        result = json.loads(stopped.stdout)
        assert [(v["pid"], v["outcome"]) for v in result["verdicts"]] == [(info.pid, "killed")]
        assert result["unrecorded"] and "NOT recorded in jobs.db" in result["verdicts"][0]["detail"]
        assert "not recorded" in stopped.stderr
        assert not procs.is_alive(info.pid, info.start_time_ticks)
    finally:
        JobRegistry(run).stop(all_jobs=True, grace=0)
        if mounted:
            subprocess.run(["umount", "-l", str(disk)], check=False)


@pytest.mark.slow
def test_stress_stop_ci_sized():
    done = subprocess.run([PY, "benchmarks/stress_stop.py", "--trials", "20", "--seed", "11"], cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "foreign signalled 0, owned left alive 0, stale signalled 0" in done.stdout
    assert "(escape errors 0)" in done.stdout
