"""One truth in jobs.db across threads, registries and processes; a run dir another user could change is refused."""

import ctypes
import json
import os
import signal
import sqlite3
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest

from backend import durable
from backend.host import procs
from backend.jobs.records import UnsafeRunDir
from backend.jobs.registry import JobRegistry
from tests.fixtures.waiting import wait_for
from tests.fixtures.env import ROOT

PY = sys.executable
SLEEP = [PY, "-c", "import time; time.sleep(60)"]


def listed_elsewhere(run_dir: Path) -> list[str]:
    """The job names another process (the real `eagle3-host job list`) sees."""
    done = subprocess.run([PY, "-m", "backend", "job", "list", "--run-dir", str(run_dir), "--json"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return sorted(job["name"] for job in json.loads(done.stdout))


def deleted_db_descriptors() -> list[str]:
    links = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            links.append(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:
            pass
    return [link for link in links if "jobs.db" in link and link.endswith("(deleted)")]


def integrity(run_dir: Path) -> str:
    conn = sqlite3.connect(run_dir / "jobs.db")
    try:
        return conn.execute("PRAGMA integrity_check").fetchone()[0]
    finally:
        conn.close()


@pytest.fixture
def registry(tmp_path):
    reg = JobRegistry(tmp_path / "run")
    yield reg
    reg.stop(all_jobs=True, grace=1)


def test_a_second_thread_and_another_process_never_fork_the_registry(registry):
    """The bug: a thread's connection closed a descriptor of jobs.db, dropping this process's locks; the next CLI
    then deleted the WAL this process went on writing into, and every later record was invisible to everyone else."""
    registry.start_job("first", "other", SLEEP)
    thread = threading.Thread(target=registry.list_jobs)
    thread.start()
    thread.join()
    assert listed_elsewhere(registry.run_dir) == ["first"]
    registry.start_job("second", "other", SLEEP)
    assert listed_elsewhere(registry.run_dir) == ["first", "second"]
    assert deleted_db_descriptors() == []
    assert integrity(registry.run_dir) == "ok"


def test_two_registries_in_one_process_and_the_cli_share_one_truth(tmp_path):
    one, two = JobRegistry(tmp_path / "run"), JobRegistry(tmp_path / "run")
    try:
        one.start_job("by-one", "other", SLEEP)
        assert listed_elsewhere(one.run_dir) == ["by-one"]
        two.start_job("by-two", "other", SLEEP)
        assert listed_elsewhere(one.run_dir) == ["by-one", "by-two"]
        assert sorted(job.name for job in one.list_jobs()) == ["by-one", "by-two"]
        assert deleted_db_descriptors() == []
    finally:
        one.stop(all_jobs=True, grace=1)


def test_records_survive_a_sigkill_of_the_writer_after_other_processes_used_the_db(tmp_path):
    run_dir = tmp_path / "run"
    script = textwrap.dedent(
        f"""
        import subprocess, sys, threading
        sys.path.insert(0, {str(ROOT)!r})
        from backend.jobs.registry import JobRegistry
        reg = JobRegistry({str(run_dir)!r})
        reg.start_job("a", "other", ["sleep", "60"])
        threading.Thread(target=reg.list_jobs).start()
        subprocess.run([sys.executable, "-m", "backend", "job", "list", "--run-dir", {str(run_dir)!r}], cwd={str(ROOT)!r}, capture_output=True)
        for name in ("b", "c"):
            reg.start_job(name, "other", ["sleep", "60"])
        print("committed", flush=True)
        import time; time.sleep(60)
        """
    )
    writer = subprocess.Popen([PY, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert writer.stdout is not None and writer.stdout.readline().strip() == "committed"
    finally:
        writer.send_signal(signal.SIGKILL)
        writer.wait()
    assert listed_elsewhere(run_dir) == ["a", "b", "c"]
    assert integrity(run_dir) == "ok"
    JobRegistry(run_dir).stop(all_jobs=True, grace=1)


def test_a_backend_planted_in_the_cwd_is_never_imported(registry, tmp_path):
    """A directory another user can write, used as the job's cwd: neither the watcher nor our own commands import from it."""
    planted = tmp_path / "shared-dir"
    marker = tmp_path / "planted-code-ran"
    (planted / "backend").mkdir(parents=True)
    payload = f"open({str(marker)!r}, 'a').write(__name__ + '\\n')\n"
    for module in ("__init__.py", "jobs.py", "__main__.py", "cli.py"):
        (planted / "backend" / module).write_text(payload)
    plain = registry.start_job("plain", "other", [PY, "-c", "print('ok')"], cwd=str(planted))
    own = registry.start_job("own", "other", ["eagle3-host", "gpus", "--json"], cwd=str(planted))
    for name in ("plain", "own"):
        wait_for(lambda: registry.get(name).info.state == "exited", timeout=60, what=f"job {name} to exit")
    assert not marker.exists(), marker.read_text()
    assert Path(plain.stdout_path).read_text().strip() == "ok"
    assert registry.get("own").info.exit_code == 0, Path(own.stderr_path).read_text()


def test_an_existing_run_dir_and_jobs_db_are_made_private(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir(mode=0o755)
    os.chmod(run_dir, 0o755)
    JobRegistry(run_dir).close()
    os.chmod(run_dir / "jobs.db", 0o644)
    reg = JobRegistry(run_dir)
    try:
        assert run_dir.stat().st_mode & 0o777 == 0o700
        assert (run_dir / "jobs").stat().st_mode & 0o777 == 0o700
        assert (run_dir / "jobs.db").stat().st_mode & 0o777 == 0o600
    finally:
        reg.close()


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a directory to another user needs root")
@pytest.mark.parametrize("what", ["run dir", "jobs.db", "ancestor"])
def test_a_run_dir_another_user_controls_is_refused_and_left_untouched(tmp_path, what):
    run_dir = tmp_path / "parent" / "run"
    JobRegistry(run_dir).close()
    target = {"run dir": run_dir, "jobs.db": run_dir / "jobs.db", "ancestor": run_dir.parent}[what]
    if what == "ancestor":
        os.chmod(target, 0o777)  # writable by anyone, not sticky: another user can swap the run dir
    else:
        os.chown(target, 4242, 4242)
    before = sorted(p.name for p in run_dir.iterdir())
    with pytest.raises(UnsafeRunDir) as refused:
        JobRegistry(run_dir)
    assert "Nothing was done" in str(refused.value) and str(target) in str(refused.value)
    assert sorted(p.name for p in run_dir.iterdir()) == before
    done = subprocess.run([PY, "-m", "backend", "job", "list", "--run-dir", str(run_dir)], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode != 0 and "Traceback" not in done.stderr and "another user" in done.stderr


def test_a_symlinked_jobs_db_is_refused(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir(mode=0o700)
    elsewhere = tmp_path / "elsewhere.db"
    elsewhere.write_bytes(b"")
    (run_dir / "jobs.db").symlink_to(elsewhere)
    with pytest.raises(UnsafeRunDir):
        JobRegistry(run_dir)
    assert elsewhere.read_bytes() == b""


def test_an_atomic_write_never_follows_a_link_planted_at_its_temp_name(tmp_path):
    victim = tmp_path / "victim"
    victim.write_text("precious")
    target = tmp_path / "state.json"
    (tmp_path / f".state.json.{os.getpid()}.tmp").symlink_to(victim)
    durable.write_atomic(target, "new")
    assert target.read_text() == "new" and victim.read_text() == "precious"


def test_a_sigstopped_job_is_continued_so_its_sigterm_handler_checkpoints(registry, tmp_path):
    marker = tmp_path / "checkpointed"
    trainer = (
        "import signal, sys, time\n"
        f"def save(*_):\n    open({str(marker)!r}, 'w').write('saved')\n    sys.exit(0)\n"
        "signal.signal(signal.SIGTERM, save)\n"
        "print('ready', flush=True)\n"
        "while True:\n    time.sleep(0.05)\n"
    )
    info = registry.start_job("stopped-trainer", "train", [PY, "-c", trainer])
    wait_for(lambda: "ready" in Path(info.stdout_path).read_text(), what="the trainer's ready line")
    os.kill(info.pid, signal.SIGSTOP)
    plan = registry.stop_plan(["stopped-trainer"])
    assert plan.checkpoint_first
    assert [target.get("state", "") for target in plan.will_signal] == ["stopped (SIGSTOP): continued after its SIGTERM"]
    verdicts = registry.stop(["stopped-trainer"], grace=20)
    assert marker.read_text() == "saved"
    assert [(v.pid, v.outcome) for v in verdicts] == [(info.pid, "exited_on_term")]


PTRACE_ATTACH, PTRACE_DETACH = 16, 17


def test_a_trainer_held_by_a_debugger_is_planned_without_a_checkpoint(registry, capsys):
    """A leader in tracing stop (state t) keeps its SIGTERM pending until the debugger lets go, and a stop does not
    continue it as it does a SIGSTOPped one: the plan must not promise a checkpoint."""
    info = registry.start_job("traced-trainer", "train", [PY, "-c", "import time; print('ready', flush=True); time.sleep(600)"])
    wait_for(lambda: "ready" in Path(info.stdout_path).read_text(), what="the trainer's ready line")
    libc = ctypes.CDLL(None, use_errno=True)
    libc.ptrace.argtypes = [ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p]
    if libc.ptrace(PTRACE_ATTACH, info.pid, None, None) != 0:  # this test process is the job's ancestor: Yama allows it
        registry.stop(["traced-trainer"], grace=0)
        pytest.skip(f"cannot ptrace the job here: {os.strerror(ctypes.get_errno())}")
    try:
        wait_for(lambda: getattr(procs.read_stat(info.pid), "state", "") == "t", what="the tracing stop")
        plan = registry.stop_plan(["traced-trainer"])
    finally:
        libc.ptrace(PTRACE_DETACH, info.pid, None, None)
    assert not plan.checkpoint_first
    assert [target.get("state", "") for target in plan.will_signal] == ["stopped by a debugger: cannot handle SIGTERM until the debugger lets it go"]
    assert "traced-trainer's leader is stopped by a debugger" in plan.checkpoint_note and "no checkpoint" in plan.checkpoint_note
    from backend.jobs.cli import print_plan

    print_plan(plan)  # `eagle3-host job plan` says both, per PID and for the checkpoint
    printed = capsys.readouterr().out
    assert f"note: pid {info.pid} is stopped by a debugger" in printed and "no checkpoint: traced-trainer's leader" in printed
    registry.stop(["traced-trainer"], grace=0)
    assert not procs.is_alive(info.pid, info.start_time_ticks)


def add_finished(run_dir: Path, count: int) -> None:
    """`count` jobs that ran and exited long ago (no watcher left), as the registry records them."""
    conn = sqlite3.connect(run_dir / "jobs.db")
    with conn:
        for number in range(count):
            job_dir = run_dir / "jobs" / f"done{number}"
            job_dir.mkdir(mode=0o700)
            conn.execute(
                "INSERT INTO jobs (name, kind, state, argv, job_dir, stdout_path, stderr_path, started_at, ended_at, exit_code)"
                " VALUES (?, 'other', 'exited', '[\"true\"]', ?, ?, ?, ?, ?, 0)",
                (f"done{number}", str(job_dir), str(job_dir / "stdout.log"), str(job_dir / "stderr.log"), 1000.0 + number, 1001.0 + number),
            )
    conn.close()


def test_old_finished_records_are_archived_not_lost_and_running_ones_stay(registry):
    from backend.jobs.registry import FINISHED_KEPT

    running = registry.start_job("still-running", "other", SLEEP)
    add_finished(registry.run_dir, FINISHED_KEPT + 50)
    listed = {job.name for job in registry.list_jobs()}
    assert "still-running" in listed and len(listed) == FINISHED_KEPT + 1
    assert "done0" not in listed and f"done{FINISHED_KEPT + 49}" in listed  # the newest finished ones stay listed
    conn = sqlite3.connect(registry.run_dir / "jobs.db")
    try:
        rows = conn.execute("SELECT count(*), sum(archived) FROM jobs").fetchone()
    finally:
        conn.close()
    assert rows == (FINISHED_KEPT + 51, 50)  # archived, still in jobs.db
    assert registry.get("still-running").info.pid == running.pid
    registry.start_job("done0", "other", SLEEP)  # an archived name is free again


def test_a_log_whose_last_line_is_longer_than_the_tail_window_tails_as_that_line_cut(tmp_path):
    from backend.jobs.logs import TAIL_LINE_SHOWN, display_lines, tail_lines

    log = tmp_path / "stdout.log"
    log.write_bytes(b"first line\n" + b"x" * (17 << 20))
    lines = tail_lines(log, 20)
    assert len(lines) == 1 and lines[0].startswith("… xxx")
    assert len(display_lines(lines[0].encode())[0]) < TAIL_LINE_SHOWN + 100


def test_an_unknown_request_type_is_quoted_cut_in_the_error(tmp_path):
    agent = subprocess.Popen(
        [PY, "-m", "backend.agent", "--run-dir", str(tmp_path / "run"), "--interval", "5"], cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert agent.stdin is not None and agent.stdout is not None
        agent.stdin.write(json.dumps({"type": "x" * 3_000_000, "id": 7}) + "\n")
        agent.stdin.flush()
        while True:
            message = json.loads(agent.stdout.readline())
            if message.get("type") == "reply" and message.get("id") == 7:
                break
        assert not message["ok"] and len(message["error"]["message"]) < 2000 and "[2999922 more chars cut]" in message["error"]["message"]
    finally:
        agent.kill()
        agent.wait()


def test_an_idle_refresh_reads_nothing_until_jobs_db_changes_and_sees_every_change(registry):
    """With only finished records, refresh() returns what it read last while jobs.db is unchanged (an idle agent's
    tick reads nothing); a start by another connection or by this registry, and a stop, are seen at once."""
    quick = registry.start_job("quick", "other", [PY, "-c", "pass"])
    wait_for(lambda: registry.get("quick").info.state == "exited", what="the quick job's end")
    first = registry.refresh()
    again = registry.refresh()
    assert [r.name for r in again] == ["quick"] and again[0] is first[0]  # nothing was read again
    other = JobRegistry(registry.run_dir)  # another connection, as the CLI or a second agent holds
    try:
        other.start_job("elsewhere", "other", SLEEP)
        seen = {r.name: r.info.state for r in registry.refresh()}
        assert seen == {"quick": "exited", "elsewhere": "running"}
        registry.stop(["elsewhere"], grace=5)
        assert {r.name: r.info.state for r in registry.refresh()}["elsewhere"] == "stopped"
        mine = registry.start_job("mine", "other", [PY, "-c", "pass"])  # this registry's own write
        assert "mine" in {r.name for r in registry.refresh()}
        wait_for(lambda: registry.get("mine").info.state == "exited", what="its end")
    finally:
        other.close()
    assert quick.name == "quick" and mine.name == "mine"


def test_metrics_lines_and_checkpoint_files_are_private(tmp_path):
    from backend.jsonl import append_record
    from backend.train.fsutil import staging_dir, write_new_file

    append_record(tmp_path / "metrics.jsonl", {"step": 1})
    staged = staging_dir(tmp_path, ".ckpt-")
    write_new_file(staged / "model.safetensors", b"weights")
    assert (tmp_path / "metrics.jsonl").stat().st_mode & 0o777 == 0o600
    assert staged.stat().st_mode & 0o777 == 0o700 and (staged / "model.safetensors").stat().st_mode & 0o777 == 0o600


def test_status_results_heartbeats_and_the_index_sidecar_are_written_private(tmp_path):
    """Everything written through durable.write_atomic is 0600 unless a caller asks otherwise: bench and chain results,
    the rank heartbeats, the job's leader and exit files, the metrics index sidecar."""
    from backend.durable import write_atomic
    from backend.layout import HeartbeatWriter, heartbeat_path

    write_atomic(tmp_path / "result.json", "{}")
    (tmp_path / "job").mkdir()
    beats = HeartbeatWriter(tmp_path / "job", rank=0, every=60.0, log=lambda line: None)
    beats.close("done")
    assert (tmp_path / "result.json").stat().st_mode & 0o777 == 0o600
    assert heartbeat_path(tmp_path / "job", 0).stat().st_mode & 0o777 == 0o600
    write_atomic(tmp_path / "shared.txt", "x", mode=0o644)
    assert (tmp_path / "shared.txt").stat().st_mode & 0o777 == 0o644  # a caller may still ask


@pytest.mark.slow
def test_registry_stress_ci_sized():
    """benchmarks/registry_stress.py at CI size: registries, agents, CLIs, chains and consoles with SIGKILLs lose and hide nothing."""
    done = subprocess.run(
        [PY, "benchmarks/registry_stress.py", "--workers", "5", "--seconds", "25", "--kill-every", "3", "--seed", "3"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    counts = dict(line.strip().split(": ", 1) for line in done.stdout.splitlines() if ": " in line)
    assert int(counts["records_committed"]) > 0 and int(counts["kills"]) > 0
    assert (counts["unseen_by_a_reader"], counts["lost_at_end"], counts["integrity"]) == ("0", "0", "ok")
    assert int(counts["console_checks"]) > 0 and counts["unseen_by_a_console"] == "0"
