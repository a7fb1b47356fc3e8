"""`eagle3-host` (= `python -m backend`): the host-side command line; each area registers its own subcommands and shares these output helpers."""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
from pathlib import Path
from typing import Any

from backend.protocol import to_dict
from backend.safetext import say, visible

# Modules that register subcommands. Each exposes register(subparsers, common_parent) and keeps
# heavy imports (torch, transformers) inside its handlers so `eagle3-host --help` stays fast.
COMMAND_MODULES = [
    "backend.host.cli",  # gpus, holders
    "backend.jobs.cli",  # job, torchrun-argv
    "backend.agent.cli",  # agent
    "backend.train.cli",  # train, extract, export, convert, build-tiny
    "backend.serve.cli",  # preflight, serve
    "backend.bench.cli",  # bench
    "backend.chain.cli",  # stop-and-bench, grok
    "backend.metrics.cli",  # metrics series
    "backend.train.data_cli",  # data prepare, data regenerate
    "backend.train.target_prepare",  # target prepare, target profile
]


def default_run_dir() -> Path:
    return Path(os.environ.get("EAGLE3_RUN_DIR") or "~/.eagle3").expanduser()


def common_parent() -> argparse.ArgumentParser:
    parent = argparse.ArgumentParser(add_help=False)
    parent.add_argument("--run-dir", type=Path, default=None, help=RUN_DIR_HELP)
    return parent


RUN_DIR_HELP = "where jobs.db, job logs and runs live (default: $EAGLE3_RUN_DIR, else ~/.eagle3); before or after the command"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="eagle3-host", description="EAGLE-3 host tools: GPUs, owned jobs, training, serving, benchmarks")
    parser.add_argument("--run-dir", dest="global_run_dir", type=Path, default=None, help=RUN_DIR_HELP)
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    parent = common_parent()
    for module_name in COMMAND_MODULES:
        importlib.import_module(module_name).register(subparsers, parent)
    return parser


def table(headers: list[str], rows: list[list[Any]]) -> str:
    cells = [[visible(value) for value in row] for row in rows]  # host text: escapes shown, one line per row
    widths = [max([len(header)] + [len(row[i]) for row in cells]) for i, header in enumerate(headers)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(headers, widths)).rstrip()]
    lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in cells]
    return "\n".join(lines)


def emit_json(data: Any) -> None:
    print(json.dumps(to_dict(data), indent=2))


def fail(message: str, code: int = 1) -> int:
    say(f"eagle3-host: {message}", file=sys.stderr)
    return code


def human_bytes(count: float) -> str:
    """A byte count for people: 512 B, 1.5 KiB ... 2.0 TiB (the host side's one byte formatter besides mib)."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(count) < 1024:
            return f"{count:.1f} {unit}" if unit != "B" else f"{int(count)} B"
        count /= 1024
    return f"{count:.1f} TiB"


def mib(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}"


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if hasattr(args, "run_dir") or args.global_run_dir is not None:
        args.run_dir = getattr(args, "run_dir", None) or args.global_run_dir or default_run_dir()
    try:
        return int(args.handler(args) or 0)
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        return 0


if __name__ == "__main__":
    sys.exit(main())
