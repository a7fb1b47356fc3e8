"""`eagle3-host gpus | holders`: the host-side commands for GPUs and the processes holding them."""

from __future__ import annotations

import argparse

from backend.cli import emit_json, fail, mib, table
from backend.host.gpu import GpuParseError, driver_state, open_gpu_source
from backend.host.holders import FuserOutputError, list_holders
from backend.jobs.registry import JobRegistry
from backend.safetext import say


def register(subparsers, parent: argparse.ArgumentParser) -> None:
    gpus = subparsers.add_parser("gpus", parents=[parent], help="GPU memory, utilization, temperature, power and compute processes")
    gpus.add_argument("--json", action="store_true", help="print JSON")
    gpus.set_defaults(handler=cmd_gpus)

    holders = subparsers.add_parser("holders", parents=[parent], help="processes holding a GPU, marked owned (a job's) or foreign")
    holders.add_argument("--json", action="store_true", help="print JSON")
    holders.set_defaults(handler=cmd_holders)


def cmd_gpus(args) -> int:
    source = open_gpu_source(stream=False)
    try:
        samples = source.sample()
    except (GpuParseError, OSError) as exc:
        return fail(f"reading GPUs through {source.name} failed: {exc}")
    finally:
        source.close()
    state = driver_state(source)
    if args.json:
        emit_json({"gpus": samples, "driver": state})
        return 0
    say(f"source: {state['source']}  driver: {state['driver'] or '-'}  ({state['message']})")
    if not samples:
        say("no GPUs to show")
        return 0
    rows = [
        [
            s.index,
            s.name,
            f"{mib(s.memory_used_mib)} / {mib(s.memory_total_mib)}",
            _pct(s.utilization_pct),
            _unit(s.temperature_c, "C"),
            _unit(s.power_w, "W"),
            " ".join(f"{p.pid}:{mib(p.used_memory_mib)}" for p in s.processes) or "-",
        ]
        for s in samples
    ]
    say(table(["GPU", "NAME", "MEM MiB", "UTIL", "TEMP", "POWER", "PROCESSES pid:MiB"], rows))
    return 0


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}%"


def _unit(value: float | None, unit: str) -> str:
    return "-" if value is None else f"{value:.0f}{unit}"


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
