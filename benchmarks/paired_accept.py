#!/usr/bin/env python3
"""Two drafts' accept lengths on the same prompts, paired: the difference per eval set with its bootstrap 95 % interval.

Reads two results of bench_accept_length.py (A first: the baseline) that decoded the same prompts of a set with the
same settings, and resamples the prompts together, so a prompt that is hard for both counts once: a difference whose
interval excludes 0 is one draft being better, not a luckier draw of prompts. Pooled (SGLang's accept length: the
requests' tokens over their verify rounds) and per request (SpecForge's mean of request means).

    python3 benchmarks/paired_accept.py A.json B.json [--out paired.json]

A result from before per_request_rounds was written (round 24 and earlier) is read from its per-request means: with
ignore-eos every request decoded max_new_tokens, so its rounds are max_new_tokens / mean (exact at the 4 decimals
written); a whole-answer result (--stop-at-eos) without rounds is refused.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from backend.serve.acceptance import bootstrap_interval, paired_pooled_difference, pooled_accept_length  # noqa: E402

Pair = tuple[int, int]  # (completion tokens, verify rounds) of one request


class PairingError(ValueError):
    """The two results cannot be paired (another set of prompts, other settings, no per-request rounds)."""


def request_rounds(result: dict[str, Any], name: str) -> list[Pair]:
    """Per request of set `name`: (completion tokens, verify rounds), as written or rebuilt from the per-request means."""
    row = result["sets"][name]
    if "per_request_rounds" in row:
        return [(int(tokens), int(rounds)) for tokens, rounds in row["per_request_rounds"]]
    if not result.get("ignore_eos", False):
        raise PairingError(f"set {name}: no per_request_rounds, and its answers stopped at the end of turn: the rounds cannot be rebuilt")
    tokens = int(result["max_new_tokens"])
    pairs = [(tokens, round(tokens / mean)) for mean in row["per_request"]]
    if sum(t for t, _ in pairs) != row["tokens"]:
        raise PairingError(f"set {name}: its per-request means do not add up to its {row['tokens']} tokens")
    return pairs


def compare(base: dict[str, Any], other: dict[str, Any], seed: int = 0) -> dict[str, Any]:
    """Per set both results hold: A's and B's pooled accept length, B - A pooled and per request with paired 95 %
    intervals, and how many prompts B decoded in fewer rounds (better), more (worse) or as many."""
    for key in ("target", "device", "dtype", "num_steps", "max_new_tokens", "ignore_eos", "feed"):
        if base.get(key) != other.get(key):
            raise PairingError(f"the results differ in {key}: {base.get(key)!r} vs {other.get(key)!r}; they decoded other things")
    shared = [name for name in base["sets"] if name in other["sets"]]
    if not shared:
        raise PairingError(f"no eval set in both: {sorted(base['sets'])} vs {sorted(other['sets'])}")
    sets = {}
    for name in shared:
        a, b = request_rounds(base, name), request_rounds(other, name)
        if len(a) != len(b):
            raise PairingError(f"set {name}: {len(a)} prompts vs {len(b)}; pair only results over the same prompts")
        rng = random.Random(seed)
        pairs = list(zip(a, b))
        means = [(tb / vb) - (ta / va) for (ta, va), (tb, vb) in pairs]
        sets[name] = {
            "prompts": len(pairs),
            "a_pooled": pooled_accept_length(a),
            "b_pooled": pooled_accept_length(b),
            "b_minus_a_pooled": paired_pooled_difference(pairs),
            "b_minus_a_pooled_95": bootstrap_interval(pairs, paired_pooled_difference, rng),
            "b_minus_a_per_request": sum(means) / len(means),
            "b_minus_a_per_request_95": bootstrap_interval(means, lambda sample: sum(sample) / len(sample), rng),
            "b_better": sum(1 for (_, va), (_, vb) in pairs if vb < va),
            "b_worse": sum(1 for (_, va), (_, vb) in pairs if vb > va),
            "equal": sum(1 for (_, va), (_, vb) in pairs if vb == va),
        }
    return {"a": base.get("draft"), "b": other.get("draft"), "sets": sets}


def lines(report: dict[str, Any]) -> list[str]:
    out = []
    for name, row in report["sets"].items():
        low, high = row["b_minus_a_pooled_95"]
        plow, phigh = row["b_minus_a_per_request_95"]
        verdict = "B better" if low > 0 else "A better" if high < 0 else "no difference the prompts can tell"
        out.append(
            f"{name}: {row['prompts']} prompts, A {row['a_pooled']:.3f} B {row['b_pooled']:.3f} pooled; B - A {row['b_minus_a_pooled']:+.3f} "
            f"(paired 95 % {low:+.3f} to {high:+.3f}), per request {row['b_minus_a_per_request']:+.3f} ({plow:+.3f} to {phigh:+.3f}); "
            f"B fewer rounds on {row['b_better']}, more on {row['b_worse']}, as many on {row['equal']}: {verdict}"
        )
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("a", type=Path, help="bench_accept_length.py's result for the baseline draft")
    parser.add_argument("b", type=Path, help="... for the draft compared with it, on the same prompts")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    try:
        report = compare(json.loads(args.a.read_text()), json.loads(args.b.read_text()))
    except (OSError, json.JSONDecodeError, KeyError, PairingError) as exc:
        print(f"paired_accept: {exc}; nothing compared", file=sys.stderr)
        return 2
    report |= {"a_file": str(args.a), "b_file": str(args.b)}
    for line in lines(report):
        print(line)
    if args.out:
        args.out.write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
