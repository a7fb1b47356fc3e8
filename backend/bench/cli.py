"""`eagle3-host bench` (an SGLang-compatible server over eval sets, against plain decoding) and `spec-settings` (a draft's accept length per speculative setting, no server)."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from backend.serve.prompts import PromptFileError


def concurrency_levels(text: str) -> list[int]:
    """argparse type for --concurrency: comma-separated positive integers."""
    try:
        levels = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--concurrency {text!r}: expected comma-separated integers like 1,4,16") from None
    if not levels or min(levels) < 1:
        raise argparse.ArgumentTypeError(f"--concurrency {text!r}: levels must be >= 1")
    return levels


def register(subparsers, parent) -> None:
    parser = subparsers.add_parser(
        "bench",
        parents=[parent],
        help="benchmark a server: tok/s, accept length, TTFT, ITL, speedup over plain decoding",
        description="Greedy streaming benchmark over one or more eval sets at several concurrency levels, against a baseline.",
    )
    parser.add_argument("--url", required=True, help="server base URL, e.g. http://127.0.0.1:30000")
    add_eval_set_options(parser)
    parser.add_argument("--chat-template", metavar="MODEL_DIR", help="wrap each prompt in this tokenizer's chat template (as the draft saw chats in training)")
    parser.add_argument("--concurrency", type=concurrency_levels, default=[1, 4, 16], help="levels, e.g. 1,4,16 (default)")
    parser.add_argument(
        "--baseline",
        metavar="same-engine|URL|none",
        help="what the speed-up is measured against: plain decoding asked per request of the same server (the reference engine "
        "offers it), a non-speculative server of the same target, or nothing (default: same-engine where the server offers "
        "it, else none)",
    )
    parser.add_argument("--baseline-url", help="a non-speculative server of the same target (the same as --baseline URL)")
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument(
        "--stop-at-eos",
        action="store_true",
        help="end every request, on both sides, at the target's end of turn: the accept length and speed of whole answers, as "
        "SpecForge's benchmarker and SGLang's MT-bench script measure them (with --max-new-tokens 2048 there); default: "
        "ignore_eos, every request exactly --max-new-tokens",
    )
    parser.add_argument("--out", type=Path, help="result file (default: RUN_DIR/benchmarks/bench-<time>.json)")
    parser.add_argument("--json", action="store_true", help="print the result document as JSON")
    parser.set_defaults(handler=handle_bench)
    register_spec_settings(subparsers, parent)


def add_eval_set_options(parser) -> None:
    """--prompts, --tag, --num-prompts: the eval sets `bench` and `spec-settings` read."""
    parser.add_argument(
        "--prompts",
        action="append",
        metavar="[NAME=]PATH",
        help="an eval set (repeat for several): a JSONL file with {prompt}|{text}|{conversations} per line, a `data prepare` "
        "output dir (its held-out eval.jsonl), or `humaneval` (HumanEval's 164 prompts); NAME defaults to the file's stem "
        "(default: the shipped set)",
    )
    parser.add_argument("--tag", help="only prompts with this tag from JSONL sets (the shipped set has chat, code)")
    parser.add_argument("--num-prompts", type=int, help="use only the first N prompts of each set")


def register_spec_settings(subparsers, parent) -> None:
    from backend.bench.spec_settings import DEFAULT_SETTINGS

    parser = subparsers.add_parser(
        "spec-settings",
        parents=[parent],
        help="a draft's accept length at SGLang's speculative settings (steps, topk, draft tokens), replayed without a server",
        description="Decode each prompt once with the target (greedy), replay every setting's rounds with the draft (SGLang's "
        "tree of top-k beams), and report the accept length per setting against the first one. CPU or GPU; no SGLang.",
    )
    parser.add_argument("--profile", required=True, help="the target's profile (its [target] is loaded)")
    parser.add_argument("--draft", required=True, help="the draft: a checkpoint, a run dir (its latest checkpoint) or an exported dir")
    add_eval_set_options(parser)
    parser.add_argument(
        "--settings",
        action="append",
        metavar="STEPS,TOPK,TOKENS",
        help=f"settings to replay, space-separated or repeated; STEPS,1 is a chain; the first is the baseline (default: {' '.join(DEFAULT_SETTINGS)})",
    )
    parser.add_argument("--max-new-tokens", type=int, default=128, help="tokens decoded per prompt (end of turn ignored)")
    parser.add_argument("--max-prompt-tokens", type=int, default=1024, help="a longer prompt keeps its last N tokens")
    parser.add_argument("--device", help="cpu, cuda, cuda:N (default: cuda where there is one)")
    parser.add_argument("--dtype", help="the target's dtype (default: the profile's [serve] dtype on CUDA, float32 on CPU)")
    parser.add_argument("--out", type=Path, help="result file (default: RUN_DIR/benchmarks/spec-settings-<time>.json)")
    parser.add_argument("--json", action="store_true", help="print the result document as JSON")
    parser.set_defaults(handler=handle_spec_settings)


def baseline_choice(args) -> str | None:
    from backend.bench.client import BaselineError

    if args.baseline and args.baseline_url and args.baseline != args.baseline_url:
        raise BaselineError(f"--baseline {args.baseline} and --baseline-url {args.baseline_url} disagree; give one")
    return args.baseline or args.baseline_url


def eval_sets(args):
    from backend.bench import client, eval_sets

    specs = [eval_sets.parse_spec(text) for text in args.prompts] if args.prompts else [eval_sets.default_spec()]
    sets = eval_sets.load_eval_sets(specs, tag=args.tag, limit=args.num_prompts)
    if getattr(args, "chat_template", None):
        sets = [eval_sets.EvalSet(s.name, client.templated(s.prompts, args.chat_template)) for s in sets]
    return sets


def admitted_sets(sets, url: str, info: dict, args) -> list:
    """Each set without the prompts the server's context cannot hold with --max-new-tokens (a request it would answer
    with HTTP 400), counted with the tokenizer the prompts were templated with, else the server's own where its
    tokenizer_path is a directory here; as they are when neither the context nor a tokenizer is known. A set left
    empty is refused."""
    from backend.bench import eval_sets as sets_mod
    from backend.serve.prompts import admitted, served_prompt_fit

    fit = served_prompt_fit(url, args.max_new_tokens)
    tokenizer_dir = getattr(args, "chat_template", None) or info.get("tokenizer_path")
    if fit is None or not tokenizer_dir or not Path(tokenizer_dir).expanduser().is_dir():
        return sets
    from backend.train.target import load_tokenizer

    tokenizer = load_tokenizer(str(Path(tokenizer_dir).expanduser()))
    kept = []
    for eval_set in sets:
        prompts, skipped = admitted(eval_set.prompts, lambda text: len(tokenizer.encode(text)), fit)
        if skipped:
            print(f"bench: set {eval_set.name}: {fit.describe(skipped)}; {len(prompts.prompts)} asked", file=sys.stderr)
        if not prompts.prompts:
            raise PromptFileError(f"set {eval_set.name}: every prompt is longer than the server admits ({fit.describe(skipped)})")
        kept.append(sets_mod.EvalSet(eval_set.name, prompts))
    return kept


async def run(args) -> dict:
    from backend.bench import client, results

    sets = eval_sets(args)
    started = time.time()
    url = args.url.rstrip("/")
    info = await client.fetch_server_info(url)
    baseline = client.resolve_baseline(baseline_choice(args), info)
    sets = admitted_sets(sets, url, info, args)
    baseline_info = await client.fetch_server_info(baseline.url) if baseline.mode == client.BASELINE_URL and baseline.url else None
    runs = []
    for eval_set in sets:
        levels, baseline_levels = await client.measure_set(
            url, baseline, eval_set.prompts.prompts, args.concurrency, args.max_new_tokens, stop_at_eos=args.stop_at_eos
        )
        runs.append(results.SetRun(eval_set.name, eval_set.prompts, levels, baseline_levels))
    return results.build_document(
        url=url,
        server_info=info,
        sets=runs,
        max_new_tokens=args.max_new_tokens,
        concurrency=args.concurrency,
        baseline=baseline,
        baseline_info=baseline_info,
        started_at=started,
        stop_at_eos=args.stop_at_eos,
    )


def handle_spec_settings(args) -> int:
    from backend.bench import results, spec_settings
    from backend.profiles import ProfileError
    from backend.train.checkpoint import CheckpointError

    if args.max_new_tokens < 1 or args.max_prompt_tokens < 1:
        print("spec-settings: --max-new-tokens and --max-prompt-tokens must be at least 1. Nothing was measured.", file=sys.stderr)
        return 2
    try:
        spec_settings.parse_settings(args.settings or list(spec_settings.DEFAULT_SETTINGS))
        sets = eval_sets(args)
        document = spec_settings.run(args, sets)
    except (spec_settings.SettingsError, PromptFileError, ProfileError, CheckpointError) as exc:
        print(f"spec-settings: {exc}. Nothing was measured.", file=sys.stderr)
        return 2
    path = args.out or results.default_path(Path(args.run_dir).expanduser(), document["time"], kind="spec-settings")
    document["saved_to"] = str(path)
    results.save(document, path)
    print(json.dumps(document, indent=1) if args.json else spec_settings.table(document) + f"\nsaved {path}")
    return 0


def handle_bench(args) -> int:
    import asyncio  # here, not at the top: every `eagle3-host` command builds this parser

    from backend.bench import client, results

    try:
        document = asyncio.run(run(args))
    except (PromptFileError, client.TemplateError, client.BaselineError) as exc:
        print(f"bench: {exc}. Nothing was measured.", file=sys.stderr)
        return 2
    except ConnectionError as exc:
        print(f"bench: {exc}. Is the server up? Nothing was measured or saved.", file=sys.stderr)
        return 1
    path = args.out or results.default_path(Path(args.run_dir).expanduser(), document["time"])
    document["saved_to"] = str(path)
    results.save(document, path)
    if args.json:
        print(json.dumps(document, indent=1))
    else:
        print(results.table(document))
        print(f"saved {path}")
    failed, total = results.request_counts(document)
    if failed:
        print(f"bench: {failed} of {total} requests failed; first: {results.first_error(document)}", file=sys.stderr)
    return 1 if failed == total else 0
