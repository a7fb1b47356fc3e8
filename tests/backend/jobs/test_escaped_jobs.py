"""Jobs that try to escape the stop: they kill their watcher, double-fork, leave the job's group, session and cgroup,
and exec with a clean environment. What can still be proved is killed; what cannot is named, never signalled, and
the stop exits non-zero."""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from backend.host import procs
from backend.jobs.registry import JobRegistry
from tests.fixtures.waiting import wait_for
from tests.fixtures.env import ROOT

PY = sys.executable
MARK = "eagle3-escapee-marker"

# The escapee after its exec: logs every catchable signal it gets, so a test sees whether the stop touched it.
ESCAPEE = (
    "import signal, sys, time\n"
    "def note(signum, _):\n"
    "    open(sys.argv[-1], 'a').write(f'{signum}\\n')\n"
    "for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGCONT, signal.SIGUSR1):\n"
    "    signal.signal(s, note)\n"
    "while True:\n"
    "    time.sleep(3600)\n"
)

# The job's leader: a child kills the watcher (the subreaper), double-forks so the grandchild is re-parented to init,
# leaves the group (setpgid) or the session too (setsid), moves itself out of the job's cgroup, keeps or closes its
# stdio, and execs with every EAGLE3_* variable (the job token among them) dropped.
LEADER = r"""
import os, signal, sys, time
how, keep_stdio, escape_cgroup, ready, signals, leader_exits, mark = sys.argv[1:8]
watcher = os.getppid()
if os.fork() == 0:
    os.kill(watcher, signal.SIGKILL)
    def gone(pid):
        try:
            return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] in "ZX"
        except OSError:
            return True
    while not gone(watcher):
        time.sleep(0.01)
    middle = os.getpid()
    if os.fork():
        os._exit(0)
    while os.getppid() == middle:
        time.sleep(0.01)
    os.setsid() if how == "setsid" else os.setpgid(0, 0)
    if escape_cgroup != "-":
        try:
            with open(escape_cgroup, "w") as handle:
                handle.write(str(os.getpid()))
        except OSError:
            pass
    if keep_stdio != "1":
        null = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1, 2):
            os.dup2(null, fd)
    os.chdir("/")
    env = {k: v for k, v in os.environ.items() if not k.startswith("EAGLE3_")}
    with open(ready + ".tmp", "w") as handle:
        handle.write(str(os.getpid()))
    os.rename(ready + ".tmp", ready)
    os.execve(sys.executable, [mark, "-c", ESCAPEE, signals], env)  # argv[0] is the marker: the command line names it first
if leader_exits == "1":
    time.sleep(1.0)
    os._exit(0)
time.sleep(600)
""".replace("ESCAPEE", repr(ESCAPEE))


@pytest.fixture(autouse=True)
def no_escapee_outlives_its_test(tmp_path):
    """Whatever a failing test left: its escapee and leader (their command lines name the marker and this tmp_path)."""
    yield
    for pid in procs.list_pids():
        command = procs.cmdline(pid)
        if MARK in command and str(tmp_path) in command:  # the escapee, or a leader the test never got to stop
            procs.send_signal(pid, procs.start_time(pid) or 0, signal.SIGKILL)


@pytest.fixture(params=["cgroup", "walk"])
def mode(request, monkeypatch):
    monkeypatch.setenv("EAGLE3_CGROUPS", "1" if request.param == "cgroup" else "0")
    return request.param


def escape_target() -> str:
    """The cgroup.procs of this test's own cgroup: where the escapee moves to, out of the job's cgroup."""
    mount, own = procs.cgroup2_mount(), procs.cgroup_of(os.getpid())
    if mount is None or own is None:
        return "-"
    return str(mount.joinpath(*[part for part in own.split("/") if part], "cgroup.procs"))


def start_escaper(registry: JobRegistry, tmp_path: Path, how: str, keep_stdio: bool, leader_exits: bool = False) -> tuple[int, int, Path]:
    ready, signals = tmp_path / "escapee.pid", tmp_path / "escapee.signals"
    args = [how, "1" if keep_stdio else "0", escape_target(), str(ready), str(signals), "1" if leader_exits else "0", MARK]
    registry.start_job("esc", "other", [PY, "-c", LEADER, *args])
    pid = int(wait_for(lambda: ready.exists() and ready.read_text(), what="the escapee"))
    # argv[0] is the marker only after the exec (before it, the forked child's argv is the leader's, which holds the
    # marker as its last argument): under load the environment was read before the exec had happened
    wait_for(lambda: procs.cmdline_args(pid)[:1] == [MARK], what="the escapee's exec")
    assert procs.environ_value(pid, "EAGLE3_JOB_TOKEN") is None and procs.ppid_of(pid) != registry.get("esc").info.pid
    record = registry.get("esc")
    assert not procs.is_alive(record.watcher_pid, record.watcher_start)  # the watcher is dead
    if not leader_exits:
        assert record.info.state == "running" and f"watcher (PID {record.watcher_pid}) is gone" in record.detail  # and job list says so
    if record.cgroup:
        assert pid not in procs.cgroup_pids(record.cgroup)  # and the escapee is out of the job's cgroup
    return pid, procs.start_time(pid), signals


def cli_stop(run_dir: Path) -> subprocess.CompletedProcess:
    argv = [PY, "-m", "backend", "job", "stop", "--run-dir", str(run_dir), "--name", "esc", "--grace", "0.5", "--json"]
    return subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=90)


def end(pid: int, start: int) -> None:
    procs.send_signal(pid, start, signal.SIGKILL)


def test_an_escapee_still_in_the_jobs_session_is_proved_and_killed(tmp_path, mode):
    registry = JobRegistry(tmp_path / "run")
    pid, start, signals = start_escaper(registry, tmp_path, "setpgid", keep_stdio=False)
    try:
        assert procs.read_stat(pid).sid == registry.get("esc").info.pid
        record = registry.get("esc")
        done = cli_stop(registry.run_dir)
        verdicts = {v["pid"]: v for v in json.loads(done.stdout)["verdicts"]}
        assert verdicts[pid]["outcome"] in ("exited_on_term", "killed") and verdicts[pid]["role"] == "session"
        assert not procs.is_alive(pid, start)
        # everything found was ended, but with its watcher killed the stop cannot vouch for the rest: it says so, exit 1
        assert (verdicts[record.watcher_pid]["role"], verdicts[record.watcher_pid]["outcome"]) == ("watcher", "unverified")
        assert done.returncode == 1 and "cannot vouch" in done.stderr, done.stdout + done.stderr
    finally:
        end(pid, start)


@pytest.mark.parametrize("leader_exits", [False, True], ids=["leader-running", "record-stale"])
def test_an_escapee_beyond_proof_is_named_never_signalled_and_the_stop_fails(tmp_path, mode, leader_exits):
    registry = JobRegistry(tmp_path / "run")
    pid, start, signals = start_escaper(registry, tmp_path, "setsid", keep_stdio=True, leader_exits=leader_exits)
    log_reader = subprocess.Popen([PY, "-c", f"f = open({registry.get('esc').info.stdout_path!r}); import time; time.sleep(600)"])
    try:
        if leader_exits:
            wait_for(lambda: registry.get("esc").info.state == "stale", what="the record to go stale")
        done = cli_stop(registry.run_dir)
        assert done.returncode == 1, done.stdout + done.stderr
        verdicts = {v["pid"]: v for v in json.loads(done.stdout)["verdicts"]}
        assert verdicts[pid]["outcome"] == "survived" and verdicts[pid]["role"] == "unproven"
        assert "NOT signalled" in verdicts[pid]["detail"] and MARK in verdicts[pid]["detail"] and "stdout" in verdicts[pid]["detail"]
        assert str(pid) in done.stderr and "escaped" in done.stderr and MARK in done.stderr
        assert not any(line.startswith("def note") for line in done.stderr.splitlines())  # one line: its command's newlines shown as \x0a
        assert log_reader.pid not in verdicts  # a reader of the log is no trace: its stdio is not the log
        assert procs.is_alive(pid, start) and not signals.exists() and not procs.read_stat(pid).stopped  # never signalled
        assert procs.is_alive(log_reader.pid)
        if not leader_exits:
            assert "escaped the stop" in registry.get("esc").detail
    finally:
        end(pid, start)
        log_reader.kill()
        log_reader.wait()


def test_an_escapee_that_closed_everything_is_unnamed_but_the_stop_cannot_vouch_and_fails(tmp_path, mode):
    """Nothing ties it to the job any more: the stop cannot name it, but says that the watcher was killed and exits 1."""
    registry = JobRegistry(tmp_path / "run")
    pid, start, signals = start_escaper(registry, tmp_path, "setsid", keep_stdio=False)
    try:
        record = registry.get("esc")
        done = cli_stop(registry.run_dir)
        verdicts = {v["pid"]: v for v in json.loads(done.stdout)["verdicts"]}
        assert pid not in verdicts and procs.is_alive(pid, start) and not signals.exists()
        assert "could not be followed" in verdicts[record.info.pid]["detail"]
        assert verdicts[record.watcher_pid]["outcome"] == "unverified" and done.returncode == 1  # never a clean exit 0
        assert f"watcher PID {record.watcher_pid}" in done.stderr and "escaped" in registry.get("esc").detail
    finally:
        end(pid, start)


def test_an_adopted_session_leaders_orphaned_session_member_is_never_signalled(tmp_path):
    """An adopted process may lead a login shell's session: its session is no proof, only its tree and group are."""
    ready, signals = tmp_path / "orphan.pid", tmp_path / "orphan.signals"
    leader_code = (
        "import os, sys, time\n"
        "if os.fork() == 0:\n"
        "    if os.fork():\n"
        "        os._exit(0)\n"
        "    os.setpgid(0, 0)\n"  # still in the session, out of the group, re-parented away from the leader
        "    null = os.open(os.devnull, os.O_RDWR)\n"
        "    [os.dup2(null, fd) for fd in (0, 1, 2)]\n"
        f"    open({str(ready)!r}, 'w').write(str(os.getpid()))\n"
        f"    os.execv(sys.executable, [{MARK!r}, '-c', {ESCAPEE!r}, {str(signals)!r}])\n"
        "time.sleep(600)\n"
    )
    leader = subprocess.Popen([PY, "-c", leader_code], start_new_session=True)
    registry = JobRegistry(tmp_path / "run")
    orphan = start = 0
    try:
        orphan = int(wait_for(lambda: ready.exists() and ready.read_text(), what="the orphan"))
        wait_for(lambda: procs.cmdline_args(orphan)[:1] == [MARK], what="the orphan's exec")  # argv[0]: after the exec only
        start = procs.start_time(orphan)
        assert procs.read_stat(orphan).sid == leader.pid and procs.ppid_of(orphan) != leader.pid
        registry.adopt(leader.pid, "adopted", confirm_pid=leader.pid)
        verdicts = {v.pid: v for v in registry.stop(["adopted"], grace=0.5)}
        assert verdicts[leader.pid].outcome == "exited_on_term"
        assert procs.is_alive(orphan, start) and not signals.exists()  # never signalled
        assert verdicts[orphan].role == "unproven" and "session" in verdicts[orphan].detail  # but named: a trace, no proof
    finally:
        leader.kill()
        leader.wait()
        if orphan:
            end(orphan, start)


def test_a_stop_of_several_jobs_names_an_escapee_only_in_its_own_jobs_record(tmp_path):
    registry = JobRegistry(tmp_path / "run")
    pid, start, _ = start_escaper(registry, tmp_path, "setsid", keep_stdio=True)
    registry.start_job("plain", "other", [PY, "-c", f"import time; time.sleep(600)  # {MARK} {tmp_path}"])
    try:
        argv = [PY, "-m", "backend", "job", "stop", "--run-dir", str(registry.run_dir), "--all", "--grace", "0.5", "--json"]
        done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=90)
        assert done.returncode == 1, done.stdout + done.stderr  # the escapee survived, named
        assert f"PID {pid}" in registry.get("esc").detail
        plain = registry.get("plain")
        assert plain.info.state == "stopped" and str(pid) not in plain.detail and "escaped" not in plain.detail, plain.detail
    finally:
        end(pid, start)
