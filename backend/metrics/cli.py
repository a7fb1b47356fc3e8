"""`eagle3-host metrics series`: a job's whole-history buckets from the same index the console reads (never the raw file whole)."""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

from backend.metrics.index import MetricsFeed
from backend.layout import INDEX_FILENAME, METRICS_FILENAME
from backend.safetext import say, visible
from backend.jobs.records import JobError
from backend.jobs.registry import JobRegistry

KEY_HELP = "train.loss | val.loss | lr | grad_norm | weight_norm | step_time | tokens | train.acc.0 | val.acc.K | val.ploss.K | weight_norm.MODULE"


def register(subparsers, parent: argparse.ArgumentParser) -> None:
    metrics = subparsers.add_parser("metrics", help="whole-history metrics of a job from its index")
    actions = metrics.add_subparsers(dest="metrics_action", metavar="ACTION", required=True)
    series = actions.add_parser("series", parents=[parent], help="buckets (min/max/first/last/count/non-finite) of one series over a step range")
    where = series.add_mutually_exclusive_group(required=True)
    where.add_argument("--job", help="a job of the run dir")
    where.add_argument("--file", type=Path, help="a metrics.jsonl anywhere (its index is kept beside it)")
    series.add_argument("--key", default="train.loss", help=KEY_HELP)
    series.add_argument("--from", dest="step_from", type=int, default=None, help="first step (default: the first recorded)")
    series.add_argument("--to", dest="step_to", type=int, default=None, help="last step (default: the last recorded)")
    series.add_argument("--points", type=int, default=200, help="at most this many buckets (1..4096, default 200)")
    series.add_argument("--log-x", action="store_true", help="log-spaced buckets (for a log-step axis)")
    series.add_argument("--json", action="store_true", help="print one JSON object")
    series.add_argument("--no-save", action="store_true", help="do not write the index beside the file")
    series.set_defaults(handler=cmd_series)


def metrics_path(args) -> Path:
    if args.file is not None:
        return args.file

    registry = JobRegistry(args.run_dir)
    try:
        return Path(registry.get(args.job).info.job_dir) / METRICS_FILENAME
    except JobError as exc:
        raise SystemExit(visible(f"eagle3-host metrics: {exc}")) from None
    finally:
        registry.close()


def cmd_series(args) -> int:
    if not 1 <= args.points <= 4096:
        say(f"eagle3-host metrics: --points must be 1..4096, got {args.points}; nothing was read", file=sys.stderr)
        return 2
    path = metrics_path(args)
    if not path.is_file():
        say(f"eagle3-host metrics: no metrics file at {path}", file=sys.stderr)
        return 1
    started = time.perf_counter()
    feed = MetricsFeed(path, path.with_name(INDEX_FILENAME), live_from_end=True)
    while feed.index_step():
        pass
    if not args.no_save:
        feed.save_sidecar()
    index = feed.index
    buckets = index.buckets(args.key, args.step_from, args.step_to, args.points, args.log_x)
    document = {
        "job": args.job or str(path),
        "key": args.key,
        "buckets": buckets,
        "total_records": index.total_records,
        "indexed_bytes": feed.indexed_offset,
        "file_bytes": feed.progress()["file_bytes"],
        "keys": index.keys(),
        "index": feed.sidecar_note,
        "seconds": round(time.perf_counter() - started, 4),
    }
    if args.key not in index.series:
        document["error"] = f"no series {args.key!r} in this run; it has: {', '.join(index.keys()) or 'none'}"
    if args.json:
        print(json.dumps(document, allow_nan=False))
    else:
        print_table(document)
    return 1 if "error" in document else 0


def print_table(document: dict[str, Any]) -> None:
    say(
        f"{document['job']} · {document['key']} · {document['total_records']} records · "
        f"{document['indexed_bytes']}/{document['file_bytes']} bytes indexed · index {document['index']}"
    )
    if "error" in document:
        say(document["error"])
        return
    say(f"{'steps':>21} {'min':>11} {'max':>11} {'first':>11} {'last':>11} {'count':>7} {'nan/inf':>7}")
    for b in document["buckets"]:
        cells = [_num(b[k]) for k in ("min", "max", "first", "last")]
        say(f"{b['step_lo']:>10}-{b['step_hi']:<10} {cells[0]:>11} {cells[1]:>11} {cells[2]:>11} {cells[3]:>11} {b['count']:>7} {b['nonfinite']:>7}")


def _num(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:.5g}" if math.isfinite(value) else str(value)
