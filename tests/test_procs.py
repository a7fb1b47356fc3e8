"""/proc helpers: stat parsing after the last ')', identity by start time, trees that survive setsid, owners, signalling by identity."""
import os
import pwd
import signal
import subprocess
import sys
import time

from backend import procs


def test_parse_stat_with_hostile_comm():
    line = "4242 (evil) (name with) spaces) S 17 4242 4242 0 -1 4194560 " + " ".join(["0"] * 12) + " 987654 123 456\n"  # fields 10-21, then 22
    stat = procs.parse_stat(line)
    assert (stat.pid, stat.comm, stat.state, stat.ppid, stat.pgid, stat.sid) == (4242, "evil) (name with) spaces", "S", 17, 4242, 4242)
    assert stat.start_time == 987654


def test_own_process():
    me = procs.read_stat(os.getpid())
    assert (me.ppid, me.pgid, me.sid) == (os.getppid(), os.getpgrp(), os.getsid(0))
    assert procs.identity(os.getpid()) == (os.getpid(), me.start_time)
    assert procs.uid_of(os.getpid()) == os.getuid()
    assert procs.user_of(os.getpid()) == pwd.getpwuid(os.getuid()).pw_name
    assert os.getpid() in procs.list_pids()
    assert os.getppid() in procs.ancestors(os.getpid())


def test_identity_and_zombies():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"], env={**os.environ, "MARK": "v1"})
    try:
        start = procs.start_time(child.pid)
        assert procs.is_alive(child.pid, start)
        assert not procs.is_alive(child.pid, start + 1)  # same pid, other start time: another program
        assert procs.cmdline_args(child.pid)[-1] == "import time; time.sleep(30)"
        assert procs.environ_value(child.pid, "MARK") == "v1"
        assert procs.pgid_of(child.pid) == os.getpgrp() and procs.ppid_of(child.pid) == os.getpid()
        child.kill()
        deadline = time.monotonic() + 10
        while procs.read_stat(child.pid).state != "Z" and time.monotonic() < deadline:
            time.sleep(0.01)
        assert procs.read_stat(child.pid).state == "Z"  # not reaped yet: /proc still lists it
        assert not procs.is_alive(child.pid, start) and procs.identity(child.pid) is None
    finally:
        child.kill()
        child.wait()
    assert procs.read_stat(child.pid) is None or procs.read_stat(child.pid).start_time != start


def test_descendants_include_a_grandchild_that_called_setsid(tmp_path):
    pids_file = tmp_path / "pids"
    grandchild = f"import os, time; os.setsid(); open({str(pids_file)!r}, 'w').write(str(os.getpid())); time.sleep(30)"
    code = f"import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', {grandchild!r}]); time.sleep(30)"
    child = subprocess.Popen([sys.executable, "-c", code], start_new_session=True)
    try:
        deadline = time.monotonic() + 20
        while not (pids_file.exists() and pids_file.read_text()):
            assert time.monotonic() < deadline
            time.sleep(0.02)
        grand = int(pids_file.read_text())
        table = procs.ProcTable.scan()
        assert table.descendants(child.pid) == [grand]
        assert table.stats[grand].sid == grand != table.stats[child.pid].sid  # left the session, still a descendant
        assert child.pid in table.group(child.pid) and grand not in table.group(child.pid)
        assert procs.descendants(os.getpid()).count(grand) == 1
    finally:
        os.killpg(child.pid, signal.SIGKILL)
        if "grand" in locals():
            os.kill(grand, signal.SIGKILL)
        child.wait()


def test_send_signal_checks_identity():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        start = procs.start_time(child.pid)
        assert procs.send_signal(child.pid, start + 5, signal.SIGKILL) is False
        time.sleep(0.1)
        assert procs.is_alive(child.pid, start)
        assert procs.send_signal(child.pid, start, signal.SIGKILL) is True
        assert child.wait(timeout=10) == -signal.SIGKILL
        assert procs.send_signal(child.pid, start, signal.SIGKILL) is False
    finally:
        child.kill()
        child.wait()
