"""What the canary judges per draft position for a draft, without a server: served acceptance with and without the requests' spread.

Decodes the first --num-prompts prompts of a `data prepare` / `data regenerate` dir's split (val: what the canary asks,
eval: what stop & bench's benchmark asks) through the target's chat template with our reference engine (greedy,
ignore-eos), keeps each request's histogram of drafts accepted per round, and judges them as the canary does
(backend/serve/acceptance.py) against the draft's own validation (val_acc, val_rounds from its config.json): once with
each row's request_se (the standard error over requests) and once with the binomial tolerance alone, as before
2026-12-05.

CPU:  python3 benchmarks/canary_positions.py --draft ours_draft --data regen --split val --num-prompts 8 \
        --max-new-tokens 64 --device cpu --out /tmp/canary_positions.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.bench_decode_speed import load_draft  # noqa: E402
from backend.bench.spec_settings import chat_prompt_ids  # noqa: E402
from backend.serve import acceptance  # noqa: E402
from backend.serve.reference.engine import correct_drafts_histogram  # noqa: E402
from backend.serve.reference.spec_decode import NO_EOS, SpecDecoder  # noqa: E402
from backend.train.conversations import PROMPT_SPLITS, split_prompts  # noqa: E402


def request_histograms(decoder: SpecDecoder, prompts: list[list[int]], max_new: int) -> list[tuple[int, int, list[int]]]:
    """(completion tokens, verify rounds, drafts accepted per round as a histogram) per prompt, as the reference server
    reports them (its own correct_drafts_histogram)."""
    requests = []
    for ids in prompts:
        result = decoder.generate(ids, max_new)
        requests.append((result.completion_tokens, result.verify_ct, correct_drafts_histogram(result.accepted_per_round)))
    return requests


def judged(requests: list[tuple[int, int, list[int]]], num_steps: int, val_acc: list[float], val_rounds) -> dict:
    """The canary's acceptance report, and the first break the binomial tolerance alone would have named."""
    report = acceptance.acceptance_report(requests, num_steps, val_acc, val_rounds=val_rounds)
    steps_only = [{key: value for key, value in row.items() if key != "request_se"} for row in report["per_position"]]
    rows, first = acceptance.compare_with_validation(steps_only, val_acc, acceptance.replayed_rounds(val_rounds, num_steps))
    keys = ("position", "conditional", "predicted", "steps_at_position", "request_se", "tolerance", "broken")
    return {
        "pooled": report["pooled"],
        "mean_of_request_means": report["mean_of_request_means"],
        "per_position": [{key: row.get(key) for key in keys} for row in report["per_position"]],
        "break_line": report["break_line"],
        "binomial_only_break_line": acceptance.break_line(first, rows),
        "requests": requests,
    }


def main(argv: list[str] | None = None) -> int:
    from backend.profiles import load_profile
    from backend.train.target import load_target

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--profile", default="smollm2-135m")
    parser.add_argument("--draft", required=True, help="an exported draft or checkpoint (its config.json holds val_acc, val_rounds)")
    parser.add_argument("--data", type=Path, required=True, help="a `data prepare` or `data regenerate` dir")
    parser.add_argument("--split", choices=sorted(PROMPT_SPLITS), default="val")
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--num-steps", type=int, default=3)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)

    val_acc, val_rounds = acceptance.checkpoint_validation(args.draft)
    if not val_acc:
        parser.error(f"{args.draft}: its config.json records no val_acc to judge against")
    device = torch.device(args.device)
    torch.set_grad_enabled(False)
    profile = load_profile(args.profile)
    target = load_target(profile, device=device, dtype=profile.serve.dtype if device.type == "cuda" else "float32")
    draft, aux, _label = load_draft(args.draft, profile, target, device)
    decoder = SpecDecoder(target.model, draft, aux, num_steps=args.num_steps, eos_token_id=NO_EOS)
    prompts = [chat_prompt_ids(target.tokenizer, messages, 1024) for messages in split_prompts(args.data, args.split, args.num_prompts)]
    report = {
        "draft": str(args.draft),
        "data": str(args.data),
        "split": args.split,
        "prompts": len(prompts),
        "max_new_tokens": args.max_new_tokens,
        "device": str(device),
        **judged(request_histograms(decoder, prompts, args.max_new_tokens), args.num_steps, val_acc, val_rounds),
    }
    for row in report["per_position"]:
        se = row["request_se"]
        print(
            f"position {row['position']}: served {row['conditional']:.3f} vs {row['predicted']:.3f} predicted over {row['steps_at_position']} steps; "
            f"request_se {'-' if se is None else f'{se:.3f}'}, tolerance {row['tolerance']:.3f}"
        )
    print(f"with the requests' spread: {report['break_line']}\nbinomial alone: {report['binomial_only_break_line']}")
    if args.out:
        args.out.write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
