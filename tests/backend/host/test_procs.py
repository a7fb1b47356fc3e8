"""/proc helpers: stat parsing after the last ')', identity by start time, trees that survive setsid, owners, signalling by identity."""

import os
import pwd
import signal
import subprocess
import sys
import time

from backend.host import procs


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
        deadline = time.monotonic() + 10
        while procs.cmdline_args(child.pid)[-1:] != ["import time; time.sleep(30)"] and time.monotonic() < deadline:
            time.sleep(0.01)  # between fork and exec the child still shows our argv
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


def test_kernel_threads_and_init_are_told_apart():
    assert procs.read_stat(2).kernel_thread  # kthreadd
    assert not procs.read_stat(os.getpid()).kernel_thread and not procs.read_stat(1).kernel_thread
    line = "77 (x) S 2 0 0 0 -1 2129984 " + " ".join(["0"] * 12) + " 5 0 0\n"
    assert procs.parse_stat(line).flags & procs.PF_KTHREAD


def test_freeze_stops_a_forking_tree_until_nothing_new_appears():
    code = "import os, time\nfor _ in range(200):\n    if os.fork() == 0:\n        time.sleep(60); os._exit(0)\n    time.sleep(0.005)\ntime.sleep(60)"
    root = subprocess.Popen([sys.executable, "-c", code], start_new_session=True)
    try:
        time.sleep(0.3)

        def tree() -> dict[int, int]:
            table = procs.ProcTable.scan()
            return {pid: table.stats[pid].start_time for pid in [root.pid, *table.descendants(root.pid)] if table.alive(pid)}

        seen, settled = procs.freeze(tree, timeout=5)
        assert settled and root.pid in seen
        time.sleep(0.2)
        assert tree() == {pid: start for pid, start in seen.items() if procs.is_alive(pid, start)}  # nothing forked after
        assert all(procs.read_stat(pid).stopped for pid in tree())
    finally:
        os.killpg(root.pid, signal.SIGKILL)
        root.wait()


def test_a_job_cgroup_is_frozen_and_killed_as_one(tmp_path, monkeypatch):
    monkeypatch.delenv(procs.CGROUPS_ENV, raising=False)
    cgroup = procs.create_job_cgroup(f"test-{os.getpid()}")
    if cgroup is None:
        import pytest

        pytest.skip("no writable cgroup v2 with cgroup.kill on this host")
    try:
        child = subprocess.Popen(
            [sys.executable, "-c", "import os, time; os.fork(); time.sleep(60)"], preexec_fn=lambda: procs.enter_cgroup(cgroup), start_new_session=True
        )
        deadline = time.monotonic() + 10
        while len(procs.cgroup_pids(cgroup)) < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert child.pid in procs.cgroup_pids(cgroup) and procs.is_job_cgroup(cgroup) and procs.cgroup_populated(cgroup)
        assert procs.cgroup_freeze(cgroup) and procs.cgroup_kill(cgroup)
        assert child.wait(10) == -signal.SIGKILL and procs.cgroup_pids(cgroup) == []
    finally:
        procs.cgroup_kill(cgroup)
        assert procs.remove_cgroup(cgroup) and not cgroup.exists()
