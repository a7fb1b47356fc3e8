"""The stop: its plan (what would be signalled, whether a trainer can checkpoint) and the stop itself, TERM to verdicts.

SIGTERM, SIGCONT for stopped members, the grace period, then the kill. Where the job has a cgroup of its own
(procs.create_job_cgroup) the kill ends like systemd's KillMode=control-group: freeze the cgroup, cgroup.kill.
Elsewhere, or when the stopping process itself sits inside the job, the tree is frozen by SIGSTOP until a fresh
walk of /proc finds nothing new, then SIGKILLed, so nothing can fork its way out during the kill. The stopping
process and its ancestors are never signalled, and a stop never needs a write to succeed: signals go first,
records after, and what could not be recorded is reported (JobStore.unrecorded()).
"""

from __future__ import annotations

import fcntl
import math
import os
import signal
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Protocol

from backend.commands import STOP_GRACE_MAX_S
from backend.host import procs
from backend.jobs import discovery
from backend.jobs.discovery import JobPlan, RecordedProc, Target
from backend.jobs.records import ESCAPED_NOTE, STOP_FILE, STOP_INCOMPLETE, UNVERIFIED, JobBadParams, JobConflict, JobRecord, read_exit_file, write_stop_slot
from backend.protocol import ProcessVerdict, StopPlan

FREEZE_TIMEOUT_S = 5.0
PROCESS_STATE_NOTES = {
    "T": "stopped (SIGSTOP): continued after its SIGTERM",
    "t": "stopped by a debugger: cannot handle SIGTERM until the debugger lets it go",
    "D": "in uninterruptible sleep: handles SIGTERM only when its I/O returns",
}


class JobStore(Protocol):
    """What a stop reads from and writes to the job registry; every write is best effort and says whether it was stored."""

    def refresh(self) -> list[JobRecord]: ...

    def active(self) -> list[JobRecord]: ...

    def recorded_procs(self) -> dict[int, list[RecordedProc]]: ...

    def remember(self, found: list[tuple[int, Target]]) -> None: ...

    def try_update(self, what: str, job_ids: list[int], **values: Any) -> bool: ...

    def note_unrecorded(self, message: str) -> None: ...

    def forget_unrecorded(self) -> None: ...

    def unrecorded(self) -> list[str]: ...


def check_stop_seconds(**values: float) -> None:
    """grace and friends must be finite, >= 0 and at most STOP_GRACE_MAX_S: NaN never compares past a deadline."""
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or not 0 <= value <= STOP_GRACE_MAX_S:
            raise JobBadParams(f"{name}: {value!r} is not a number of seconds between 0 and {STOP_GRACE_MAX_S:g}; nothing was signalled")


# ---------------------------------------------------------------- the plan


def preview(plans: list[JobPlan], foreign_holders: list[dict] | None = None) -> StopPlan:
    """What stop would do with these plans, computed without signalling anything."""
    states = {t.pid: _process_state(t) for plan in plans for t in plan.targets}
    blockers = [_checkpoint_blocker(plan, states) for plan in plans if plan.record.info.kind == "train"]
    return StopPlan(
        jobs=[plan.record.name for plan in plans],
        will_signal=[
            {"pid": t.pid, "job": t.job, "cmdline": t.cmdline, "role": t.role, **({"state": PROCESS_STATE_NOTES[states[t.pid]]} if states[t.pid] else {})}
            for plan in plans
            for t in plan.targets
        ],
        stale=[{"job": plan.record.name, "pid": plan.record.info.pid, "reason": plan.stale_reason} for plan in plans if plan.stale_reason],
        foreign_gpu_holders=foreign_holders or [],
        checkpoint_first=any(blocker is None for blocker in blockers),
        checkpoint_note="; ".join(blocker for blocker in blockers if blocker),
    )


def _process_state(target: Target) -> str:
    """The /proc state letter of a target that will not simply handle its SIGTERM at once (a PROCESS_STATE_NOTES key), else ""."""
    stat = procs.read_stat(target.pid)
    if stat is None or stat.start_time != target.start or stat.state not in PROCESS_STATE_NOTES:
        return ""
    return stat.state


def _checkpoint_blocker(plan: JobPlan, states: dict[int, str]) -> str | None:
    """Why this training job writes no checkpoint on SIGTERM, or None when it does (a SIGSTOPped leader is continued;
    one held by a debugger keeps its SIGTERM pending)."""
    leaders = [t for t in plan.targets if t.role == "leader"] or plan.targets
    if not leaders:
        return f"{plan.record.name} has no process left to signal"
    if any(states.get(t.pid) == "t" for t in leaders):
        return (
            f"{plan.record.name}'s leader is stopped by a debugger: its SIGTERM stays pending until the debugger lets it go, "
            "so it writes no checkpoint and gets SIGKILL after the grace"
        )
    return None


# ---------------------------------------------------------------- the stop


def stop_jobs(
    store: JobStore,
    locks: StopLocks,
    names: list[str] | None,
    all_jobs: bool,
    grace: float,
    kill_wait: float,
    gpu_source: Any,
    gpu_release_timeout: float,
) -> list[ProcessVerdict]:
    """SIGTERM each job, wait `grace`, freeze what is left, SIGKILL all of it, confirm all gone.

    One stop per job at a time (a lock on its directory): a concurrent stop waits for it, then finds what is
    left, so no process gets SIGTERM twice. Writes are best effort and come after the signals they describe.
    """
    check_stop_seconds(grace=grace, kill_wait=kill_wait, gpu_release_timeout=gpu_release_timeout)
    store.forget_unrecorded()
    selected = discovery.select_records(store.refresh(), names, all_jobs)
    with locks.hold(selected, timeout=grace + kill_wait + gpu_release_timeout + 60):
        ids = {record.id for record in selected}
        plans = [plan for plan in discovery.job_plans(store.refresh(), store.recorded_procs(), names, all_jobs) if plan.record.id in ids]
        verdicts = stop_plans(store, plans, grace, kill_wait)
        verdicts += discovery.find_escapees(plans, verdicts, store.active())
        _confirm_gpu_released(verdicts, gpu_source, gpu_release_timeout)
        _finish_records(store, [plan for plan in plans if plan.targets or plan.protected], f"stopped by operator (grace {grace:g}s)", verdicts)
    _mention_unrecorded(store, verdicts)
    return verdicts


def stop_plans(store: JobStore, plans: list[JobPlan], grace: float, kill_wait: float) -> list[ProcessVerdict]:
    """Signal what the plans name (TERM, grace, freeze, KILL); stale plans only get a verdict saying they were left alone."""
    verdicts = [
        ProcessVerdict(plan.record.info.pid, "leader", "stale_not_signalled", f"job {plan.record.name}: {plan.stale_reason}")
        for plan in plans
        if plan.stale_reason
    ]
    active = [plan for plan in plans if plan.targets or plan.protected]
    if not active:
        return verdicts
    status = _terminate(store, active, grace, f"stopped by operator (grace {grace:g}s)")
    _kill_rest(store, active, status, kill_wait)
    return verdicts + _verdicts(active, status)


def _terminate(store: JobStore, active: list[JobPlan], grace: float, detail: str) -> dict[int, str]:
    """SIGTERM every target, record the stop (best effort), wait up to `grace` for the targets to go."""
    now = time.time()
    status: dict[int, str] = {}
    for plan in active:
        plan.record.stop_requested_at = now  # in memory first: discovery must not call a job we are stopping stale
        termed = _signal_all(plan, plan.targets, signal.SIGTERM)
        _continue_stopped(plan.targets)
        status.update({t.pid: "termed" if t.pid in termed else "already_gone" for t in plan.targets})
    store.remember([(plan.record.id, t) for plan in active for t in plan.targets if t.role != "leader"])
    if not store.try_update("stop request", [plan.record.id for plan in active], stop_requested_at=now, detail=detail):
        _keep_in_slots(store, active, now, detail)
    termed_targets = [t for plan in active for t in plan.targets if status[t.pid] == "termed"]
    _wait_gone(termed_targets, grace)
    return status


def _kill_rest(store: JobStore, active: list[JobPlan], status: dict[int, str], kill_wait: float) -> None:
    """Freeze and SIGKILL whatever of each job is still alive, forked during the grace period included."""
    records = store.active()
    sent = [target for plan in active for target in _freeze_and_kill(store, plan, records, kill_wait)]
    survivors = {t.pid for t in _wait_gone(sent, kill_wait)}
    status.update({t.pid: "survived" if t.pid in survivors else "killed" for t in sent})
    termed = {t.pid: t for plan in active for t in plan.targets if status.get(t.pid) == "termed"}
    status.update({pid: "survived" if procs.is_alive(pid, t.start) else "exited_on_term" for pid, t in termed.items()})


def _freeze_and_kill(store: JobStore, plan: JobPlan, records: list[JobRecord], kill_wait: float) -> list[Target]:
    """Freeze the job (its cgroup, else SIGSTOP until a fresh walk finds nothing new), then SIGKILL it; returns what was killed."""
    cgroup = _usable_cgroup(plan)
    frozen_cgroup = cgroup if cgroup is not None and procs.cgroup_freeze(cgroup) else None
    inside: set[int] = set()
    found: dict[int, Target] = {}

    def discover() -> dict[int, int]:
        inside.clear()
        inside.update(procs.cgroup_pids(frozen_cgroup) if frozen_cgroup is not None else ())
        ctx = discovery.scan(records, store.recorded_procs(), tokens=True)
        fresh = {t.pid: t for t in discovery.plan_job(plan.record, ctx, [*plan.targets, *found.values()]).targets}
        found.update(fresh)
        return {pid: t.start for pid, t in fresh.items() if pid not in inside}

    procs.freeze(discover, FREEZE_TIMEOUT_S)
    if frozen_cgroup is not None:
        found.update(_cgroup_targets(plan, frozen_cgroup))  # complete: nothing in a frozen cgroup can fork
    _add_late_targets(plan, found.values())
    sent = [t for t in found.values() if t.pid not in inside and procs.send_signal(t.pid, t.start, signal.SIGKILL)]
    if frozen_cgroup is not None:
        procs.cgroup_kill(frozen_cgroup, kill_wait)
        sent += [t for t in found.values() if t.pid in inside]
        procs.remove_cgroup(frozen_cgroup)
    return sent


def _usable_cgroup(plan: JobPlan) -> Path | None:
    """The job's cgroup, unless it is gone or holds this process or an ancestor (freezing it would freeze us)."""
    path = plan.record.cgroup
    if not procs.is_job_cgroup(path) or set(procs.cgroup_pids(path)) & discovery.protected_pids():
        return None
    return Path(path)


def _cgroup_targets(plan: JobPlan, cgroup: Path) -> dict[int, Target]:
    info = plan.record.info
    targets = {}
    for pid in procs.cgroup_pids(cgroup):
        stat = procs.read_stat(pid)
        if discovery.signallable(stat):
            leader = pid == info.pid and stat.start_time == info.start_time_ticks
            role = "leader" if leader else "group" if stat.pgid == info.pgid else "descendant"
            targets[pid] = Target(pid, stat.start_time, stat.pgid, role, info.name, procs.cmdline(pid))
    return targets


def _add_late_targets(plan: JobPlan, found: Iterable[Target]) -> None:
    known = {(t.pid, t.start) for t in plan.targets}
    plan.targets.extend(t for t in found if (t.pid, t.start) not in known)


def _continue_stopped(targets: list[Target]) -> None:
    """SIGCONT every stopped target right after its SIGTERM (as systemd does): a stopped process keeps a SIGTERM
    pending until continued, so a SIGSTOPped trainer would never run its checkpoint and be SIGKILLed after the grace.
    After the SIGTERM, not before, so a continued process handles the TERM first instead of running on."""
    for target in targets:
        if _process_state(target) == "T":
            procs.send_signal(target.pid, target.start, signal.SIGCONT)  # identity checked again there


def _signal_all(plan: JobPlan, targets: list[Target], signum: int) -> set[int]:
    """Signal the group once when it is provably ours, and every target outside it by identity; returns pids reached."""
    pgid = plan.record.info.pgid
    alive = {t.pid for t in targets if procs.is_alive(t.pid, t.start)}
    group_sent = False
    # A live, identity-checked member keeps the pgid number from being reused, so the group is still ours.
    # killpg would also reach a stopper that runs inside the group: then every member is signalled one by one.
    if plan.group_signal and not _group_holds_protected(pgid) and any(t.pid in alive and procs.pgid_of(t.pid) == pgid for t in targets):
        try:
            os.killpg(pgid, signum)
            group_sent = True
        except ProcessLookupError:
            pass
    reached = set()
    for target in targets:
        if target.pid not in alive:
            continue
        if (group_sent and target.pgid == pgid) or procs.send_signal(target.pid, target.start, signum):
            reached.add(target.pid)
    return reached


def _group_holds_protected(pgid: int) -> bool:
    return pgid <= 1 or any(procs.pgid_of(pid) == pgid for pid in discovery.protected_pids())


def _wait_gone(targets: list[Target], timeout: float) -> list[Target]:
    deadline = time.monotonic() + timeout
    while True:
        alive = [t for t in targets if procs.is_alive(t.pid, t.start)]
        if not alive or time.monotonic() >= deadline:
            return alive
        time.sleep(0.05)


def _verdicts(plans: list[JobPlan], outcome: dict[int, str]) -> list[ProcessVerdict]:
    verdicts = []
    for plan in plans:
        for target in plan.targets:
            result = outcome.get(target.pid, "already_gone")
            detail = f"job {target.job}: {target.cmdline[:120]}"
            if result == "survived":
                stat = procs.read_stat(target.pid)
                detail += f" (still alive in state {stat.state if stat else '?'} after SIGKILL)"
            verdicts.append(ProcessVerdict(target.pid, target.role, result, detail))
        for target in plan.protected:
            alive = procs.is_alive(target.pid, target.start)
            detail = (
                f"job {target.job}: NOT signalled: it is this stop's own process or one of its parents; "
                f"stop the job from outside it to end it ({target.cmdline[:120]})"
            )
            verdicts.append(ProcessVerdict(target.pid, target.role, "survived" if alive else "already_gone", detail))
    return verdicts


def _confirm_gpu_released(verdicts: list[ProcessVerdict], gpu_source: Any, timeout: float) -> None:
    """When a GPU source is available, wait until no stopped PID is listed as a compute process."""
    if gpu_source is None or getattr(gpu_source, "name", "none") == "none":
        return
    stopped = {v.pid for v in verdicts if v.outcome in ("exited_on_term", "killed", "already_gone")}
    deadline = time.monotonic() + timeout
    holding: dict[int, float | None] = {}
    while True:
        holding = {p.pid: p.used_memory_mib for s in gpu_source.sample() for p in s.processes if p.pid in stopped}
        if not holding or time.monotonic() >= deadline:
            break
        time.sleep(0.25)
    for verdict in verdicts:
        if verdict.pid in holding:
            verdict.detail += f"; GPU memory NOT released after {timeout:g}s ({holding[verdict.pid]} MiB still listed)"
        elif verdict.pid in stopped:
            verdict.detail += "; GPU memory released"


# ---------------------------------------------------------------- the record of a stop


def _finish_records(store: JobStore, plans: list[JobPlan], detail: str, verdicts: list[ProcessVerdict]) -> None:
    """Wait briefly for each watcher's exit file, then store the stopped state, or what survived (best effort)."""
    survived = {v.pid for v in verdicts if v.outcome == "survived"}
    deadline = time.monotonic() + 3.0
    for plan in plans:
        left = sorted(t.pid for t in plan.targets + plan.protected if t.pid in survived)
        if left:
            store.try_update("stop result", [plan.record.id], detail=f"{STOP_INCOMPLETE}: PID {', '.join(map(str, left))} still alive")
            continue
        job_detail = _stopped_detail(plan, detail)  # per job: one job's escapees never appear in another's record
        info = plan.record.info
        exit_code, ended_at = read_exit_file(info.job_dir)
        while exit_code is None and info.state == "running" and discovery.watcher_alive(plan.record) and time.monotonic() < deadline:
            time.sleep(0.02)
            exit_code, ended_at = read_exit_file(info.job_dir)
        if info.state == "running":
            # detail again: a refresh from another process may have written a transient one meanwhile
            values = dict(
                state="stopped", detail=job_detail, exit_code=exit_code, ended_at=ended_at or time.time(), stop_requested_at=plan.record.stop_requested_at
            )
            if not store.try_update("stopped state", [plan.record.id], **values):
                _keep_in_slots(store, [plan], plan.record.stop_requested_at or time.time(), job_detail)
    store.refresh()


def _stopped_detail(plan: JobPlan, detail: str) -> str:
    """The stopped record's detail, naming what escaped the stop and whether the stop can vouch for the job."""
    escaped = [v.pid for v in plan.escaped if v.outcome != UNVERIFIED]
    if escaped:
        detail = f"{detail}; {ESCAPED_NOTE}: PID {', '.join(map(str, escaped))} (not provably the job's, NOT signalled)"
    if any(v.outcome == UNVERIFIED for v in plan.escaped):
        detail += f"; {UNVERIFIED}: its watcher had been killed, so a process it detached may have escaped untraced"
    return detail


def _keep_in_slots(store: JobStore, plans: list[JobPlan], at: float, detail: str) -> None:
    """jobs.db refused the stop: keep it in each job dir's reserved slot, read back until jobs.db can store it."""
    for plan in plans:
        if write_stop_slot(plan.record.info.job_dir, at, detail):
            store.note_unrecorded(f"job {plan.record.name}: the stop is kept in {Path(plan.record.info.job_dir) / STOP_FILE} until jobs.db can be written")


def _mention_unrecorded(store: JobStore, verdicts: list[ProcessVerdict]) -> None:
    notes = store.unrecorded()
    if notes:
        for verdict in verdicts:
            verdict.detail += f"; NOT recorded in jobs.db ({notes[-1][:160]})"


# ---------------------------------------------------------------- one stop per job at a time


class StopLocks:
    """Each job's stop lock: a claim within this process (threads share one flock), then an flock on the job's directory."""

    def __init__(self) -> None:
        self._lock = threading.Lock()  # flock is per open file: threads of one process need this too
        self._stopping: set[int] = set()

    @contextmanager
    def hold(self, records: list[JobRecord], timeout: float) -> Iterator[None]:
        """Hold every selected job's stop lock (in job id order, so two stops of overlapping sets cannot deadlock)."""
        deadline = time.monotonic() + timeout
        releases: list[Callable[[], None]] = []
        try:
            for record in sorted(records, key=lambda r: r.id):
                releases.append(self._lock_job(record, deadline))
            yield
        finally:
            for release in reversed(releases):
                release()

    def _lock_job(self, record: JobRecord, deadline: float) -> Callable[[], None]:
        """This thread's claim on the job, then an flock on its directory for other processes; flock dies with its holder."""
        while not self._claim_in_process(record.id):
            _wait_for_other_stop(record, deadline)
        fd = None
        try:
            fd = os.open(record.info.job_dir, os.O_RDONLY | os.O_DIRECTORY)
            while not _try_flock(fd):
                _wait_for_other_stop(record, deadline)
        except FileNotFoundError:
            pass  # no directory to lock (removed by hand): the in-process claim is all there is
        except BaseException:
            self._release_job(record.id, fd)
            raise
        return lambda: self._release_job(record.id, fd)

    def _claim_in_process(self, job_id: int) -> bool:
        with self._lock:
            if job_id in self._stopping:
                return False
            self._stopping.add(job_id)
            return True

    def _release_job(self, job_id: int, fd: int | None) -> None:
        if fd is not None:
            os.close(fd)
        with self._lock:
            self._stopping.discard(job_id)


def _wait_for_other_stop(record: JobRecord, deadline: float) -> None:
    if time.monotonic() >= deadline:
        raise JobConflict(f"job {record.name!r} is being stopped by another stop that has not finished; this one signalled nothing. Try again when it ends")
    time.sleep(0.05)


def _try_flock(fd: int) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
