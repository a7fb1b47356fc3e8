#!/usr/bin/env python3
"""How much of a target's answers loop, greedy against sampled, as `data regenerate` makes them.

The first prompts of a `data prepare` dir's train split (the turns before each conversation's first answer, through
the target's own chat template) are answered by regenerate.generate_batch twice in one process, greedy and sampled at
--temperature (the same per-row SeededSampler a sampled regeneration uses), and each answer's tokens that repeat an
earlier 8-gram of the same answer are counted (backend/repetition.py): the share over all answer tokens and over those
from the 64th on, and how many answers ended at the end of turn. A loop is text any draft predicts and a draft trained
on it learns nothing else there: the share says how much distinct data each way of answering gives.

CPU:  python3 benchmarks/regen_loops.py --prepare sgdev --num-prompts 48 --max-new-tokens 160 --out loops.json   # ~11 min
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def loop_report(answers: list[tuple[list[int], str]], seconds: float) -> dict:
    from backend.repetition import repeated_positions

    flags = [repeated_positions(ids) for ids, _why in answers]
    every = [flag for row in flags for flag in row]
    late = [flag for row in flags for flag in row[64:]]
    return {
        "answers": len(answers),
        "tokens": len(every),
        "repeated_share": sum(every) / len(every) if every else None,
        "repeated_share_from_64": sum(late) / len(late) if late else None,
        "ended_at_eos": sum(why == "eos" for _ids, why in answers),
        "seconds": round(seconds, 1),
    }


def main(argv: list[str] | None = None) -> int:
    import torch

    from backend.profiles import load_profile
    from backend.train.regenerate import Sampling, generate_batch, stop_token_ids
    from benchmarks.bench_regenerate import first_prompts
    from backend.train.target import load_target

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--profile", default="smollm2-135m")
    parser.add_argument("--prepare", type=Path, required=True, help="a `data prepare` dir")
    parser.add_argument("--num-prompts", type=int, default=48)
    parser.add_argument("--max-new-tokens", type=int, default=160)
    parser.add_argument("--max-prompt-tokens", type=int, default=384)
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)

    device = torch.device(args.device)
    target = load_target(load_profile(args.profile), device=device, dtype="float32" if device.type == "cpu" else None)
    prompts = first_prompts(args.prepare, target.tokenizer, args.max_prompt_tokens, args.num_prompts)
    stops = stop_token_ids(target)
    report: dict = {"profile": args.profile, "prompts": len(prompts), "max_new_tokens": args.max_new_tokens, "device": str(device)}
    for name, sampling in (
        ("greedy", Sampling(max_new_tokens=args.max_new_tokens)),
        (f"sampled_t{args.temperature:g}", Sampling(max_new_tokens=args.max_new_tokens, temperature=args.temperature, seed=1)),
    ):
        started, answers = time.perf_counter(), []
        for start in range(0, len(prompts), args.batch_size):
            chunk = prompts[start : start + args.batch_size]
            answers += generate_batch(target, chunk, [random.Random(start + i) for i in range(len(chunk))], sampling, stops)
        report[name] = loop_report(answers, time.perf_counter() - started)
        print(name, json.dumps(report[name]), flush=True)
    if args.out:
        args.out.write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
