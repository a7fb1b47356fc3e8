#!/usr/bin/env python3
"""A draft's accept length on many prompts per eval set, with its sampling error: how far a 10-prompt number can be trusted.

Each prompt is decoded by our reference engine (the eager SpecDecoder, greedy, ignore-eos unless --stop-at-eos,
--max-new-tokens) at --num-steps; per set it reports the pooled accept length (SGLang's) and the mean of request means (SpecForge's) with a
bootstrap 95 % interval over prompts, the pooled accept length of the answers alone (rounds that start before the
first end of turn: what a run that stops there serves), the spread of the mean over random subsets of --subset
prompts (the serve phase's 10), and the draft's teacher-forced step-0 hits on the served tokens (bench_decode_speed's
acceptance_anatomy: every row, before the first end of turn, at round starts, and validation's replay of the same
tokens), and the tokens a round by where in the answer the round starts (0-63, 64-127, 128-255, 256-511, 512-)
beside the share of those tokens that repeat an earlier 8-gram of the answer (loops a small greedy target falls into).
Pass the regenerated val conversations as a set to compare with what validation measured: read as prompts,
their last answer is dropped and the target answers it again.

CPU:  python3 benchmarks/bench_accept_length.py --device cpu --draft DRAFT --prompts sgdev/eval.jsonl \
        --prompts regen/val.jsonl --num-prompts 200 --out /tmp/accept.json
Whole answers, as a chat serves them: --max-new-tokens 512 --stop-at-eos
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.bench_decode_speed import acceptance_anatomy, load_draft, read_prompt_file  # noqa: E402
from backend.bench.spec_settings import chat_prompt_ids  # noqa: E402
from backend.repetition import repeated_positions  # noqa: E402
from backend.serve.acceptance import bootstrap_interval, mean_of_request_means, pooled_accept_length  # noqa: E402
from backend.serve.reference.spec_decode import FEEDS, NO_EOS, SpecDecoder, eos_ids  # noqa: E402


def answer_part(result, eos: set[int]) -> tuple[int, int]:
    """(tokens up to and including the first end of turn, verify rounds that started before it): the accept length of
    the answer itself, as a run that stops at the end of turn serves it (the first token is the prefill's, as in
    completion_tokens / verify_ct)."""
    output = list(result.output_ids)
    tokens = next((j + 1 for j, token in enumerate(output) if token in eos), len(output))
    rounds, start = 0, 1
    for accepted in result.accepted_per_round:
        if start >= tokens:
            break
        rounds += 1
        start += accepted + 1
    return tokens, rounds


ANSWER_BINS = (0, 64, 128, 256, 512)  # where in the answer a verify round starts: the lower edges of the bins


def _bin_of(position: int) -> int:
    return max(i for i, edge in enumerate(ANSWER_BINS) if position >= edge)


def by_answer_position(results, eos: set[int]) -> list[dict]:
    """Tokens a round per bin of where the round starts in the answer (before the first end of turn): whether the
    first tokens of an answer, which a short benchmark serves, are harder for the draft than the rest; and the
    share of the bin's tokens that repeat an earlier 8-gram of the answer (repeated_share)."""
    rounds = [0] * len(ANSWER_BINS)
    tokens = [0] * len(ANSWER_BINS)
    answer_tokens = [0] * len(ANSWER_BINS)
    repeats = [0] * len(ANSWER_BINS)
    for result in results:
        end, _ = answer_part(result, eos)
        for position, repeated in enumerate(repeated_positions(list(result.output_ids)[:end])):
            slot = _bin_of(position)
            answer_tokens[slot] += 1
            repeats[slot] += repeated
        start = 1  # the first token is the prefill's
        for accepted in result.accepted_per_round:
            if start >= end:
                break
            slot = _bin_of(start)
            rounds[slot] += 1
            tokens[slot] += min(accepted + 1, end - start)
            start += accepted + 1
    edges = [*ANSWER_BINS[1:], None]
    return [
        {
            "from": low,
            "to": high,
            "rounds": r,
            "tokens_per_round": round(t / r, 4) if r else None,
            "tokens": a,
            "repeated_share": round(k / a, 4) if a else None,
        }
        for low, high, r, t, a, k in zip(ANSWER_BINS, edges, rounds, tokens, answer_tokens, repeats)
    ]


def eval_set(name: str, decoder: SpecDecoder, prompts: list[list[int]], max_new: int, subset: int, eos: set[int], anatomy) -> dict:
    started = time.perf_counter()
    results, whole = [], []  # whole: (completion tokens, verify rounds) per request
    for index, ids in enumerate(prompts, 1):
        results.append(decoder.generate(ids, max_new))
        whole.append((results[-1].completion_tokens, results[-1].verify_ct))
        if index % 20 == 0 or index == len(prompts):
            print(
                f"  {name}: {index}/{len(prompts)} prompts, pooled accept length {pooled_accept_length(whole):.3f} ({time.perf_counter() - started:.0f} s)",
                flush=True,
            )
    rng = random.Random(0)
    answers = [answer_part(r, eos) for r in results]
    row = {
        "prompts": len(results),
        "tokens": sum(t for t, _ in whole),
        "pooled": pooled_accept_length(whole),
        "pooled_95": bootstrap_interval(whole, pooled_accept_length, rng),
        "mean_of_request_means": mean_of_request_means(whole),
        "mean_of_request_means_95": bootstrap_interval(whole, mean_of_request_means, rng),
        "per_request": [round(r.accept_length, 4) for r in results],
        "per_request_rounds": [list(pair) for pair in whole],  # (completion tokens, verify rounds): paired_accept.py reads them
        "seconds": round(time.perf_counter() - started, 1),
        "pooled_before_eos": pooled_accept_length(answers),
        "pooled_before_eos_95": bootstrap_interval(answers, pooled_accept_length, rng),
        "tokens_before_eos": sum(t for t, _ in answers),
    }
    if subset < len(results):
        row[f"pooled_over_{subset}_prompt_subsets_95"] = bootstrap_interval(whole, pooled_accept_length, rng, size=subset)
    row["by_answer_position"] = by_answer_position(results, eos)
    row["acceptance_anatomy"] = anatomy(prompts, results)
    return row


def main(argv: list[str] | None = None) -> int:
    from backend.profiles import load_profile
    from backend.train.target import load_target

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--profile", default="smollm2-135m")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", help="target dtype (default: the profile's [serve] dtype on CUDA, float32 on CPU)")
    parser.add_argument("--draft", required=True, help="the draft's checkpoint or exported dir")
    parser.add_argument("--prompts", action="append", type=Path, required=True, help="an eval set (JSONL, .gz too); repeat for several sets")
    parser.add_argument("--num-prompts", type=int, default=200, help="prompts per set (at most)")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument(
        "--stop-at-eos",
        action="store_true",
        help="end each answer at the target's end of turn, as a chat does (default: ignore-eos, the serve bench's fixed lengths)",
    )
    parser.add_argument("--max-prompt-tokens", type=int, default=1024)
    parser.add_argument("--num-steps", type=int, default=3)
    parser.add_argument("--subset", type=int, default=10, help="the prompts a quick bench uses: the spread of its number")
    parser.add_argument(
        "--feed",
        choices=FEEDS,
        default="aux",
        help="what the draft reads: aux (as trained), or last_hidden, SGLang's silent failure (the target's final hidden "
        "state, fc skipped): the accept length a broken feed gives this draft, which the canary must tell apart",
    )
    parser.add_argument(
        "--no-anatomy", action="store_true", help="skip the teacher-forced replay of the served tokens (on whole answers it takes as long as serving them)"
    )
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)

    device = torch.device(args.device)
    torch.set_grad_enabled(False)
    profile = load_profile(args.profile)
    dtype = args.dtype or (profile.serve.dtype if device.type == "cuda" else "float32")
    target = load_target(profile, device=device, dtype=dtype)
    draft, aux, label = load_draft(args.draft, profile, target, device)
    eos = eos_ids(target.model, target.tokenizer.eos_token_id)
    decoder = SpecDecoder(target.model, draft, aux, num_steps=args.num_steps, eos_token_id=sorted(eos) if args.stop_at_eos else NO_EOS, feed=args.feed)
    report = {
        "target": profile.target.path,
        "device": str(device),
        "dtype": dtype,
        "draft": label,
        "num_steps": args.num_steps,
        "feed": args.feed,
        "max_new_tokens": args.max_new_tokens,
        "ignore_eos": not args.stop_at_eos,
        "sets": {},
    }

    def anatomy_of(prompts, results):  # the teacher-forced replay reads the aux feed: none for a broken one
        return acceptance_anatomy(target.model, draft, aux, prompts, results, eos) if args.feed == "aux" and not args.no_anatomy else None

    for path in args.prompts:
        name = path.name.split(".")[0] if path.parent.name in ("", ".") else f"{path.parent.name}/{path.name.split('.')[0]}"
        prompts = [chat_prompt_ids(target.tokenizer, p, args.max_prompt_tokens) for p in read_prompt_file(path)[: args.num_prompts]]
        print(f"set {name}: {len(prompts)} prompts from {path}", flush=True)
        report["sets"][name] = eval_set(name, decoder, prompts, args.max_new_tokens, args.subset, eos, anatomy_of)
        if args.out:
            args.out.write_text(json.dumps(report, indent=1) + "\n")
    for name, row in report["sets"].items():
        anatomy = row["acceptance_anatomy"]
        spread = row.get(f"pooled_over_{args.subset}_prompt_subsets_95")
        print(
            f"{name}: {row['prompts']} prompts, accept length {row['pooled']:.3f} pooled (95 % {row['pooled_95'][0]:.3f}-{row['pooled_95'][1]:.3f}), "
            f"{row['mean_of_request_means']:.3f} mean of request means"
            + f"; {row['pooled_before_eos']:.3f} up to the end of turn"
            + "; tokens a round by where in the answer the round starts: "
            + ", ".join(
                f"{b['from']}-{b['to'] or ''} {b['tokens_per_round']} ({b['rounds']} rounds, {b['repeated_share']:.0%} repeats)"
                for b in row["by_answer_position"]
                if b["rounds"]
            )
            + (f"; {args.subset}-prompt subsets span {spread[0]:.3f}-{spread[1]:.3f}" if spread else "")
            + (
                f"; step 0 teacher-forced {anatomy['teacher_forced_step0_all']:.3f} (before end of turn {anatomy['teacher_forced_step0_before_eos']:.3f})"
                f"; served rounds {anatomy['served_rounds']}, replayed {anatomy['replayed_rounds']}"
                if anatomy
                else f"; feed {args.feed}{', no anatomy' if args.no_anatomy else ''}"
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
