"""`eagle3-host job start | list | plan | stop | adopt | tail`, `holders` and `torchrun-argv`: owned jobs from the command line."""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from typing import Any

from backend.cli import emit_json, fail, mib, table
from backend.commands import torchrun_train_argv
from backend.host import procs
from backend.host.gpu import open_gpu_source
from backend.host.holders import FuserOutputError, list_holders
from backend.jobs.logs import tail_lines
from backend.jobs.records import ESCAPED_ROLE, KINDS, UNVERIFIED, JobBadParams, JobError, JobNoSpace, JobRecord
from backend.jobs.registry import JobRegistry
from backend.layout import STALL_AFTER_S
from backend.protocol import StopPlan
from backend.safetext import say, visible

KIND_CHOICES = tuple(kind for kind in KINDS if kind != "adopted")  # an adopted job is registered, never started
OK_OUTCOMES = {"exited_on_term", "killed", "already_gone", "stale_not_signalled"}


def register(subparsers, parent: argparse.ArgumentParser) -> None:
    holders = subparsers.add_parser("holders", parents=[parent], help="processes holding a GPU, marked owned (a job's) or foreign")
    holders.add_argument("--json", action="store_true", help="print JSON")
    holders.set_defaults(handler=cmd_holders)
    _register_job(subparsers, parent)
    _register_torchrun_argv(subparsers, parent)


def _register_job(subparsers, parent: argparse.ArgumentParser) -> None:
    job = subparsers.add_parser("job", help="start, list, plan, stop, adopt and tail owned jobs")
    actions = job.add_subparsers(dest="job_command", metavar="ACTION", required=True)

    start = actions.add_parser("start", parents=[parent], help="start CMD as a job in its own session")
    start.add_argument("--name", required=True)
    start.add_argument("--kind", default="other", choices=KIND_CHOICES)
    start.add_argument("--cwd", default=None, help="working directory (default: the current one)")
    start.add_argument(
        "--node",
        nargs=4,
        metavar=("RUN_ID", "NODE_RANK", "NNODES", "HOST:PORT"),
        help="this host's part of a multi-node torchrun run (see eagle3-host torchrun-argv)",
    )
    start.add_argument("--json", action="store_true")
    start.add_argument("cmd", nargs=argparse.REMAINDER, help="-- CMD [ARGS...]")
    start.set_defaults(handler=cmd_job_start)

    listing = actions.add_parser("list", parents=[parent], help="all jobs of the run dir with their state")
    listing.add_argument("--json", action="store_true")
    listing.set_defaults(handler=cmd_job_list)

    for action, helptext, handler in (
        ("stop", "SIGTERM, grace period, freeze, SIGKILL; only processes proven to be the job's; exit 1 naming any that survive", cmd_job_stop),
        ("plan", "show exactly what stop would signal, without signalling", cmd_job_plan),
    ):
        sub = actions.add_parser(action, parents=[parent], help=helptext)
        which = sub.add_mutually_exclusive_group(required=True)
        which.add_argument("--name")
        which.add_argument("--all", action="store_true", help="every job of this run dir")
        if action == "stop":
            sub.add_argument("--grace", type=float, default=30.0, help="seconds between SIGTERM and SIGKILL (default 30)")
        sub.add_argument("--json", action="store_true")
        sub.set_defaults(handler=handler)

    adopt = actions.add_parser("adopt", parents=[parent], help="register a running process this tool did not start")
    adopt.add_argument("pid", type=int)
    adopt.add_argument("--name", required=True)
    adopt.add_argument("--yes", action="store_true", help="confirm: this PID is yours and may be signalled by job stop")
    adopt.add_argument("--other-user", action="store_true", help="root only: confirm adopting a process of another user")
    adopt.add_argument("--json", action="store_true")
    adopt.set_defaults(handler=cmd_job_adopt)

    tail = actions.add_parser("tail", parents=[parent], help="last lines of a job's stdout (or stderr)")
    tail.add_argument("name")
    tail.add_argument("--stderr", action="store_true")
    tail.add_argument("-n", type=int, default=20, help="how many lines (default 20)")
    tail.set_defaults(handler=cmd_job_tail)


def _register_torchrun_argv(subparsers, parent: argparse.ArgumentParser) -> None:
    node = subparsers.add_parser(
        "torchrun-argv",
        parents=[parent],
        help="print the command line one node of a multi-node training run starts (JSON list)",
        description="The torchrun command line for node NODE_RANK of NNODES running `eagle3-host train ARGS...`: "
        "static rendezvous on the first node's HOST:PORT, so global rank 0 (metrics, checkpoints) is on node 0.",
    )
    node.add_argument("--run-id", required=True)
    node.add_argument("--node-rank", type=int, required=True)
    node.add_argument("--nnodes", type=int, required=True)
    node.add_argument("--rdzv-endpoint", required=True, metavar="HOST:PORT")
    node.add_argument("--nproc-per-node", default="1", help="ranks on this node: a count, or gpu/cpu/auto (default 1)")
    node.add_argument("train", nargs=argparse.REMAINDER, help="-- train ARGS... (e.g. -- --profile tiny --max-steps 100)")
    node.set_defaults(handler=cmd_torchrun_argv)


def _registry(args) -> JobRegistry:
    return JobRegistry(args.run_dir)


def _job_errors(handler):
    """JobError -> message on stderr; exit 2 for bad parameters and a start refused for want of disk space, 1 for other failures."""

    def wrapped(args) -> int:
        try:
            return handler(args)
        except (JobBadParams, JobNoSpace) as exc:
            return fail(str(exc), 2)
        except JobError as exc:
            return fail(str(exc), 1)

    wrapped.__name__ = handler.__name__
    return wrapped


def cmd_torchrun_argv(args) -> int:
    rest = args.train[1:] if args.train[:1] == ["--"] else args.train
    rest = rest[1:] if rest[:1] == ["train"] else rest
    nproc = int(args.nproc_per_node) if args.nproc_per_node.isdigit() else args.nproc_per_node
    try:
        argv = torchrun_train_argv(
            ["eagle3-host", "train", *rest],
            run_id=args.run_id,
            node_rank=args.node_rank,
            nnodes=args.nnodes,
            rdzv_endpoint=args.rdzv_endpoint,
            nproc_per_node=nproc,
        )
    except ValueError as exc:
        return fail(str(exc), 2)
    print(json.dumps(argv))
    return 0


def _node_arg(values: list[str] | None) -> dict[str, Any] | None:
    if values is None:
        return None
    run_id, node_rank, nnodes, endpoint = values
    if not (node_rank.isdigit() and nnodes.isdigit()):
        raise JobBadParams(f"--node: NODE_RANK {node_rank!r} and NNODES {nnodes!r} must be whole numbers; nothing was started")
    return {"run_id": run_id, "node_rank": int(node_rank), "nnodes": int(nnodes), "rdzv_endpoint": endpoint}


@_job_errors
def cmd_job_start(args) -> int:
    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    if not cmd:
        return fail("job start needs a command after --, e.g. eagle3-host job start --name t -- python3 train.py", 2)
    info = _registry(args).start_job(args.name, args.kind, cmd, cwd=args.cwd, node=_node_arg(args.node))
    if args.json:
        emit_json(info)
    else:
        say(f"started job {info.name}: pid {info.pid} (group {info.pgid}); logs {info.stdout_path} and {info.stderr_path}")
    return 0


def _age(started_at: float) -> str:
    seconds = max(0, int(time.time() - started_at))
    return f"{seconds // 3600}h{seconds // 60 % 60:02d}m" if seconds >= 3600 else f"{seconds // 60}m{seconds % 60:02d}s"


@_job_errors
def cmd_job_list(args) -> int:
    records = _registry(args).list_records()
    if args.json:
        emit_json([record.to_wire(STALL_AFTER_S) for record in records])
        return 0
    if not records:
        say(f"no jobs in {args.run_dir}")
        return 0
    rows = [
        [
            r.name,
            r.info.kind,
            r.info.state,
            r.info.pid,
            "-" if r.info.exit_code is None else r.info.exit_code,
            _age(r.info.started_at),
            _node_column(r),
            " ".join(r.info.argv)[:60],
            r.detail,
        ]
        for r in records
    ]
    say(table(["NAME", "KIND", "STATE", "PID", "EXIT", "AGE", "NODE", "COMMAND", "DETAIL"], rows))
    return 0


def _node_column(record: JobRecord) -> str:
    """run-id node R/N, and which of this host's ranks are stalled; "-" for an ordinary job."""
    info = record.info
    if info.run_id is None:
        return "-"
    stalled = record.to_wire(STALL_AFTER_S)["stalled_ranks"]
    return f"{info.run_id} {info.node_rank}/{info.nnodes}" + (f" STALLED rank {','.join(map(str, stalled))}" if stalled else "")


def _plan_foreign(registry: JobRegistry) -> list[dict]:
    source = open_gpu_source(stream=False)
    try:
        report = list_holders(source, owner_lookup=registry.owned_pids)
    finally:
        source.close()
    return [{"pid": h.pid, "user": h.user, "cmdline": h.cmdline, "used_memory_mib": h.used_memory_mib} for h in report.foreign]


@_job_errors
def cmd_job_plan(args) -> int:
    registry = _registry(args)
    plan = registry.stop_plan([args.name] if args.name else None, args.all, foreign_holders=_plan_foreign(registry))
    if args.json:
        emit_json(plan)
        return 0
    print_plan(plan)
    return 0


def print_plan(plan: StopPlan) -> None:
    if plan.will_signal:
        say("will signal (SIGTERM to the group, SIGKILL after the grace period):")
        say(table(["PID", "JOB", "ROLE", "COMMAND"], [[w["pid"], w["job"], w["role"], w["cmdline"][:80]] for w in plan.will_signal]))
        for entry in plan.will_signal:
            if entry.get("state"):
                say(f"note: pid {entry['pid']} is {entry['state']}")
    else:
        say("nothing to signal")
    for stale in plan.stale:
        say(f"stale, NOT signalled: job {stale['job']} pid {stale['pid']}: {stale['reason']}")
    for holder in plan.foreign_gpu_holders:
        say(f"foreign GPU holder, left alone: pid {holder['pid']} user {holder['user']} {mib(holder['used_memory_mib'])} MiB: {holder['cmdline'][:80]}")
    if plan.checkpoint_first:
        say("a training job is among them: it writes a checkpoint on SIGTERM, so give it its grace period")
    if plan.checkpoint_note:
        say(f"no checkpoint: {plan.checkpoint_note}")


@_job_errors
def cmd_job_stop(args) -> int:
    if not math.isfinite(args.grace) or args.grace < 0:
        return fail(f"--grace {args.grace}: expected a finite number of seconds >= 0; nothing was signalled", 2)
    registry = _registry(args)
    source = open_gpu_source(stream=False)
    try:
        verdicts = registry.stop([args.name] if args.name else None, args.all, grace=args.grace, gpu_source=source)
    finally:
        source.close()
    if args.json:
        emit_json({"verdicts": verdicts, "unrecorded": registry.unrecorded()})
    elif verdicts:
        say(table(["PID", "ROLE", "OUTCOME", "DETAIL"], [[v.pid, v.role, v.outcome, v.detail] for v in verdicts]))
    else:
        say("no job processes to stop")
    for note in registry.unrecorded():
        say(f"eagle3-host: warning: signals were sent but not recorded: {note}", file=sys.stderr)
    escaped = [v for v in verdicts if v.role == ESCAPED_ROLE]
    unverified = [v for v in verdicts if v.outcome == UNVERIFIED]
    survivors = [v for v in verdicts if v.outcome not in OK_OUTCOMES and v not in escaped + unverified]
    for verdict in escaped:
        say(f"eagle3-host: PID {verdict.pid} may have escaped the stop: {visible(verdict.detail)}", file=sys.stderr)  # one line: a command's newlines shown
    for verdict in unverified:
        say(f"eagle3-host: {visible(verdict.detail)}", file=sys.stderr)
    if survivors or escaped or unverified:
        parts = [f"{len(survivors)} owned process(es) still alive after the stop: PID {', '.join(str(v.pid) for v in survivors)}"] if survivors else []
        if escaped:
            parts.append(f"{len(escaped)} process(es) escaped beyond proof and were NOT signalled: PID {', '.join(str(v.pid) for v in escaped)}")
        if unverified:
            parts.append(
                f"the stop cannot vouch for {len(unverified)} job(s) whose watcher was killed: watcher PID {', '.join(str(v.pid) for v in unverified)}"
            )
        return fail("; ".join(parts) + " (see OUTCOME/DETAIL above)")
    return 0


@_job_errors
def cmd_job_adopt(args) -> int:
    if not args.yes:
        command = procs.cmdline(args.pid) or "(no such process)"
        return fail(
            f"refusing to adopt PID {args.pid} without --yes. Adopting makes `job stop` signal it and its children; "
            f"check that it is yours ({command[:100]}) and run again with --yes. Nothing was adopted.",
            2,
        )
    info = _registry(args).adopt(args.pid, args.name, confirm_pid=args.pid, other_user=args.other_user)
    if args.json:
        emit_json(info)
    else:
        say(f"adopted PID {info.pid} as job {info.name} (group {info.pgid})")
    return 0


@_job_errors
def cmd_job_tail(args) -> int:
    if args.n < 0:
        return fail("-n must be >= 0", 2)
    record = _registry(args).get(args.name)
    path = record.info.stderr_path if args.stderr else record.info.stdout_path
    try:
        lines = tail_lines(path, args.n)
    except FileNotFoundError:
        return fail(f"job {args.name} has no log at {path}")
    raw = not sys.stdout.isatty()  # a copy of the log into a file or pipe stays exact; a terminal sees escapes, not their effect
    for line in lines:
        print(line if raw else visible(line, keep="\t"))
    return 0


def cmd_holders(args) -> int:
    registry = JobRegistry(args.run_dir)
    source = open_gpu_source(stream=False)
    try:
        report = list_holders(source, owner_lookup=registry.owned_pids)
    except FuserOutputError as exc:
        return fail(f"fuser output was not PIDs only, nothing reported: {exc}")
    finally:
        source.close()
    if args.json:
        emit_json(report.to_dict())
        return 0
    if report.holders:
        rows = [
            [
                h.pid,
                f"job {h.job}" if h.owned else "FOREIGN",
                h.user,
                ",".join(map(str, h.gpu_indices)) or "-",
                mib(h.used_memory_mib),
                "+".join(h.sources),
                h.cmdline[:80],
            ]
            for h in report.holders
        ]
        say(table(["PID", "OWNER", "USER", "GPUS", "MiB", "SEEN BY", "COMMAND"], rows))
    else:
        say("nobody holds a GPU")
    say(f"gpu source: {report.gpu_source}; fuser: {report.fuser.state} ({report.fuser.message}; {report.fuser.stderr_lines} stderr lines ignored)")
    return 0
