"""`eagle3-host agent`: the JSON-lines agent on stdin/stdout, as the console starts it over SSH."""

from __future__ import annotations

import argparse

from backend.cli import fail
from backend.layout import STALL_AFTER_S


def register(subparsers, parent: argparse.ArgumentParser) -> None:
    agent = subparsers.add_parser("agent", parents=[parent], help="run the JSON-lines agent on stdin/stdout (what the console starts over SSH)")
    agent.add_argument("--interval", type=float, default=1.0)
    agent.add_argument("--data-dir", action="append", default=[], help="a data dir whose disk is reported (default: <run-dir>/data on another filesystem)")
    agent.add_argument(
        "--stall-after", type=float, default=STALL_AFTER_S, metavar="S", help=f"a rank silent this long is stalled (default {STALL_AFTER_S:g} s)"
    )
    agent.set_defaults(handler=cmd_agent)


def cmd_agent(args) -> int:
    from backend.agent.server import STALL_AFTER_MAX_S, run_agent  # deferred: the agent's modules take ~0.3 s to load, other commands need none of them

    if args.interval <= 0:
        return fail("--interval must be > 0", 2)
    if not 0 < args.stall_after <= STALL_AFTER_MAX_S:
        return fail(f"--stall-after must be in (0, {STALL_AFTER_MAX_S:g}] seconds", 2)
    return run_agent(args.run_dir, args.interval, args.data_dir, args.stall_after)
