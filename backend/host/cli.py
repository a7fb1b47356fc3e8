"""`eagle3-host gpus`: the host's GPUs as its driver reports them (`holders` needs the job registry: backend/jobs/cli.py)."""

from __future__ import annotations

import argparse

from backend.cli import emit_json, fail, mib, table
from backend.host.gpu import GpuParseError, driver_state, open_gpu_source
from backend.safetext import say


def register(subparsers, parent: argparse.ArgumentParser) -> None:
    gpus = subparsers.add_parser("gpus", parents=[parent], help="GPU memory, utilization, temperature, power and compute processes")
    gpus.add_argument("--json", action="store_true", help="print JSON")
    gpus.set_defaults(handler=cmd_gpus)


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
