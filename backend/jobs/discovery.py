"""Which live processes are a job's: its state from /proc, the targets a stop may signal, the escapees it may only name, the protected pids.

Everything here works over records and a process table handed in by the caller (the registry reads jobs.db);
nothing here reads or writes jobs.db.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Iterable, NamedTuple, TypeGuard

from backend.host import procs
from backend.jobs.logs import failure_detail
from backend.jobs.records import (
    ESCAPED_ROLE,
    JOB_TOKEN_ENV,
    START_TIMEOUT_S,
    STOP_INCOMPLETE,
    TERMINAL,
    UNVERIFIED,
    WATCH_TOKEN_ENV,
    WATCHER_ROLE,
    JobNotFound,
    JobRecord,
    read_exit_file,
    read_stop_slot,
)
from backend.protocol import ProcessVerdict

WATCHER_LOST = "its watcher (PID {pid}) is gone (killed?): its exit status will not be recorded and a process it detaches cannot be followed"
TRACE_VARIABLES = (JOB_TOKEN_ENV, WATCH_TOKEN_ENV, "EAGLE3_JOB_DIR")


class RecordedProc(NamedTuple):
    """A process of a job seen earlier and stored in jobs.db (job_procs), pinned by its start time."""

    pid: int
    start_time: int
    role: str


@dataclass
class Target:
    """A process a stop will signal, pinned by its identity (pid, start time)."""

    pid: int
    start: int
    pgid: int
    role: str  # leader | group | descendant
    job: str
    cmdline: str = ""


@dataclass
class JobPlan:
    record: JobRecord
    state: str
    targets: list[Target] = field(default_factory=list)
    group_signal: bool = False  # killpg(pgid) is safe: the leader is verified and still leads its group
    stale_reason: str | None = None
    protected: list[Target] = field(default_factory=list)  # the job's processes that are this stop's own process or its ancestors
    escaped: list[ProcessVerdict] = field(default_factory=list)  # processes with a trace of the job but no proof: named, never signalled


@dataclass
class Discovery:
    """What one round of process discovery works from."""

    table: procs.ProcTable
    token_pids: dict[str, list[int]]
    protected: set[int]
    roots: dict[int, int]  # pid of every job's leader and watcher -> job id
    cgroup_pids: dict[int, list[int]] = field(default_factory=dict)  # job id -> members of its cgroup
    recorded: dict[int, list[RecordedProc]] = field(default_factory=dict)  # job id -> its processes stored in jobs.db


@dataclass
class Traces:
    """What a process shows that could tie it to a job without proving it: where its stdout/stderr go, a few variables."""

    stdio: dict[str, str]  # "stdout"/"stderr" -> the file it writes to
    env: dict[str, str]


def protected_pids() -> set[int]:
    """This process and its ancestors: a stop run from inside a job must not cut the branch it sits on."""
    return {os.getpid(), *procs.ancestors(os.getpid())}


def signallable(stat: procs.ProcStat | None) -> TypeGuard[procs.ProcStat]:
    """A live process that a stop may ever signal: never PID 1, never a kernel thread."""
    return stat is not None and stat.running and stat.pid > 1 and not stat.kernel_thread


def watcher_alive(record: JobRecord) -> bool:
    pid = record.watcher_pid
    return pid is not None and pid != 0 and procs.is_alive(pid, record.watcher_start)


# ---------------------------------------------------------------- a job's state


def evaluate(record: JobRecord) -> tuple[str, str, int | None, float | None]:
    """(state, detail, exit_code, ended_at) from /proc, the exit file and the watcher; terminal states stick."""
    info = record.info
    if info.state in TERMINAL:
        return info.state, record.detail, info.exit_code, info.ended_at
    if info.pid == 0:
        if time.time() - info.started_at > START_TIMEOUT_S:
            return "stale", "the start never completed (no leader PID was recorded)", None, None
        return "unknown", "starting", None, None
    stat = procs.read_stat(info.pid)
    if stat is not None and stat.running and stat.start_time == info.start_time_ticks:
        if record.detail.startswith(STOP_INCOMPLETE):
            return "running", record.detail, None, None
        lost = record.watcher_pid and not watcher_alive(record)
        return "running", WATCHER_LOST.format(pid=record.watcher_pid) if lost else "", None, None
    return _evaluate_ended(record, stat)


def _evaluate_ended(record: JobRecord, stat: procs.ProcStat | None) -> tuple[str, str, int | None, float | None]:
    """The state of a job whose leader no longer runs under its recorded identity."""
    info = record.info
    exit_code, ended_at = read_exit_file(info.job_dir)
    stop_at, stop_detail = record.stop_requested_at, record.detail
    if not stop_at:  # a stop that could not be written to jobs.db (a full disk) left its record in the job dir
        stop_at, slot_detail = read_stop_slot(info.job_dir)
        stop_detail = slot_detail or stop_detail
    if exit_code is not None:
        if not stop_at:
            return "exited", failure_detail(info, exit_code), exit_code, ended_at
        return "stopped", stop_detail, exit_code, ended_at
    if stat is not None and stat.running:
        return (
            "stale",
            (f"PID {info.pid} now belongs to another program (start time {stat.start_time}, recorded {info.start_time_ticks}); never signalled"),
            None,
            None,
        )
    if watcher_alive(record):
        return "running", "leader exiting; waiting for its exit status", None, None
    if stop_at:
        return "stopped", stop_detail or "stopped; exit status not recorded", None, stop_at
    why = "adopted, so its exit status is unknown" if info.adopted else "no exit status was recorded"
    return "stale", f"process {info.pid} is gone; {why}", None, None


# ---------------------------------------------------------------- a job's processes


def token_pids(table: procs.ProcTable, tokens: set[str]) -> dict[str, list[int]]:
    """Processes whose start environment carries a job token (same user only; one /proc/PID/environ read each)."""
    found: dict[str, list[int]] = {}
    if not tokens:
        return found
    my_uid = os.getuid()
    for pid, stat in table.stats.items():
        if not stat.running or (my_uid != 0 and procs.uid_of(pid) != my_uid):
            continue
        value = procs.environ_value(pid, JOB_TOKEN_ENV)
        if value in tokens:
            found.setdefault(value, []).append(pid)
    return found


def scan(records: list[JobRecord], recorded: dict[int, list[RecordedProc]], tokens: bool = False) -> Discovery:
    """One /proc scan plus what every plan needs: token holders, cgroup members, protected pids, every job's leader and watcher."""
    table = procs.ProcTable.scan()
    holders = token_pids(table, {r.token for r in records if r.token}) if tokens else {}
    cgroup_pids = {r.id: procs.cgroup_pids(r.cgroup) for r in records if procs.is_job_cgroup(r.cgroup)}
    roots = {pid: r.id for r in records for pid in (r.info.pid, r.watcher_pid) if pid}
    return Discovery(table, holders, protected_pids(), roots, cgroup_pids, recorded)


def plan_job(record: JobRecord, ctx: Discovery, proven: Iterable[Target] = ()) -> JobPlan:
    """Every live process provably belonging to this job; another job's leader or watcher ends a walk.

    Proof is any of: the verified leader, its group and (while the leader lives, pinning the number) its session;
    a descendant of the leader, of the live watcher or of any process proven here (`proven`: found earlier in this
    stop, identity checked again); a recorded descendant with its start time; the job token in the environment; the
    job's cgroup."""
    state, detail, _, _ = evaluate(record)
    plan = JobPlan(record, state)
    if state in ("stale", "unknown"):
        plan.stale_reason = detail or state
        return plan
    found = _Found(record, ctx)
    if state == "running" and ctx.table.alive(record.info.pid, record.info.start_time_ticks):
        plan.group_signal = found.leader_tree()
    for target in proven:
        if ctx.table.alive(target.pid, target.start):
            found.add(target.pid, target.role)
    found.beyond_leader()
    plan.targets = sorted(found.targets.values(), key=lambda t: (t.role != "leader", t.pid))
    plan.protected = sorted(found.protected.values(), key=lambda t: t.pid)
    return plan


class _Found:
    """The processes proven to be one job's so far, split into those a stop signals and those it must spare."""

    def __init__(self, record: JobRecord, ctx: Discovery):
        self.record, self.ctx, self.table = record, ctx, ctx.table
        self.others = {pid for pid, job_id in ctx.roots.items() if job_id != record.id}
        self.targets: dict[int, Target] = {}
        self.protected: dict[int, Target] = {}

    def add(self, pid: int, role: str | None = None) -> None:
        stat = self.table.stats.get(pid)
        if pid in self.targets or pid in self.protected or pid in self.others or pid == self.record.watcher_pid or not signallable(stat):
            return
        info = self.record.info
        role = role or ("group" if stat.pgid == info.pgid else "descendant")
        target = Target(pid, stat.start_time, stat.pgid, role, info.name, procs.cmdline(pid))
        (self.protected if pid in self.ctx.protected else self.targets)[pid] = target

    def leader_tree(self) -> bool:
        """The live leader, its group, descendants and session; returns whether the group may be signalled as one."""
        info, table = self.record.info, self.table
        self.add(info.pid, "leader")
        leader_pgid = table.stats[info.pid].pgid
        # An adopted process may share its group with a shell that is not ours: group-signal only a group it leads.
        group_signal = leader_pgid == info.pgid > 1 and (not info.adopted or info.pgid == info.pid)
        if group_signal:
            for pid in table.group(info.pgid):
                self.add(pid)
        for pid in table.descendants(info.pid, prune=self.others):
            self.add(pid)
        # A leader this tool started leads its own session: nobody outside the job can join it (an adopted one may
        # lead a login shell's session, so only its tree and group count)
        if table.stats[info.pid].sid == info.pid and not info.adopted:
            for pid in table.session(info.pid):
                self.add(pid, None if table.stats[pid].pgid == info.pgid else "session")
        return group_signal

    def beyond_leader(self) -> None:
        """The watcher's descendants, recorded processes, token holders, cgroup members, and every child of a proven process."""
        record, table, ctx = self.record, self.table, self.ctx
        if record.watcher_pid and table.alive(record.watcher_pid, record.watcher_start):
            for pid in table.descendants(record.watcher_pid, prune=self.others):
                self.add(pid)
        for seen in ctx.recorded.get(record.id, []):
            if table.alive(seen.pid, seen.start_time):
                self.add(seen.pid, seen.role)
        for pid in ctx.token_pids.get(record.token or "", []) + ctx.cgroup_pids.get(record.id, []):
            self.add(pid)
        for pid in table.descendants_of([*self.targets, *self.protected], prune=self.others):  # a child of a proven process is the job's
            self.add(pid)


def select_records(records: list[JobRecord], names: list[str] | None, all_jobs: bool) -> list[JobRecord]:
    if all_jobs:
        return records
    by_name = {record.name: record for record in records}
    missing = [name for name in names or [] if name not in by_name]
    if missing or not names:
        raise JobNotFound(f"no job named {', '.join(map(repr, missing)) or '(none given)'}; known: {', '.join(sorted(by_name)) or 'none'}")
    return [by_name[name] for name in dict.fromkeys(names)]  # a name given twice is stopped once


def job_plans(records: list[JobRecord], recorded: dict[int, list[RecordedProc]], names: list[str] | None, all_jobs: bool) -> list[JobPlan]:
    """The plans of the named jobs (or of every job with something to stop), from one scan over all active `records`."""
    selected = select_records(records, names, all_jobs)
    ctx = scan(records, recorded, tokens=True)
    plans = [plan_job(record, ctx) for record in selected]
    if all_jobs:
        plans = [plan for plan in plans if plan.targets or plan.protected or plan.state in ("stale", "unknown")]
    return plans


def owners(records: list[JobRecord], recorded: dict[int, list[RecordedProc]], candidates: Iterable[int] | None = None) -> dict[int, str]:
    """{pid: job name} for live processes of active jobs; candidates not found in a job tree are checked by token."""
    ctx = scan(records, recorded)
    found: dict[int, str] = {}
    for record in records:
        for target in plan_job(record, ctx).targets:
            found.setdefault(target.pid, record.name)
    tokens = {record.token: record.name for record in records if record.token and record.info.state != "stale"}
    for pid in candidates or []:
        if pid not in found and ctx.table.alive(pid):
            value = procs.environ_value(pid, JOB_TOKEN_ENV)
            if value in tokens:
                found[pid] = tokens[value]
    return found


# ---------------------------------------------------------------- escapees


def find_escapees(plans: list[JobPlan], verdicts: list[ProcessVerdict], records: list[JobRecord]) -> list[ProcessVerdict]:
    """After the kill: processes that still carry a trace of a stopped job but no proof. Named (the stop fails), never signalled.

    A trace is: stdout or stderr on the job's own log; an environment naming the job's directory without its token;
    the job's session or group number once its leader and watcher are gone (the number may be another program's
    by now). A process holding any job's token, a watcher, a job's leader, this stop and its parents are skipped."""
    if not plans:
        return []
    table = procs.ProcTable.scan()
    skip = protected_pids() | {pid for r in records for pid in (r.info.pid, r.watcher_pid) if pid}
    skip |= {t.pid for plan in plans for t in plan.targets + plan.protected}
    facts = {pid: _traces(pid) for pid, stat in table.stats.items() if pid not in skip and signallable(stat)}
    facts = {pid: fact for pid, fact in facts.items() if not (fact.env.get(JOB_TOKEN_ENV) or fact.env.get(WATCH_TOKEN_ENV))}
    found = []
    for plan in plans:
        note = _lost_watcher_note(plan.record)
        for pid, why in _job_traces(plan.record, table, facts).items():
            command = procs.cmdline(pid)
            detail = (
                f"job {plan.record.name}: NOT signalled: {'; '.join(why)}; but nothing proves it is the job's (outside its process tree,"
                f" session and cgroup, no job token){note}. Check it and end it by hand if it is: {command[:160]}"
            )
            plan.escaped.append(ProcessVerdict(pid, ESCAPED_ROLE, "survived", detail))
        if note:
            for verdict in verdicts:
                if verdict.pid == plan.record.info.pid and verdict.role in ("leader", "stale"):
                    verdict.detail += note
        if note and (plan.targets or plan.protected):  # it ran until this stop: what it detached may live on untraced
            plan.escaped.append(_unverified(plan.record))
        found += plan.escaped
    return found


def _unverified(record: JobRecord) -> ProcessVerdict:
    """The verdict for a running job whose watcher was killed: the stop cannot vouch that nothing escaped."""
    detail = (
        f"job {record.name}: its watcher (PID {record.watcher_pid}) died while the job ran (killed?), so processes the job"
        " detached since then may live on with nothing left that ties them to it: this stop cannot vouch that nothing of the"
        " job escaped. Look for them by hand (ps -eo pid,ppid,sid,lstart,args) and end what is yours"
    )
    return ProcessVerdict(record.watcher_pid or 0, WATCHER_ROLE, UNVERIFIED, detail)


def _lost_watcher_note(record: JobRecord) -> str:
    if not record.watcher_pid or watcher_alive(record) or read_exit_file(record.info.job_dir)[0] is not None:
        return ""
    return (
        f"; the job's watcher (PID {record.watcher_pid}) died before recording the job's exit (killed?), so a process the job"
        " detached after that could not be followed"
    )


def _job_traces(record: JobRecord, table: procs.ProcTable, facts: dict[int, Traces]) -> dict[int, list[str]]:
    info = record.info
    logs = {info.stdout_path: "stdout", info.stderr_path: "stderr"}
    leader = table.stats.get(info.pid)
    leader_gone = leader is None or (not leader.running and leader.start_time == info.start_time_ticks)  # a zombie leader is gone too
    numbers_free = info.pid > 1 and leader_gone and not (record.watcher_pid and table.alive(record.watcher_pid, record.watcher_start))
    found: dict[int, list[str]] = {}
    for pid, fact in facts.items():
        stat = table.stats[pid]
        why = [f"its {name} is the job's {logs[path]} log {path}" for name, path in fact.stdio.items() if path in logs]
        if fact.env.get("EAGLE3_JOB_DIR") == info.job_dir:
            why.append(f"its environment names the job's directory (EAGLE3_JOB_DIR={info.job_dir}) but lacks the job's token")
        if numbers_free and (stat.sid == info.pid or stat.pgid == info.pgid == info.pid):
            what = "session" if stat.sid == info.pid else "process group"
            why.append(f"it is in the {what} of the job's leader PID {info.pid}, which is gone, so that number may belong to another program by now")
        if why:
            found[pid] = why
    return found


def _traces(pid: int) -> Traces:
    return Traces(procs.stdio_files(pid), procs.environ_values(pid, TRACE_VARIABLES))
