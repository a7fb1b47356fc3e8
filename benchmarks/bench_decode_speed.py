#!/usr/bin/env python3
"""Batch-1 decode speed of the reference engine's decoders against transformers' generate, measured in one process.

Rows (the same prompts, ignore-eos, fixed output lengths): transformers `generate` eager; transformers `generate`
with cache_implementation="static" (compiled by transformers on CUDA); our eager plain decode (SpecDecoder); our
static-cache plain decode (CUDA graphs on CUDA), with --compile also through torch.compile; our static EAGLE-3 decode
at each --num-steps, for each --draft (repeat it as NAME=DIR: several drafts share the target, the prompts and the
plain rows). Prints tok/s per row, EAGLE's speed-up over our plain decode, the fraction of the bandwidth bound
(weight bytes / --hbm-tbs), accept lengths, a per-step breakdown (draft round, target verify, host work),
token-for-token checks (static vs eager; on CUDA also in float32, first draft) and, per draft at the first --num-steps,
the served step-0 acceptance beside the teacher-forced step-0 hits on the same tokens (acceptance_anatomy); writes --out JSON.

H200:  python3 benchmarks/bench_decode_speed.py --device cuda --draft RUN/draft [--draft specforge=SF/draft] --prompts DATA/eval.jsonl \
         --prompts HumanEval.jsonl.gz --num-prompts 20 --max-new-tokens 256 --out benchmarks/results/h200_decode_speed.json
CPU:   python3 benchmarks/bench_decode_speed.py --device cpu --max-new-tokens 8 --num-prompts 2 --out /tmp/speed.json
"""

from __future__ import annotations

import argparse
import os
import copy
import gzip
import json
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from backend.bench.spec_settings import chat_prompt_ids
from backend.serve.spec_setting import TreeSetting, verify_width
from backend.serve.reference.spec_decode import NO_EOS, SpecDecoder, eos_ids
from backend.serve.reference.static_decode import ATTENTION_KINDS, LINEAR_KINDS, StaticDecoder, StepTimes
from backend.train.draft import DraftKVCache

BUILTIN_PROMPTS = [
    "Write a Python function that reverses a string and explain how it works.",
    "Give me three tips for writing a clear bug report.",
    "How will electric cars affect traditional automobile industries over the next decade?",
    "Summarize the plot of a heist movie in a few sentences.",
]


def read_prompt_file(path: Path) -> list[Any]:
    """eval.jsonl records ({"conversations": [...]} or {"prompt": str}), HumanEval's {"prompt": code}, .gz or plain."""
    opener = gzip.open if path.suffix == ".gz" else open
    records = []
    with opener(path, "rt", encoding="utf-8") as handle:
        for number, line in enumerate(handle, 1):
            if not line.strip():
                continue
            record = json.loads(line)
            conversation = record.get("conversations") if isinstance(record, dict) else None
            if isinstance(conversation, list) and conversation:
                messages = [{"role": m.get("role", "user"), "content": m.get("content", "")} for m in conversation]
                records.append(messages if messages[-1]["role"] != "assistant" else messages[:-1])
            elif isinstance(record, dict) and isinstance(record.get("prompt"), str):
                records.append(record["prompt"])
            else:
                raise SystemExit(f"{path}:{number}: expected a 'conversations' list or a 'prompt' string; nothing was measured")
    return records


def set_inductor(options: dict[str, Any]) -> dict[str, Any]:
    """Set torch._inductor.config options; returns their previous values (to set back)."""
    import torch._inductor.config as inductor_config

    previous = {name: getattr(inductor_config, name) for name in options}
    for name, value in options.items():
        setattr(inductor_config, name, value)
    return previous


def apply_inductor_options(pairs: list[str]) -> dict[str, Any]:
    """NAME=VALUE pairs into torch._inductor.config (VALUE as a Python literal: True, 3, 'x'); returns what was set."""
    import ast

    import torch._inductor.config as inductor_config

    applied: dict[str, Any] = {}
    for pair in pairs:
        name, _, text = pair.partition("=")
        if not hasattr(inductor_config, name):
            raise SystemExit(f"--inductor {pair}: torch._inductor.config has no option {name!r}; nothing was measured")
        applied[name] = ast.literal_eval(text)
    set_inductor(applied)
    return applied


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(device: torch.device, run: Callable[[], Any]) -> tuple[Any, float]:
    synchronize(device)
    start = time.perf_counter()
    result = run()
    synchronize(device)
    return result, time.perf_counter() - start


def measure(
    name: str, device, prompts: list[list[int]], run: Callable[[list[int]], Any], tokens_of: Callable[[Any], list[int]], warmup: int = 1, warm_all: bool = False
) -> dict:
    """Warm up (on the longest prompt, or warm_all: on every prompt, so every cache prefix's graph exists), then time
    each prompt; tok/s = generated tokens / wall seconds (prefill included)."""
    row: dict[str, Any] = {"name": name, "prompts": len(prompts)}
    try:
        longest = max(prompts, key=len)
        for _ in range(warmup):
            run(longest)
        for ids in prompts if warm_all else []:
            run(ids)
        outputs, seconds = [], 0.0
        for ids in prompts:
            result, elapsed = timed(device, lambda: run(ids))
            outputs.append(result)
            seconds += elapsed
    except Exception as exc:  # a row that cannot run on this stack is reported, not fatal
        row["error"] = f"{type(exc).__name__}: {exc}"
        row["traceback"] = traceback.format_exc(limit=4)
        print(f"  {name}: FAILED {row['error']}", flush=True)
        return row
    tokens = [tokens_of(result) for result in outputs]
    row.update(tokens=sum(len(t) for t in tokens), seconds=seconds, tok_s=sum(len(t) for t in tokens) / seconds if seconds else 0.0)
    row["_outputs"] = tokens
    row["_results"] = outputs
    print(f"  {name}: {row['tok_s']:.1f} tok/s ({row['tokens']} tokens in {seconds:.2f} s)", flush=True)
    return row


def hf_rows(model, prompts: list[list[int]], max_new: int, device) -> list[dict]:
    def generate(ids, **extra):
        input_ids = torch.tensor([ids], device=device)
        out = model.generate(
            input_ids=input_ids,
            attention_mask=torch.ones_like(input_ids),
            max_new_tokens=max_new,
            min_new_tokens=max_new,
            do_sample=False,
            pad_token_id=0,
            **extra,
        )
        return out[0, len(ids) :].tolist()

    rows = [measure("hf_generate_eager", device, prompts, generate, lambda r: r)]
    rows.append(measure("hf_generate_static_compile", device, prompts, lambda ids: generate(ids, cache_implementation="static"), lambda r: r, warmup=2))
    rows[-1]["compiled_by_transformers"] = device.type == "cuda"
    return rows


def prefix_match(a: list[int], b: list[int]) -> int:
    count = 0
    for x, y in zip(a, b):
        if x != y:
            break
        count += 1
    return count


def agreement(reference: dict, other: dict) -> dict | None:
    if "_outputs" not in reference or "_outputs" not in other:
        return None
    pairs = list(zip(reference["_outputs"], other["_outputs"]))
    return {
        "identical": sum(a == b for a, b in pairs),
        "of": len(pairs),
        "mean_matching_prefix": sum(prefix_match(a, b) for a, b in pairs) / max(len(pairs), 1),
    }


def spec_stats(row: dict) -> None:
    results = row.get("_results")
    if not results:
        return
    completion = sum(r.completion_tokens for r in results)
    verify = sum(r.verify_ct for r in results)
    rounds = [a for r in results for a in r.accepted_per_round]
    row["accept_length"] = completion / verify if verify else None
    row["mean_accepted_drafts"] = sum(rounds) / len(rounds) if rounds else None
    row["verify_ct"] = verify


def _mean(flags: list[bool]) -> float | None:
    return sum(flags) / len(flags) if flags else None


def acceptance_anatomy(model, draft, aux: list[int], prompts: list[list[int]], results: list, eos: set[int]) -> dict:
    """The served rounds' step-0 acceptance beside the same draft's teacher-forced step-0 hits on the same tokens.

    One eager target pass over prompt + output and the draft's step 0 over every row (fresh cache): row t (the
    target's features at t, token t+1) predicts token t+2, so output index j is predicted by row prompt_len + j - 2.
    Round r's step 0 proposed output index s_r = 1 + sum over earlier rounds of (accepted + 1). At those indices the
    teacher-forced hit and the served acceptance should agree (same features, same rows; bf16 noise aside): a low
    agreement is a serving bug; a gap between every index and the round starts is selection (rounds start after a
    rejection). Indices past the first eos (this bench ignores eos) and targets outside the draft vocab are split out.
    """
    runner = SpecDecoder(model, draft, aux, num_steps=1, eos_token_id=NO_EOS)
    hits, in_vocab, before_eos = [], [], []
    served, forced, after_reject = [], [], []
    steps = results[0].num_steps if results else 0
    served_rounds, replayed = [0] * (steps + 1), [0] * (steps + 1)
    for ids, result in zip(prompts, results):
        output, start = list(result.output_ids), len(ids)
        if len(output) < 2:
            continue
        seq = torch.tensor([ids + output], dtype=torch.long, device=runner.target.device)
        target_logits, hidden_states, _ = runner.target.forward(seq, None)
        features = runner.features(hidden_states)
        for accepted, count in enumerate(replay_rounds(draft, features, seq, target_logits, start, steps)):
            replayed[accepted] += count
        _, logits = draft.extend(runner._draft_input(features[:, :-1]), seq[:, 1:], DraftKVCache())
        predicted = draft.draft_to_target_ids(logits[0].argmax(-1)).tolist()
        first_eos = next((j for j, token in enumerate(output) if token in eos), len(output))
        row_hits = [predicted[start + j - 2] == output[j] for j in range(1, len(output))]
        hits += row_hits
        in_vocab += [bool(draft.t2d[output[j]]) for j in range(1, len(output))]
        before_eos += [j < first_eos for j in range(1, len(output))]
        index, previous_full = 1, True
        for accepted in result.accepted_per_round:
            if index >= len(output):
                break
            served.append(accepted >= 1)
            served_rounds[accepted] += 1
            forced.append(row_hits[index - 1])
            after_reject.append(not previous_full)
            previous_full = accepted == result.num_steps
            index += accepted + 1
    pre = [h for h, b in zip(hits, before_eos) if b]
    return {
        "positions": len(hits),
        "teacher_forced_step0_all": _mean(hits),
        "teacher_forced_step0_in_draft_vocab": _mean([h for h, v in zip(hits, in_vocab) if v]),
        "teacher_forced_step0_before_eos": _mean(pre),
        "positions_before_eos": len(pre),
        "outside_draft_vocab": _mean([not v for v in in_vocab]),
        "round_starts": len(served),
        "served_step0": _mean(served),
        "teacher_forced_step0_at_round_starts": _mean(forced),
        "served_vs_teacher_forced_agreement": _mean([a == b for a, b in zip(served, forced)]),
        "teacher_forced_step0_after_rejection": _mean([f for f, r in zip(forced, after_reject) if r]),
        "teacher_forced_step0_after_full_accept": _mean([f for f, r in zip(forced, after_reject) if not r]),
        "served_rounds": served_rounds,
        "replayed_rounds": replayed,
    }


def replay_rounds(draft, features, seq, target_logits, start: int, steps: int) -> list[int]:
    """The trainer's validation replay (TTT hits -> chain_round_histogram) on these served tokens: rounds from the
    prompt's last row on, as serving starts them. Equal to the served rounds when training's TTT unroll is the
    decoder's chain (bf16 near-ties aside)."""
    from backend.train.loss import chain_round_histogram, fused_ttt_loss, make_teacher

    scored = torch.zeros(seq.shape, dtype=torch.bool, device=seq.device)
    scored[0, start : seq.shape[1] - 1] = True  # the teacher at p predicts token p + 1: the output's tokens 1..
    teacher = make_teacher(target_logits.float(), scored, draft.t2d)
    states = draft.ttt_hidden(features.to(draft.fc.weight.dtype), seq, steps)
    result = fused_ttt_loss(states, draft.lm_head.weight, teacher, keep_hits=True)
    return chain_round_histogram(result.hits, teacher.scored, steps)


def static_row(name, decoder: StaticDecoder, device, prompts, max_new, speculative: bool) -> dict:
    run = (lambda ids: decoder.generate(ids, max_new)) if speculative else (lambda ids: decoder.plain(ids, max_new))
    row = measure(name, device, prompts, run, lambda r: r.output_ids, warmup=1, warm_all=True)
    if "error" in row:
        return row
    decoder.step_times = StepTimes()  # one more pass with the step clock on: the breakdown, not the tok/s
    for ids in prompts[:4]:
        run(ids)
    row["breakdown_ms"] = decoder.step_times.summary()
    decoder.step_times = None
    row["graphs"] = decoder.use_graphs
    row["compiled"] = decoder.compiled
    row["graphs_captured"] = len(decoder.graphs)
    if speculative:
        spec_stats(row)
    return row


def fp32_check(profile, draft, aux, num_steps: list[int], prompts: list[list[int]], device, max_new: int) -> dict:
    """On the device, in float32: static (graphs) and eager decoders agree token for token, acceptance counts too."""
    from backend.train.target import load_target

    target = load_target(profile, device=device, dtype="float32")
    draft32 = copy.deepcopy(draft).float()
    report: dict[str, Any] = {"prompts": len(prompts), "max_new_tokens": max_new}
    for steps in num_steps:
        eager = SpecDecoder(target.model, draft32, aux, num_steps=steps, eos_token_id=NO_EOS)
        static = StaticDecoder(target.model, draft32, aux, num_steps=steps, eos_token_id=NO_EOS, max_len=max(len(p) for p in prompts) + max_new + 64)
        plain_equal = spec_equal = counts_equal = 0
        for ids in prompts:
            plain_equal += eager.plain_generate(ids, max_new) == static.plain_generate(ids, max_new)
            a, b = eager.generate(ids, max_new), static.generate(ids, max_new)
            spec_equal += a.output_ids == b.output_ids
            counts_equal += (a.accepted_per_round, a.verify_ct) == (b.accepted_per_round, b.verify_ct)
        report[f"num_steps_{steps}"] = {"plain_identical": plain_equal, "speculative_identical": spec_equal, "acceptance_identical": counts_equal}
    del target
    return report


def load_draft(path: str | None, profile, target, device):
    """A trained draft from its checkpoint dir, or (path None) an untrained draft of the profile's shape."""
    from backend.train.draft import DraftModelConfig, Eagle3Draft

    if path:
        from backend.serve.preflight import resolve_draft_dir
        from backend.train.checkpoint import load_checkpoint

        draft, config, _meta, _state = load_checkpoint(resolve_draft_dir(Path(path).expanduser()), target_embedding=target.embed_weight())
        return draft.to(device).eval(), list(config.aux_layer_ids), path
    torch.manual_seed(0)
    draft = Eagle3Draft(DraftModelConfig.from_profile(profile))
    draft.load_target_embedding(target.embed_weight().float())
    return draft.to(device=device, dtype=target.dtype).eval(), list(profile.target.aux_layer_ids), "untrained (no --draft)"


def draft_specs(values: list[str] | None) -> list[tuple[str, str, str | None]]:
    """--draft values as (name, row suffix, dir): the first draft's rows keep their plain names, a later NAME=DIR's end in _NAME."""
    specs: list[tuple[str, str, str | None]] = []
    for index, value in enumerate(values or [""]):
        name, sep, path = value.partition("=")
        if not sep or Path(value).exists():
            name, path = ("ours" if index == 0 else f"draft{index + 1}"), value
        specs.append((name, "" if index == 0 else f"_{name}", path or None))
    names = [name for name, _, _ in specs]
    if len(set(names)) != len(names):
        raise SystemExit(f"--draft names must differ: {values}; nothing was measured")
    return specs


def weight_bytes(model) -> int:
    seen, total = set(), 0
    for param in model.parameters():
        if param.data_ptr() not in seen:
            seen.add(param.data_ptr())
            total += param.numel() * param.element_size()
    return total


def public(row: dict) -> dict:
    return {key: value for key, value in row.items() if not key.startswith("_")}


def main(argv: list[str] | None = None) -> int:
    from backend.profiles import load_profile
    from backend.train.compile_cache import cache_file, load_artifacts, save_artifacts
    from backend.train.target import load_target

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", default="smollm2-135m")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", help="target dtype (default: the profile's [serve] dtype on CUDA, float32 on CPU)")
    parser.add_argument(
        "--draft",
        action="append",
        metavar="[NAME=]DIR",
        help="draft checkpoint dir (default: an untrained draft of the profile's shape); repeat as NAME=DIR to decode more drafts with the "
        "same target, prompts and plain rows in one process (a later draft's rows end in _NAME)",
    )
    parser.add_argument("--prompts", action="append", type=Path, help="an eval set (JSONL, .gz too); repeat for several sets")
    parser.add_argument("--num-prompts", type=int, default=20, help="prompts per eval set for our static rows")
    parser.add_argument("--anchor-prompts", type=int, default=3, help="prompts for the slow eager rows (first eval set)")
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--max-prompt-tokens", type=int, default=1024)
    parser.add_argument("--num-steps", type=int, nargs="+", default=[3, 7])
    parser.add_argument(
        "--branches",
        type=int,
        nargs="+",
        default=[1],
        help="first-step branches of our static rows (1: a chain; K: the draft's K best first tokens, each chained)",
    )
    parser.add_argument(
        "--trees",
        nargs="*",
        default=[],
        metavar="STEPS,TOPK,TOKENS",
        help="SGLang EAGLE trees of our static rows besides the chains (e.g. 3,4,8: 3 steps of top-4 beams, 8 tokens verified)",
    )
    parser.add_argument("--compile", action="store_true", help="add torch.compile variants of our static rows (CUDA; each cache prefix compiles once)")
    parser.add_argument("--attention", choices=ATTENTION_KINDS, default="sdpa", help="how our static rows' target attends (static_decode.ATTENTION_KINDS)")
    parser.add_argument(
        "--linear", choices=LINEAR_KINDS, default="torch", help="how our static rows' steps multiply by the weights (static_decode.LINEAR_KINDS)"
    )
    parser.add_argument(
        "--inductor",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="a torch._inductor.config option for the --compile rows (repeat; e.g. coordinate_descent_tuning=True)",
    )
    parser.add_argument("--no-hf", action="store_true", help="skip the transformers generate anchors")
    parser.add_argument("--no-fp32-check", action="store_true")
    parser.add_argument("--hbm-tbs", type=float, default=4.8, help="memory bandwidth for the bound, TB/s (H200: 4.8)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    try:
        trees = [TreeSetting.parse(text) for text in args.trees]
    except ValueError as error:
        parser.error(f"--trees: {error}; nothing was measured")
    if any(tree.topk == 1 for tree in trees):
        parser.error("--trees takes topk > 1 (a chain is --num-steps); nothing was measured")

    device = torch.device(args.device)
    if device.type == "cuda":
        device = torch.device("cuda", device.index or 0)
        torch.cuda.set_device(device)
    torch.set_grad_enabled(False)
    profile = load_profile(args.profile)
    dtype = args.dtype or (profile.serve.dtype if device.type == "cuda" else "float32")
    started = time.perf_counter()
    target = load_target(profile, device=device, dtype=dtype)
    load_s = time.perf_counter() - started
    model, tokenizer = target.model, target.tokenizer
    specs = draft_specs(args.draft)
    drafts = [(suffix, *load_draft(path, profile, target, device)) for _name, suffix, path in specs]
    _, draft, aux, draft_label = drafts[0]
    sets = {path.name.split(".")[0]: read_prompt_file(path) for path in args.prompts} if args.prompts else {"builtin": list(BUILTIN_PROMPTS)}
    encoded = {name: [chat_prompt_ids(tokenizer, p, args.max_prompt_tokens) for p in prompts[: args.num_prompts]] for name, prompts in sets.items()}
    first = next(iter(encoded))
    anchors = encoded[first][: args.anchor_prompts]
    max_new = args.max_new_tokens
    shapes = [
        (f"k{steps}" + (f"_b{branches}" if branches > 1 else ""), {"num_steps": steps, "branches": branches})
        for steps in args.num_steps
        for branches in args.branches
    ]
    for tree in trees:
        shape_args = {"num_steps": tree.num_steps, "topk": tree.topk, "num_draft_tokens": tree.num_draft_tokens}
        shapes.append((f"t{tree.num_steps}x{tree.topk}n{tree.num_draft_tokens}", shape_args))
    widest = max([verify_width(max(args.num_steps), branches=max(args.branches))] + [verify_width(t.num_steps, t.topk, t.num_draft_tokens) for t in trees])
    max_len = max(len(ids) for batch in encoded.values() for ids in batch) + max_new + widest
    labels = ", ".join(f"{label} (rows *{suffix})" if suffix else label for suffix, _, _, label in drafts)
    print(f"target {profile.target.path} {dtype} on {device} (loaded in {load_s:.1f} s); drafts {labels}; sets {list(encoded)}", flush=True)

    rows: list[dict] = []
    eos = eos_ids(model, tokenizer.eos_token_id)  # only to split the anatomy at the first eos: every row ignores it
    eager = SpecDecoder(model, None, aux, eos_token_id=NO_EOS)
    eager_row = measure("ours_eager_plain", device, anchors, lambda ids: eager.plain(ids, max_new), lambda r: r.output_ids)
    rows.append(eager_row)
    variants = [False, True] if args.compile else [False]
    inductor_options = apply_inductor_options(args.inductor) if args.compile else {}
    compile_cache = cache_file(os.environ) if args.compile else None  # EAGLE3_COMPILE_CACHE: an earlier run's compiles
    if compile_cache is not None:
        load_artifacts(compile_cache, print)
    per_set: dict[str, dict] = {name: {} for name in encoded}
    checks: dict[str, Any] = {}
    for compiled in variants:  # one decoder per variant, shared by the eval sets: graphs (and compiles) are made once
        suffix = "_compiled" if compiled else ""
        plain = StaticDecoder(model, None, aux, eos_token_id=NO_EOS, max_len=max_len, compile=compiled, attention=args.attention, linear=args.linear)
        for name, prompts in encoded.items():
            print(f"eval set {name}: {len(prompts)} prompts", flush=True)
            row = static_row(f"ours_static_plain{suffix}", plain, device, prompts, max_new, speculative=False)
            per_set[name][row["name"]] = row
        for shape, (tag, shape_args) in enumerate(shapes):
            for draft_suffix, one_draft, one_aux, _label in drafts:
                decoder = StaticDecoder(
                    model,
                    one_draft,
                    one_aux,
                    eos_token_id=NO_EOS,
                    max_len=max_len,
                    compile=compiled,
                    attention=args.attention,
                    linear=args.linear,
                    **shape_args,
                )
                for name, prompts in encoded.items():
                    plain_row = per_set[name][f"ours_static_plain{suffix}"]
                    row = static_row(f"ours_static_eagle_{tag}{suffix}{draft_suffix}", decoder, device, prompts, max_new, speculative=True)
                    if "tok_s" in row and "tok_s" in plain_row:
                        row["speedup_vs_our_plain"] = row["tok_s"] / plain_row["tok_s"]
                    row["eagle_equals_plain"] = agreement(plain_row, row)
                    if not compiled and shape == 0 and "_results" in row:
                        row["acceptance_anatomy"] = acceptance_anatomy(model, one_draft, one_aux, prompts, row["_results"], eos)
                    per_set[name][row["name"]] = row
                del decoder
    static_plain = per_set[first]["ours_static_plain"]
    checks["static_plain_vs_eager_plain"] = agreement(eager_row, {**static_plain, "_outputs": static_plain.get("_outputs", [])[: len(anchors)]})
    per_set = {name: {key: public(row) for key, row in rows_.items()} for name, rows_ in per_set.items()}
    bytes_ = weight_bytes(model)

    def report() -> dict:
        bound = args.hbm_tbs * 1e12 / bytes_
        for row in rows + [r for s in per_set.values() for r in s.values()]:
            if "tok_s" in row:
                row["fraction_of_bandwidth_bound"] = row["tok_s"] / bound
        return {
            "device": str(device),
            "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
            "torch": torch.__version__,
            "transformers": __import__("transformers").__version__,
            "target": profile.target.path,
            "dtype": dtype,
            "draft": draft_label,
            "drafts": {name: {"dir": label, "row_suffix": suffix} for (name, suffix, _), (_, _, _, label) in zip(specs, drafts)},
            "max_new_tokens": max_new,
            "num_steps": args.num_steps,
            "branches": args.branches,
            "trees": args.trees,
            "weight_bytes": bytes_,
            "bandwidth_bound_tok_s": bound,
            "hbm_tbs": args.hbm_tbs,
            "inductor_options": inductor_options,
            "attention": args.attention,
            "linear": args.linear,
            "anchors": {row["name"]: public(row) for row in rows},
            "eval_sets": per_set,
            "checks": checks,
        }

    def write() -> None:  # after our rows, then after the slower anchors and checks: a run cut short keeps what it measured
        if args.out:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(report(), indent=1) + "\n")
            print(f"wrote {args.out}", flush=True)

    write()
    if compile_cache is not None:  # this run's compiles, for the next machine (h200_round.sh returns and carries the file)
        save_artifacts(compile_cache, print)
    if not args.no_hf:
        rows[:0] = hf_rows(model, anchors, max_new, device)
        write()
    if device.type == "cuda" and not args.no_fp32_check:
        try:
            checks["float32_static_vs_eager"] = fp32_check(profile, draft, aux, args.num_steps, encoded[first][:2], device, min(max_new, 64))
        except Exception as exc:
            checks["float32_static_vs_eager"] = {"error": f"{type(exc).__name__}: {exc}"}
        write()
    print_summary(report())
    return 0


def print_summary(report: dict) -> None:
    print(f"\nbandwidth bound: {report['weight_bytes'] / 1e6:.0f} MB of weights at {report['hbm_tbs']} TB/s = {report['bandwidth_bound_tok_s']:.0f} tok/s")
    print(f"{'row':42} {'tok/s':>9} {'x plain':>8} {'bound':>7} {'accept':>7}  breakdown per round (ms)")
    rows = [("", r) for r in report["anchors"].values()] + [(f"{s}/", r) for s, rs in report["eval_sets"].items() for r in rs.values()]
    for prefix, row in rows:
        if "error" in row:
            print(f"{prefix + row['name']:42} FAILED {row['error'][:80]}")
            continue
        speedup = f"{row['speedup_vs_our_plain']:.2f}x" if "speedup_vs_our_plain" in row else ""
        accept = f"{row['accept_length']:.2f}" if row.get("accept_length") else ""
        parts = row.get("breakdown_ms") or {}
        if parts.get("verify_ms"):
            detail = f"draft {parts['draft_ms']:.3f} verify {parts['verify_ms']:.3f} host {parts['host_ms']:.3f}"
        elif parts:
            detail = f"decode {parts['decode_ms']:.3f} host {parts['host_ms']:.3f}"
        else:
            detail = ""
        if parts.get("prefill_ms"):
            detail += f" prefill {parts['prefill_ms']:.2f}"
        print(f"{prefix + row['name']:42} {row['tok_s']:9.1f} {speedup:>8} {row['fraction_of_bandwidth_bound']:7.3f} {accept:>7}  {detail}")
        anatomy = row.get("acceptance_anatomy")
        if anatomy and anatomy["round_starts"]:
            print(
                f"{'':42} step 0: served {anatomy['served_step0']:.3f} at {anatomy['round_starts']} round starts, teacher-forced there "
                f"{anatomy['teacher_forced_step0_at_round_starts']:.3f} (agree {anatomy['served_vs_teacher_forced_agreement']:.3f}), "
                f"every row {anatomy['teacher_forced_step0_all']:.3f}, outside draft vocab {anatomy['outside_draft_vocab']:.3f}"
            )
            print(f"{'':42} rounds by drafts accepted: served {anatomy['served_rounds']}, validation's replay on the same tokens {anatomy['replayed_rounds']}")
    for name, value in report["checks"].items():
        print(f"check {name}: {json.dumps(value)}")


if __name__ == "__main__":
    sys.exit(main())
