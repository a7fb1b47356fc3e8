"""The watcher process every job runs under (`python -m backend.jobs.watcher JOB_DIR -- CMD...`): subreaper, leader, exit status.

Why there is a watcher: the agent or CLI spawns it in a new session (watcher_argv). The watcher starts CMD in
another new session, so CMD is the job's leader (its pid is the job pid, pgid and session id), writes
leader.json, then waits for CMD and writes its exit status to the `exit_code` file (negative = killed by that
signal). The watcher is outside the job's process group, so stopping the group never kills it, and it outlives
the agent and the SSH connection: the exit code is known even when whoever started the job has died. The watcher
is also a child subreaper, so a descendant whose parent died (or that called setsid) stays in the watcher's
process tree, where a stop finds it. Where cgroup v2 is writable, the leader is moved into a cgroup of its own
before it runs (procs.create_job_cgroup), and the watcher moves itself out of the way (to the parent eagle3-jobs
cgroup).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from backend.host import procs
from backend.jobs.records import (
    EXIT_FILE,
    EXIT_SLOT_BYTES,
    JOB_TOKEN_ENV,
    LEADER_FILE,
    PACKAGE_PARENT,
    STOP_FILE,
    STOP_SLOT_BYTES,
    WATCH_TOKEN_ENV,
    overwrite_slot,
    private_opener,
    reserve_slot,
    write_atomic,
)

EXIT_RETRY_S = 3600.0  # how long a watcher keeps trying to record the exit status on a full disk
# The watcher is standard library only: -I (no PYTHON* variables, no user site, no script dir or cwd on sys.path),
# and the backend is imported from where this file lies, whatever the cwd: a `backend/` planted in a directory
# another user can write is never imported by root.
WATCHER_BOOT = f"import sys; sys.path.insert(0, {PACKAGE_PARENT!r}); from backend.jobs.watcher import main; sys.exit(main(sys.argv[1:]))"


def watcher_argv(job_dir: Path, argv: list[str]) -> list[str]:
    """`python -m backend.jobs.watcher JOB_DIR -- ARGV...`, isolated (see WATCHER_BOOT)."""
    return [sys.executable, "-I", "-c", WATCHER_BOOT, str(job_dir), "--", *argv]


def main(argv: list[str]) -> int:
    if len(argv) >= 3 and argv[1] == "--":
        return watch(Path(argv[0]), argv[2:])
    print("usage: python -m backend.jobs.watcher JOB_DIR -- CMD [ARGS...]  (started by JobRegistry.start_job)", file=sys.stderr)
    return 2


def watch(job_dir: Path, argv: list[str]) -> int:
    """Run argv as the job leader, record leader.json and exit_code, reap orphans until none remain."""
    _become_subreaper()
    reserve_slot(job_dir / EXIT_FILE, EXIT_SLOT_BYTES)
    reserve_slot(job_dir / STOP_FILE, STOP_SLOT_BYTES)
    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(signum, lambda *_: None)  # a handler, not SIG_IGN: the job must start with default dispositions
    env = dict(os.environ)
    env[JOB_TOKEN_ENV] = env.pop(WATCH_TOKEN_ENV, "")
    cgroup = _watcher_cgroup(job_dir, env[JOB_TOKEN_ENV])
    with open(job_dir / "stdout.log", "ab", opener=private_opener) as out, open(job_dir / "stderr.log", "ab", opener=private_opener) as err:
        try:
            child, cgroup = _spawn_leader(argv, out, err, env, cgroup)
        except OSError as exc:
            err.write(f"eagle3 watcher: could not start {argv[0]!r}: {exc}\n".encode())
            _write_exit_code(job_dir, 127)
            if cgroup is not None:
                procs.remove_cgroup(cgroup)
            _report_leader({"error": f"could not start {argv[0]!r}: {exc}", "exit_code": 127})
            return 127
    _report_leader(_record_leader(job_dir, child, cgroup))
    code, recorded = _reap_all(child, job_dir)
    if not recorded:
        _retry_exit_code(job_dir, code, time.monotonic() + EXIT_RETRY_S)
    if cgroup is not None:
        procs.remove_cgroup(cgroup)
    return 128 - code if code < 0 else code


def _become_subreaper() -> None:
    """Orphaned descendants of the job get re-parented to the watcher instead of init (Linux prctl)."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER
    except (OSError, AttributeError):
        pass


def _watcher_cgroup(job_dir: Path, token: str) -> Path | None:
    """The job's own cgroup (None where cgroup v2 is not writable); the watcher itself moves beside it, out of any job's."""
    cgroup = procs.create_job_cgroup(f"{job_dir.name}-{(token or str(os.getpid()))[:12]}")
    if cgroup is not None:
        procs.enter_cgroup(cgroup.parent)  # started from inside another job: stopping that job must not kill this watcher
    return cgroup


def _spawn_leader(argv: list[str], out, err, env: dict[str, str], cgroup: Path | None) -> tuple[subprocess.Popen, Path | None]:
    """Start argv in a new session, inside the cgroup when one is given (moved before exec, so before it can fork)."""
    common = dict(stdin=subprocess.DEVNULL, stdout=out, stderr=err, env=env, start_new_session=True)
    if cgroup is not None:

        def enter() -> None:
            if not procs.enter_cgroup(cgroup):
                raise OSError("could not enter the job cgroup")

        try:
            return subprocess.Popen(argv, preexec_fn=enter, **common), cgroup
        except subprocess.SubprocessError:
            procs.remove_cgroup(cgroup)  # could not enter it: run without a cgroup, the freeze-walk stop still holds
    return subprocess.Popen(argv, **common), None


def _record_leader(job_dir: Path, child: subprocess.Popen, cgroup: Path | None) -> dict[str, Any]:
    """The leader's identity, written to leader.json (best effort: the starter gets the same facts on stdout)."""
    stat = procs.read_stat(child.pid)
    leader = {
        "pid": child.pid,
        "pgid": stat.pgid if stat else child.pid,
        "start_time_ticks": stat.start_time if stat else 0,
        "watcher_pid": os.getpid(),
        "watcher_start": procs.start_time(os.getpid()),
        "cgroup": str(cgroup) if cgroup else None,
    }
    try:
        write_atomic(job_dir / LEADER_FILE, json.dumps(leader) + "\n")
    except OSError:
        pass
    return leader


def _report_leader(message: dict[str, Any]) -> None:
    """One JSON line to whoever started us, then stdout goes to /dev/null so a dead starter cannot hurt us."""
    try:
        sys.stdout.write(json.dumps(message) + "\n")
        sys.stdout.flush()
    except (BrokenPipeError, OSError):
        pass
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    os.close(devnull)


def _reap_all(child: subprocess.Popen, job_dir: Path) -> tuple[int, bool]:
    """Wait for the leader (recording its exit code) and every orphan handed to us; returns the leader's code and whether it was recorded."""
    code, recorded = 0, False
    while True:
        try:
            pid, status = os.waitpid(-1, 0)
        except ChildProcessError:
            return code, recorded
        if pid == child.pid:
            child.returncode = code = os.waitstatus_to_exitcode(status)
            recorded = _write_exit_code(job_dir, code)


def _write_exit_code(job_dir: Path, code: int) -> bool:
    """Replace the exit file atomically; on a full disk, write over the slot reserved at start. False when neither worked."""
    try:
        write_atomic(job_dir / EXIT_FILE, f"{code}\n")
        return True
    except OSError as exc:  # a full disk must not end the watcher: it still reaps the job's orphans
        if overwrite_slot(job_dir / EXIT_FILE, f"{code}"):
            return True
        try:
            print(f"eagle3 watcher: could not record exit code {code} yet: {exc}", file=sys.stderr, flush=True)
        except OSError:
            pass
        return False


def _retry_exit_code(job_dir: Path, code: int, deadline: float) -> None:
    """Keep trying to record the exit status until space returns (the job shows "waiting for its exit status" meanwhile)."""
    while time.monotonic() < deadline:
        time.sleep(2.0)
        if _write_exit_code(job_dir, code):
            return


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
