"""`eagle3-host stop-and-bench`, `grok`, `data-scaling`, `results`: the chains the console's keys run, headless."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from backend.bench.cli import concurrency_levels
from backend.cli import human_bytes
from backend.commands import (
    CHAIN_CONCURRENCY_DEFAULT,
    CHAIN_GRACE_DEFAULT_S,
    CHAIN_MAX_NEW_TOKENS_DEFAULT,
    CHAIN_PROMPTS_DEFAULT,
    GROK_WEIGHT_DECAY_DEFAULT,
    grok_argv,
    grok_job_name,
)
from backend.safetext import say
from backend.chain.run import ChainOptions, StopAndBench
from backend.jobs.records import JobError, JobNotFound
from backend.jobs.registry import JobRegistry
from backend.serve.preflight import resolve_draft_dir
from backend.commands import data_dir_for, profile_shape
from backend.host.datascale import data_scaling
from backend.layout import list_results


def register(subparsers, parent) -> None:
    chain = subparsers.add_parser(
        "stop-and-bench",
        parents=[parent],
        help="stop training with a checkpoint, serve it, canary, benchmark",
        description="Graceful stop of the owned training job -> GPU memory released -> preflight of the latest "
        "checkpoint -> launch -> ready -> canary -> benchmark -> result saved with the run.",
    )
    chain.add_argument("--job", required=True, help="name of the owned training job")
    chain.add_argument("--profile", help="profile (default: the --profile of the job's command line)")
    chain.add_argument("--engine", choices=["sglang", "reference"], help="default: the profile's serve.engine")
    chain.add_argument("--grace", type=float, default=CHAIN_GRACE_DEFAULT_S, help="seconds the trainer gets to checkpoint and exit")
    chain.add_argument("--port", type=int)
    chain.add_argument("--keep-on-red", action="store_true", help="keep the server running when the canary is red")
    chain.add_argument("--stop-server-after", action="store_true", help="stop the server once the benchmark is saved")
    chain.add_argument("--concurrency", type=concurrency_levels, default=concurrency_levels(CHAIN_CONCURRENCY_DEFAULT))
    chain.add_argument("--num-prompts", type=int, default=CHAIN_PROMPTS_DEFAULT)
    chain.add_argument("--max-new-tokens", type=int, default=CHAIN_MAX_NEW_TOKENS_DEFAULT)
    chain.add_argument("--stages-file", type=Path, help="default: $EAGLE3_JOB_DIR/stages.jsonl when run as a job")
    chain.add_argument("--json", action="store_true", help="print each stage and the result as JSON lines")
    chain.set_defaults(handler=handle_stop_and_bench)

    grok = subparsers.add_parser(
        "grok",
        parents=[parent],
        help="start a grokking run: resume a checkpoint with a constant LR as a new owned job",
        description="Resumes CKPT (its d2t/t2d are reused) with a constant learning rate, weight decay and an optional "
        "Grokfast filter, as a new owned training job.",
    )
    grok.add_argument("--profile", required=True)
    grok.add_argument("--from", dest="checkpoint", required=True, type=Path, help="checkpoint dir, or a run dir (uses latest)")
    grok.add_argument("--name", help="job name (default: grok-<checkpoint name>)")
    grok.add_argument("--lr", type=float, required=True, help="constant learning rate (not decayed)")
    grok.add_argument("--weight-decay", type=float, default=GROK_WEIGHT_DECAY_DEFAULT)
    grok.add_argument("--grokfast-alpha", type=float, help="enable Grokfast-EMA with this alpha (e.g. 0.98)")
    grok.add_argument("--max-steps", type=int)
    grok.add_argument("--json", action="store_true")
    grok.set_defaults(handler=handle_grok)

    scaling = subparsers.add_parser("data-scaling", parents=[parent], help="bytes per sample, free disk, samples that fit")
    scaling.add_argument("--data", type=Path, help="an `extract` output dir (measured); without it, estimated from the profile")
    scaling.add_argument("--profile", default="tiny")
    scaling.add_argument("--json", action="store_true")
    scaling.set_defaults(handler=handle_data_scaling)

    results = subparsers.add_parser("results", parents=[parent], help="saved stop-and-bench results of a training job")
    results.add_argument("--job", required=True)
    results.add_argument("--json", action="store_true")
    results.set_defaults(handler=handle_results)


def _print_stage(record: dict, as_json: bool) -> None:
    if as_json:
        print(json.dumps(record, default=str), flush=True)
        return
    mark = {"running": "..", "ok": "ok", "failed": "!!", "skipped": "--"}.get(record["status"], "  ")
    elapsed = f" ({record['elapsed']:.1f}s)" if record["status"] != "running" else ""
    detail = f": {record['detail']}" if record.get("detail") else ""
    say(f"[{mark}] {record['stage']:<10} {record['status']}{elapsed}{detail}", flush=True)


def handle_stop_and_bench(args) -> int:

    options = ChainOptions(
        job=args.job,
        run_dir=Path(args.run_dir).expanduser(),
        profile=args.profile,
        engine=args.engine,
        grace_s=args.grace,
        port=args.port,
        keep_on_red=args.keep_on_red,
        stop_server_after=args.stop_server_after,
        concurrency=args.concurrency,
        num_prompts=args.num_prompts,
        max_new_tokens=args.max_new_tokens,
        stages_path=args.stages_file,
    )
    summary = StopAndBench(options, on_stage=lambda record: _print_stage(record, args.json)).run()
    if args.json:
        print(json.dumps({"type": "summary", **summary}, default=str), flush=True)
    elif summary.get("ok"):
        result = summary["result"]
        say(
            f"verdict {result['verdict']}: accept length {result['accept_length']:.2f} vs tau-hat "
            f"{result['tau_hat'] or float('nan'):.2f}; checkpoint {result['checkpoint']}; saved {summary['saved_to']}"
        )
    else:
        say(f"stop-and-bench failed at {summary.get('failed_stage')}: {summary.get('reason')}", file=sys.stderr)
    return 0 if summary.get("ok") else 1


def handle_grok(args) -> int:

    checkpoint = resolve_draft_dir(args.checkpoint.expanduser())
    if not (checkpoint / "config.json").is_file():
        say(f"grok: {args.checkpoint} is not a checkpoint (no config.json, no checkpoints/latest). Nothing was started.", file=sys.stderr)
        return 2
    name = args.name or grok_job_name(str(checkpoint))
    argv = grok_argv(args.profile, str(checkpoint), args.lr, args.weight_decay, args.grokfast_alpha, args.max_steps)
    try:
        job = JobRegistry(Path(args.run_dir).expanduser()).start_job(name, "train", argv)
    except JobError as exc:
        say(f"grok: {exc}. Nothing was started.", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps({"job": vars(job), "argv": argv}, default=str))
    else:
        say(
            f"started grokking run {name!r} (pid {job.pid}) from {checkpoint}: constant lr {args.lr:g}, "
            f"weight decay {args.weight_decay:g}" + (f", Grokfast alpha {args.grokfast_alpha:g}" if args.grokfast_alpha else "")
        )
    return 0


def handle_data_scaling(args) -> int:
    from backend.profiles import ProfileError, load_profile

    try:
        profile = load_profile(args.profile)
        data_dir = args.data or data_dir_for(profile.paths.data_dir, profile.paths.run_dir, getattr(args, "run_dir", None))
        report = data_scaling(data_dir, profile_shape(profile))
    except (ProfileError, ValueError, OSError, json.JSONDecodeError) as exc:
        say(f"data-scaling: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(report))
        return 0
    say(f"{report['kind']}: {human_bytes(report['bytes_per_sample'] or 0)} per sample at {report['path']}")
    free, keep = human_bytes(report["free_bytes"]), human_bytes(report["keep_free_bytes"])
    say(f"free {free} (keeping {keep} free): {report['more_samples_fit']} more samples fit")
    if report.get("estimated_seconds_for_fit"):
        say(f"extracting them takes about {report['estimated_seconds_for_fit'] / 3600:.1f} h at the measured speed")
    return 0


def handle_results(args) -> int:

    try:
        record = JobRegistry(Path(args.run_dir).expanduser()).get(args.job)
    except JobNotFound:
        say(f"results: no job named {args.job!r}", file=sys.stderr)
        return 2
    rows = list_results(record.info.job_dir)
    if args.json:
        print(json.dumps(rows, default=str))
        return 0
    for row in rows:
        say(
            f"{Path(row['path']).name}: {row.get('verdict')} accept {row.get('accept_length') or 0:.2f} "
            f"tau-hat {row.get('tau_hat') or 0:.2f} checkpoint {Path(str(row.get('checkpoint'))).name}"
        )
    return 0
