"""`eagle3-host preflight` and `eagle3-host serve`: static draft checks, and launching a checked server."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from backend.serve.preflight import problems_text, run_preflight, resolve_draft_dir, target_config_file, PreflightReport, Problem
from backend.serve.acceptance import acceptance_lines

EXIT_OK, EXIT_PROBLEMS, EXIT_USAGE = 0, 1, 2


def register(subparsers, parent) -> None:
    pre = subparsers.add_parser(
        "preflight",
        parents=[parent],
        help="check a draft checkpoint against its target and the serving flags",
        description="Reads config.json and the safetensors header only; never modifies anything. "
        "Exit 0 when ok, 1 when problems were found, 2 on a usage error.",
    )
    pre.add_argument("draft", type=Path, help="draft checkpoint dir (or a training run dir: its latest checkpoint)")
    pre.add_argument("--target-config", required=True, type=Path, help="the target model's config.json (or its model dir)")
    pre.add_argument("--profile", help="profile whose [serve] flags are checked too (algorithm, dtype)")
    pre.add_argument("--json", action="store_true", help='print {"ok", "problems": [{"code","message","hint"}], ...}')
    pre.add_argument("--no-sglang", action="store_true", help="skip the target_support check (importing SGLang's model registry takes ~20 s)")
    pre.set_defaults(handler=handle_preflight)

    serve = subparsers.add_parser(
        "serve",
        parents=[parent],
        help="preflight, launch a speculative server as an owned job, run the canary",
        description="Refuses to launch when preflight finds problems (unless --force). Exit 0 on a green canary.",
    )
    serve.add_argument("--profile", required=True)
    serve.add_argument("--draft", type=Path, help="draft checkpoint (or run) dir; required unless --baseline")
    serve.add_argument(
        "--baseline", action="store_true", help="start the same target WITHOUT speculation (for `bench --baseline-url`): no preflight, no canary"
    )
    serve.add_argument("--engine", choices=["sglang", "reference"], help="default: the profile's [serve].engine")
    serve.add_argument("--port", type=int, help="default: the profile's port (sglang) or a free port (reference)")
    serve.add_argument("--host", default="127.0.0.1", help="address the server binds (default 127.0.0.1)")
    serve.add_argument(
        "--feed", choices=["aux", "last_hidden"], default="aux", help="reference engine only: last_hidden reproduces SGLang's silent 1 x H failure"
    )
    serve.add_argument(
        "--device", help="reference engine only: auto (default: cuda:0 when CUDA is available), cpu, cuda or cuda:N (CUDA: static KV cache, CUDA graphs)"
    )
    serve.add_argument("--target-config", help="target config.json (or model dir) for preflight (default: from the profile)")
    serve.add_argument("--job-name", help="owned job name (default serve-<profile>-<engine>)")
    serve.add_argument("--force", action="store_true", help="launch even when preflight reports problems")
    serve.add_argument("--max-new-tokens", type=int, default=128, help="tokens per canary request")
    serve.add_argument("--no-canary", action="store_true", help="stop after the server-info check")
    serve.add_argument("--dry-run", action="store_true", help='run preflight, print {"argv", "preflight"}; start nothing')
    serve.add_argument("--json", action="store_true")
    serve.set_defaults(handler=handle_serve)


def _load_profile(name: str):
    from backend.profiles import ProfileError, load_profile

    try:
        return load_profile(name)
    except ProfileError as exc:
        print(f"error: {exc}. Nothing was checked or started.", file=sys.stderr)
        return None


def handle_preflight(args) -> int:
    from backend.serve.sglang_args import build_sglang_argv

    args.target_config = target_config_file(args.target_config)
    if not args.target_config.is_file():
        print(f"error: --target-config {args.target_config} is neither a config.json nor a model dir holding one. Nothing was checked.", file=sys.stderr)
        return EXIT_USAGE
    argv = None
    if args.profile:
        profile = _load_profile(args.profile)
        if profile is None:
            return EXIT_USAGE
        argv = build_sglang_argv(profile, str(args.draft))
    report = run_preflight(args.draft, args.target_config, serving_argv=argv, check_sglang=not args.no_sglang)
    if args.json:
        print(json.dumps(report.to_dict(), indent=1))
    else:
        print("\n".join(problems_text(report)))
    return EXIT_OK if report.ok else EXIT_PROBLEMS


def handle_serve(args) -> int:
    from backend.serve import launch as launch_mod
    from backend.serve.sglang_args import build_sglang_argv

    profile = _load_profile(args.profile)
    if profile is None:
        return EXIT_USAGE
    engine = args.engine or profile.serve.engine
    if args.draft is None and not args.baseline:
        print("error: --draft is required (or --baseline for a non-speculative server). Nothing was started.", file=sys.stderr)
        return EXIT_USAGE
    if args.feed != "aux" and engine != "reference":
        print("error: --feed last_hidden exists only with --engine reference. Nothing was started.", file=sys.stderr)
        return EXIT_USAGE
    if args.device is not None and engine != "reference":
        print("error: --device exists only with --engine reference (SGLang places the model itself). Nothing was started.", file=sys.stderr)
        return EXIT_USAGE
    if engine == "reference":
        try:  # the profile's reference_args, checked by the server's parser before anything starts
            launch_mod.reference_argv(profile, None, 1, speculative=False)
        except ValueError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return EXIT_USAGE
    if args.dry_run and args.baseline:
        argv = launch_mod.build_argv(profile, None, engine, args.port or profile.serve.port, host=args.host, speculative=False, device=args.device)
        print(json.dumps({"argv": argv, "preflight": None}, indent=1))
        return EXIT_OK
    if args.dry_run:
        draft = str(resolve_draft_dir(args.draft.expanduser()))
        port = args.port or profile.serve.port
        argv = launch_mod.build_argv(profile, draft, engine, port, feed=args.feed, host=args.host, device=args.device)
        report = run_preflight(
            draft, launch_mod.target_config_for(profile, args.target_config), serving_argv=build_sglang_argv(profile, draft, port=port, host=args.host)
        )
        print(json.dumps({"argv": argv, "preflight": report.to_dict()}, indent=1))
        return EXIT_OK if report.ok else EXIT_PROBLEMS
    result = launch_mod.launch(
        profile,
        args.draft,
        engine=engine,
        port=args.port,
        run_dir=args.run_dir,
        job_name=args.job_name,
        feed=args.feed,
        force=args.force,
        target_config=args.target_config,
        max_new_tokens=args.max_new_tokens,
        host=args.host,
        run_canary=not args.no_canary,
        speculative=not args.baseline,
        device=args.device,
    )
    if args.json:
        print(json.dumps(result.to_dict(), indent=1))
    else:
        print(render(result, problems_text))
    return EXIT_OK if result.ok else EXIT_PROBLEMS


def render(result, problems_text) -> str:
    lines = [f"{result.state}: {result.message}", f"url: {result.url}", "argv: " + " ".join(result.argv)]
    if result.preflight and result.preflight["problems"]:
        report = PreflightReport(ok=False, problems=[Problem(**p) for p in result.preflight["problems"]])
        lines += list(problems_text(report))
    canary = result.canary
    if canary:
        lines.append(
            f"canary: accept length {canary['accept_length']}, server avg {canary['server_avg_accept_length']}, "
            f"tau-hat {canary['tau_hat']}, verdict {canary['verdict'].upper()}"
        )
        if canary.get("prompt_source"):
            lines.append(f"  prompts: {canary['prompt_source']}")
        lines += [f"  - {reason}" for reason in canary["reasons"]]
        if canary.get("acceptance"):
            lines += [f"  {line}" for line in acceptance_lines(canary["acceptance"])]
    for rank, cause in enumerate(result.causes, 1):
        evidence = f" [{cause['evidence']}]" if cause.get("evidence") else ""
        lines.append(f"  {rank}. {cause['cause']}{evidence}\n     check: {cause['check']}")
    lines += result.server_check
    lines += result.log_tail
    if result.gpu_release:
        lines.append(f"GPU memory: {result.gpu_release.get('note')}")
    return "\n".join(lines)
