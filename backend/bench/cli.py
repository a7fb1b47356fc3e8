"""`eagle3-host bench`: benchmark an SGLang-compatible server (optionally against a non-speculative baseline)."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path


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
        help="benchmark a server: tok/s, accept length, TTFT, ITL, speedup",
        description="Greedy streaming benchmark over a prompt set at several concurrency levels.",
    )
    parser.add_argument("--url", required=True, help="server base URL, e.g. http://127.0.0.1:30000")
    parser.add_argument("--prompts", type=Path, help="JSONL with {prompt}|{text}|{conversations} per line (default: shipped set)")
    parser.add_argument("--tag", help="only prompts with this tag from the prompt file (the shipped set has chat, code)")
    parser.add_argument("--num-prompts", type=int, help="use only the first N prompts")
    parser.add_argument("--chat-template", metavar="MODEL_DIR", help="wrap each prompt in this tokenizer's chat template (as the draft saw chats in training)")
    parser.add_argument("--concurrency", type=concurrency_levels, default=[1, 4, 16], help="levels, e.g. 1,4,16 (default)")
    parser.add_argument("--baseline-url", help="a non-speculative server of the same target, for the speedup")
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--out", type=Path, help="result file (default: RUN_DIR/benchmarks/bench-<time>.json)")
    parser.add_argument("--json", action="store_true", help="print the result document as JSON")
    parser.set_defaults(handler=handle_bench)


async def run(args) -> dict:
    from backend.bench import client, results
    from backend.serve.prompts import load_prompts

    prompts = load_prompts(args.prompts, tag=args.tag, limit=args.num_prompts)
    if args.chat_template:
        prompts = client.templated(prompts, args.chat_template)
    started = time.time()
    url = args.url.rstrip("/")
    info, levels = await client.run_server(url, prompts.prompts, args.concurrency, args.max_new_tokens)
    baseline_info = baseline_levels = None
    if args.baseline_url:
        baseline_info, baseline_levels = await client.run_server(args.baseline_url.rstrip("/"), prompts.prompts, args.concurrency, args.max_new_tokens)
    return results.build_document(
        url=url,
        server_info=info,
        levels=levels,
        prompts=prompts,
        max_new_tokens=args.max_new_tokens,
        concurrency=args.concurrency,
        baseline_url=args.baseline_url,
        baseline_info=baseline_info,
        baseline_levels=baseline_levels,
        started_at=started,
    )


def handle_bench(args) -> int:
    import asyncio  # here, not at the top: every `eagle3-host` command builds this parser

    from backend.bench import client, results
    from backend.serve.prompts import PromptFileError

    try:
        document = asyncio.run(run(args))
    except (PromptFileError, client.TemplateError) as exc:
        print(f"bench: {exc}. Nothing was sent.", file=sys.stderr)
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
    failed = sum(level["failed"] for level in document["levels"])
    total = sum(level["requests"] for level in document["levels"])
    if failed:
        print(f"bench: {failed} of {total} requests failed; first: {document['levels'][0]['errors'][:1]}", file=sys.stderr)
    return 1 if failed == total else 0
