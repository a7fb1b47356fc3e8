#!/usr/bin/env python3
"""Answer throughput of `data regenerate`'s batched generation (regenerate.generate_batch: greedy and sampled both go
through transformers' generate, sampled ones with our per-row SeededSampler since 2026-12-05) against transformers'
own `generate` called directly, at several batch sizes, on one device, in one process.

The model is a randomly initialised Llama of the profile's target shape (hidden, layers, heads, vocabulary from the
profile), so the numbers need no weights and no tokenizer: decode speed does not depend on the weights' values. Every
row of a batch gets a random prompt of 100..--prompt-tokens ids (left-padded, as regeneration pads them) and answers
--new-tokens ids greedily with no stop token, so no row leaves early: the figure is the per-step cost at that batch.

Per batch size: prefill seconds (a 1-token call), seconds per decode step and answer tokens/s for ours (greedy and
sampled at temperature 1), and the same for transformers' `generate` (greedy, the same prompts and padding) as the
peer measured in the same run, the ratio of our greedy to it, and the GPU memory peak. (On the H200 before the switch,
2026-12-02, our loop ran greedy at 0.27x / 0.61x the peer at batch 256 / 2,048; sampled answers kept that loop until
2026-12-05.) --profile-batch adds a torch.profiler table of the top operators for one call.
--static adds `data regenerate --cache static` (ours_static: every batch filled to the batch size, every prompt padded to
--prompt-tokens, one StaticCache that transformers compiles on CUDA; its warm-up holds the compile) and the same
sampled at temperature 1 (ours_static_sampled).
--choose FILE writes {"batch_size": B, "cache": C} for the setting with the most tokens/s (h200_round.sh's train phase reads it).

--grouping PREPARE_DIR --tokenizer TARGET_DIR measures instead what batching by prompt length saves
(regenerate.LengthGroupedQueue): the first prompts of a `data prepare` dir's train split, rendered through the
target's tokenizer and chat template (those over --prompt-tokens dropped, as regeneration skips them), batched in
arrival order (window 1) and grouped (--window), the peer being arrival order in the same run: the padded prompt
tokens and the decode steps' attended KV rows (batch x (longest prompt + step), every batch decoding --new-tokens
steps, as a `generate` batch runs to its longest answer) of the whole split, then the wall-clock of generating
--grouping-prompts of them both ways with the random model, no stop token.

  H200:  python benchmarks/bench_regenerate.py --profile smollm2-135m --device cuda --batch 256 512 1024 --out r.json
  CPU:   python benchmarks/bench_regenerate.py --profile smollm2-135m --device cpu --batch 2 4 --new-tokens 4 \
             --prompt-tokens 48 --layers 2
  Grouping (any host): python benchmarks/bench_regenerate.py --grouping sgdev --tokenizer ~/.cache/eagle3-console/smollm2-135m-instruct-* \
             --device cpu --dtype float32 --layers 2 --batch 32 --new-tokens 16 --grouping-prompts 256
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def random_target(profile, device: str, dtype: str, layers: int | None):
    """A target-shaped Llama with random weights, wrapped as generate_batch reads a target (model, device, pad id, cache arg)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from backend.train.target import _cache_kwarg

    target, draft = profile.target, profile.draft
    config = LlamaConfig(
        vocab_size=target.vocab_size,
        hidden_size=target.hidden_size,
        num_hidden_layers=layers or target.num_layers,
        num_attention_heads=draft.num_attention_heads,  # the shipped draft copies its target's attention shape
        num_key_value_heads=draft.num_key_value_heads,
        head_dim=draft.head_dim,
        intermediate_size=draft.intermediate_size,
        rope_theta=draft.rope_theta,
        max_position_embeddings=draft.max_position_embeddings,
        tie_word_embeddings=True,
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(device=device, dtype=getattr(torch, dtype)).eval()
    return SimpleNamespace(model=model, device=torch.device(device), tokenizer=SimpleNamespace(pad_token_id=0), _cache_kwarg=_cache_kwarg(model))


def prompts_for(batch: int, vocab: int, longest: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, vocab) for _ in range(rng.randint(min(100, longest), longest))] for _ in range(batch)]


def timed(device, call) -> float:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize()
    started = time.perf_counter()
    call()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - started


def ours(target, prompts, new_tokens: int, temperature: float = 0.0, static=None) -> None:
    from backend.train.regenerate import Sampling, generate_batch

    rngs = [random.Random(i) for i in range(len(prompts))]
    answers = generate_batch(target, prompts, rngs, Sampling(max_new_tokens=new_tokens, temperature=temperature), stop_ids=set(), static=static)
    assert all(len(ids) == new_tokens for ids, _ in answers), "a row stopped early: the timing would not be per full step"


def ours_static_for(batch: int, args, temperature: float = 0.0):
    """`data regenerate --cache static`'s generation: one StaticBatches per batch size, as a regeneration holds one."""
    from backend.train.regenerate import StaticBatches

    static = StaticBatches(batch, args.prompt_tokens, args.new_tokens)
    return lambda target, prompts, new_tokens: ours(target, prompts, new_tokens, temperature=temperature, static=static)


def ours_sampled(target, prompts, new_tokens: int) -> None:
    ours(target, prompts, new_tokens, temperature=1.0)


def theirs(target, prompts, new_tokens: int) -> None:
    import torch

    width = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts], device=target.device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=target.device)
    with torch.no_grad():
        target.model.generate(
            input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0, eos_token_id=None
        )


def prefill_and_whole(target, generate, new_tokens: int, repeats: int) -> tuple[float, float]:
    """The fastest 1-token call and the fastest `new_tokens` call, timed in turn so that a burst of load on a shared
    machine slows both alike; while the difference stays swamped by noise (not positive), up to 3x the rounds."""
    prefill = whole = float("inf")
    for done in range(3 * repeats):
        prefill = min(prefill, timed(target.device, lambda: generate(1)))
        whole = min(whole, timed(target.device, lambda: generate(new_tokens)))
        if done + 1 >= repeats and whole > prefill:
            break
    return prefill, whole


def measure(target, batch: int, args) -> dict:
    import torch

    prompts = prompts_for(batch, target.model.config.vocab_size, args.prompt_tokens, seed=batch)
    row: dict = {"batch": batch, "prompt_tokens_mean": sum(map(len, prompts)) / batch}
    calls = [("ours", ours), ("ours_sampled", ours_sampled), ("transformers_generate", theirs)]
    if args.static:
        calls[1:1] = [("ours_static", ours_static_for(batch, args)), ("ours_static_sampled", ours_static_for(batch, args, temperature=1.0))]
    for name, call in calls:
        warm_up = timed(target.device, lambda: call(target, prompts[: min(batch, 8)], 2))  # kernels, allocator, a static cache's compile
        if target.device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        try:
            prefill, whole = prefill_and_whole(target, lambda tokens: call(target, prompts, tokens), args.new_tokens, args.repeats)
        except torch.OutOfMemoryError as exc:
            row[name] = {"error": f"out of memory: {str(exc)[:200]}"}
            print(f"batch {batch:5d} {name:22s} out of memory", flush=True)
            continue
        if whole <= prefill:
            row[name] = {"error": f"{args.new_tokens - 1} steps took no longer than the prefill: below the timing noise, raise --new-tokens"}
            print(f"batch {batch:5d} {name:22s} steps below the timing noise", flush=True)
            continue
        step = (whole - prefill) / (args.new_tokens - 1)
        row[name] = {
            "prefill_s": round(prefill, 4),
            "call_s": round(whole, 3),
            "step_ms": round(1000 * step, 3),
            "answer_tokens_per_s": round(batch / step, 1),
            "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2) if target.device.type == "cuda" else None,
            "warm_up_s": round(warm_up, 2),
        }
        print(f"batch {batch:5d} {name:22s} prefill {prefill:6.3f} s  step {1000 * step:7.2f} ms  {batch / step:9.0f} tok/s", flush=True)
    if all("answer_tokens_per_s" in row[name] for name in ("ours", "transformers_generate")):
        row["ours_over_transformers"] = round(row["ours"]["answer_tokens_per_s"] / row["transformers_generate"]["answer_tokens_per_s"], 3)
    if "answer_tokens_per_s" in row.get("ours_static", {}) and "answer_tokens_per_s" in row["ours"]:
        row["static_over_dynamic"] = round(row["ours_static"]["answer_tokens_per_s"] / row["ours"]["answer_tokens_per_s"], 3)
    return row


def best_setting(rows: list[dict]) -> dict | None:
    """The batch size and cache with the most answer tokens/s (greedy: regeneration's default)."""
    options = [
        (r[name]["answer_tokens_per_s"], r["batch"], cache)
        for r in rows
        for name, cache in (("ours", "dynamic"), ("ours_static", "static"))
        if "answer_tokens_per_s" in r.get(name, {})
    ]
    if not options:
        return None
    _rate, batch, cache = max(options)
    return {"batch_size": batch, "cache": cache}


def first_prompts(prepare_dir: Path, tokenizer, longest: int, count: int | None = None) -> list[list[int]]:
    """Each train conversation's first prompt (the turns before its first answer) as regeneration renders it, those
    over `longest` tokens left out (regeneration skips them); the first `count` when given."""
    from backend.train.chat_templates import template_ids
    from backend.train.conversations import SPLIT_FILES, eval_prompt, iter_conversations

    prompts = []
    for conversation in iter_conversations(prepare_dir / SPLIT_FILES["train"]):
        ids = template_ids(tokenizer, eval_prompt(conversation.messages), True, tokenizer.chat_template)
        if len(ids) <= longest:
            prompts.append(ids)
        if count is not None and len(prompts) == count:
            break
    return prompts


def batches_of(prompts: list[list[int]], batch: int, window: int) -> list[list[list[int]]]:
    """The batches regeneration's queue hands out for these prompts (all waiting from the start, none continued)."""
    from backend.train.regenerate import Job, LengthGroupedQueue

    queue, batches, pending = LengthGroupedQueue(batch, window), [], iter(enumerate(prompts))
    while True:
        while queue.room() > 0 and (item := next(pending, None)) is not None:
            queue.add(Job(f"train:{item[0]}", None, [], random.Random(0)), item[1])
        if not len(queue):
            return batches
        batches.append([prompt for _, prompt in queue.next_batch()])


def attended_rows(batches: list[list[list[int]]], new_tokens: int) -> int:
    """KV rows the decode steps read: each step of a batch attends over its longest prompt plus the answers so far."""
    return sum(len(b) * (new_tokens * max(map(len, b)) + new_tokens * (new_tokens - 1) // 2) for b in batches)


def grouping(target, args) -> dict:
    from backend.train.regenerate import padded_prompt_tokens

    from transformers import AutoTokenizer

    prompts = first_prompts(args.grouping, AutoTokenizer.from_pretrained(args.tokenizer), args.prompt_tokens)
    lengths = sorted(map(len, prompts))
    result: dict = {
        "prompts": len(prompts),
        "prompt_tokens_mean": round(sum(lengths) / len(lengths), 1),
        "prompt_tokens_median": lengths[len(lengths) // 2],
        "window": args.window,
        "rows": [],
    }
    for batch in args.batch:
        row: dict = {"batch": batch}
        for name, window in (("arrival", 1), ("grouped", args.window)):
            batches = batches_of(prompts, batch, window)
            row[name] = {
                "batches": len(batches),
                "padded_prompt_tokens": sum(padded_prompt_tokens(b) for b in batches),
                "attended_kv_rows": attended_rows(batches, args.new_tokens),
            }
        for key in ("padded_prompt_tokens", "attended_kv_rows"):
            row[f"{key}_grouped_over_arrival"] = round(row["grouped"][key] / row["arrival"][key], 3)
        subset = prompts[: args.grouping_prompts]
        if len(subset) < 2 * batch:  # one batch either way: nothing to group
            print(
                f"batch {batch:5d}  padded prompt tokens x{row['padded_prompt_tokens_grouped_over_arrival']}  attended KV rows "
                f"x{row['attended_kv_rows_grouped_over_arrival']} (grouped over arrival, {len(prompts)} prompts)",
                flush=True,
            )
            result["rows"].append(row)
            continue
        for name, window in (("arrival", 1), ("grouped", args.window)):
            batches = batches_of(subset, batch, window)
            ours(target, batches[0][: min(batch, 4)], 2)  # warm-up
            seconds = timed(target.device, lambda: [ours(target, b, args.new_tokens) for b in batches])
            row[name]["wall_s_first_prompts"] = round(seconds, 3)
        row["wall_arrival_over_grouped"] = round(row["arrival"]["wall_s_first_prompts"] / row["grouped"]["wall_s_first_prompts"], 3)
        print(
            f"batch {batch:5d}  padded prompt tokens x{row['padded_prompt_tokens_grouped_over_arrival']}  attended KV rows "
            f"x{row['attended_kv_rows_grouped_over_arrival']} (grouped over arrival, {len(prompts)} prompts)  wall "
            f"{row['arrival']['wall_s_first_prompts']} s arrival vs {row['grouped']['wall_s_first_prompts']} s grouped = "
            f"{row['wall_arrival_over_grouped']}x ({len(subset)} prompts)",
            flush=True,
        )
        result["rows"].append(row)
    return result


def profile_table(target, batch: int, args) -> str:
    from torch.profiler import ProfilerActivity, profile

    prompts = prompts_for(batch, target.model.config.vocab_size, args.prompt_tokens, seed=batch)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if target.device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        ours(target, prompts, min(args.new_tokens, 16))
    key = "self_cuda_time_total" if target.device.type == "cuda" else "self_cpu_time_total"
    return prof.key_averages().table(sort_by=key, row_limit=18, max_name_column_width=60)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--profile", default="smollm2-135m")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--batch", type=int, nargs="+", default=[256, 512, 1024])
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--prompt-tokens", type=int, default=384, help="longest prompt (rows draw 100..N)")
    parser.add_argument("--layers", type=int, help="fewer layers than the profile's (a quick CPU check)")
    parser.add_argument("--repeats", type=int, default=2, help="timed calls of each length per path (the fastest counts)")
    parser.add_argument(
        "--static", action="store_true", help="also time `data regenerate --cache static` (ours_static: one preallocated cache, compiled on CUDA)"
    )
    parser.add_argument("--profile-batch", type=int, help="also profile one call at this batch size")
    parser.add_argument("--choose", type=Path, help='write {"batch_size": B, "cache": C} (the most tokens/s) here')
    parser.add_argument("--grouping", type=Path, help="a `data prepare` dir: measure batching by prompt length instead")
    parser.add_argument("--tokenizer", type=Path, help="with --grouping: the target dir whose tokenizer and chat template render the prompts")
    parser.add_argument("--window", type=int, default=4, help="with --grouping: batches of prompts grouped (regenerate's default)")
    parser.add_argument("--grouping-prompts", type=int, default=256, help="with --grouping: prompts generated for the wall-clock rows")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    if args.grouping and not args.tokenizer:
        parser.error("--grouping needs --tokenizer TARGET_DIR (the prompts are rendered through its chat template)")
    if args.new_tokens < 2:
        parser.error("--new-tokens must be at least 2 (one step is timed against the 1-token prefill)")
    import torch

    from backend.profiles import load_profile

    profile = load_profile(args.profile)
    target = random_target(profile, args.device, args.dtype, args.layers)
    result: dict = {
        "bench": "regenerate",
        "device": torch.cuda.get_device_name(0) if args.device.startswith("cuda") else "cpu",
        "profile": profile.name,
        "dtype": args.dtype,
        "layers": target.model.config.num_hidden_layers,
        "new_tokens": args.new_tokens,
        "rows": [],
    }
    if args.grouping:
        result["grouping"] = grouping(target, args)
        if args.out:
            args.out.write_text(json.dumps(result, indent=1) + "\n")
        return 0
    for batch in args.batch:
        result["rows"].append(measure(target, batch, args))
    best = best_setting(result["rows"])
    if best:
        result["best_batch"], result["best_cache"] = best["batch_size"], best["cache"]
        if args.choose:
            args.choose.write_text(json.dumps(best) + "\n")
    if args.profile_batch:
        result["profile_table"] = profile_table(target, args.profile_batch, args)
        print(result["profile_table"])
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
