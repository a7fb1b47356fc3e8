#!/usr/bin/env python3
"""Where one static-cache decode step's time goes on a GPU: kernels by kind, kernel time against the graphed step.

The reference engine's plain decode on one H200 ran 1.66 ms a token compiled (2.22 ms with graphs alone) for
SmolLM2-135M, whose weights take ~0.06 ms to read: the step is a chain of ~300-900 small kernels. This script builds
StaticDecoder on a random target of the profile's shape (weights do not change the timing) and, per variant (graphs
alone; graphs + torch.compile; the same with inductor's coordinate-descent tuning or max-autotune's GEMM templates;
each attention kind of static_decode.ATTENTION_KINDS):

  - tok/s of plain and of EAGLE-3 (3 steps; a random draft, so rounds accept ~nothing: the per-round cost is what counts)
    decoding under CUDA graphs, with the per-step breakdown (StepTimes) and the prompt's prefill;
  - the replay time of the captured decode graph alone (CUDA events over many replays);
  - for graphs_attention_triton: the Triton attention's agreement with SDPA in bf16 on this GPU (kernel errors
    against float32 SDPA beside bf16 SDPA's own; plain decoding's tokens with each kind);
  - for graphs_linear_triton: the same for the Triton skinny linear against the eager ops, and each of the target's
    products at 1, 2, 4 and 8 rows timed alone under a CUDA graph: cuBLAS with the eager norm / gate / residual, cuBLAS
    alone, and the kernel at its default tile and wider / narrower column blocks;
  - a torch.profiler trace of the same step run without a graph: kernels per step, their summed time by kind (GEMM,
    attention, fused Triton, element-wise, copies) and the top kernels. The summed kernel time against the graph's
    replay time says how much is work and how much is the gaps between kernels.

    python benchmarks/profile_decode_step.py --out decode_profile.json          # on a GPU host; ~2-4 minutes
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

VARIANTS = {
    "graphs": {"compile": False},
    "compiled": {"compile": True},
    "compiled_coordinate_descent": {"compile": True, "inductor": {"coordinate_descent_tuning": True}},
    "compiled_max_autotune": {"compile": True, "inductor": {"coordinate_descent_tuning": True, "max_autotune_gemm": True}},
    # the attention kinds of static_decode.ATTENTION_KINDS beside "sdpa" (cuDNN's flash kernel: 34 % of a compiled step)
    "graphs_attention_efficient": {"compile": False, "attention": "efficient"},
    "graphs_attention_math": {"compile": False, "attention": "math"},
    "compiled_attention_efficient": {"compile": True, "attention": "efficient"},
    "compiled_attention_math": {"compile": True, "attention": "math"},
    # triton_attention.decode_attention: reads only the keys up to the step's positions (a compiled step attends
    # over the whole cache, so there the saving grows with the cache)
    "graphs_attention_triton": {"compile": False, "attention": "triton"},
    "compiled_attention_triton": {"compile": True, "attention": "triton"},
    "compiled_attention_triton_coordinate_descent": {"compile": True, "attention": "triton", "inductor": {"coordinate_descent_tuning": True}},
    # triton_linear.skinny_linear for every product of a step (the norm, the gate and the residual inside): the GEMMs
    # were 58 % of a compiled step with the Triton attention (2026-12-03)
    "graphs_linear_triton": {"compile": False, "attention": "triton", "linear": "triton"},
    "compiled_linear_triton": {"compile": True, "attention": "triton", "linear": "triton"},
    # the kernel for a verify's (and the draft commit's) rows too: its loop over the rows inside whole steps
    "graphs_linear_triton_all": {"compile": False, "attention": "triton", "linear": "triton-all"},
    "compiled_linear_triton_all": {"compile": True, "attention": "triton", "linear": "triton-all"},
    # those rows as a row grid: each row in programs of its own, the one-row kernel (2026-12-05, untimed until then)
    "graphs_linear_triton_rows": {"compile": False, "attention": "triton", "linear": "triton-rows"},
    "compiled_linear_triton_rows": {"compile": True, "attention": "triton", "linear": "triton-rows"},
}
KINDS = (  # kernel name fragments, first match wins
    ("attention", ("fmha", "flash", "attention", "efficient_attention")),
    ("gemm", ("gemm", "gemv", "cutlass", "xmma", "cublas", "splitk", "nvjet", "mm_")),
    ("triton_fused", ("triton",)),
    ("copy_index", ("copy", "index", "scatter", "gather", "cat", "memset", "memcpy")),
    ("reduce_softmax_argmax", ("reduce", "softmax", "argmax", "max")),
    ("elementwise", ("elementwise", "vectorized", "unrolled")),
)


def kind_of(name: str) -> str:
    lowered = name.lower()
    for kind, fragments in KINDS:
        if any(fragment in lowered for fragment in fragments):
            return kind
    return "other"


def kernel_table(run_step, steps: int) -> dict:
    """Profile `steps` calls of run_step (no graph): kernels per step, microseconds per step by kind, top kernels."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        run_step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            run_step()
        torch.cuda.synchronize()
    by_kind: dict[str, float] = defaultdict(float)
    by_name: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    count = 0
    for event in prof.events():
        if event.device_type != torch.autograd.DeviceType.CUDA:
            continue
        micros = event.time_range.elapsed_us()
        count += 1
        by_kind[kind_of(event.name)] += micros
        by_name[event.name][0] += 1
        by_name[event.name][1] += micros
    top = sorted(by_name.items(), key=lambda item: -item[1][1])[:15]
    return {
        "kernels_per_step": count / steps,
        "kernel_us_per_step": sum(by_kind.values()) / steps,
        "us_per_step_by_kind": {kind: round(total / steps, 2) for kind, total in sorted(by_kind.items(), key=lambda item: -item[1])},
        "top_kernels": [{"name": name[:120], "per_step": calls / steps, "us_per_step": round(total / steps, 2)} for name, (calls, total) in top],
    }


def replay_ms(graph, replays: int) -> float:
    import torch

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(10):
        graph.replay()
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / replays


def decode_rate(decoder, prompts, max_new: int, speculative: bool) -> dict:
    import torch

    from backend.serve.reference.static_decode import StepTimes

    call = decoder.generate if speculative else decoder.plain
    call(prompts[0], 16)  # captures (and compiles) every shape these prompts use before the clock runs
    for prompt in prompts:
        call(prompt, 4)
    decoder.step_times = StepTimes()
    torch.cuda.synchronize()
    began, tokens = time.perf_counter(), 0
    for prompt in prompts:
        tokens += call(prompt, max_new).completion_tokens
    torch.cuda.synchronize()
    seconds = time.perf_counter() - began
    summary = decoder.step_times.summary()
    decoder.step_times = None
    return {"tok_s": round(tokens / seconds, 1), "tokens": tokens, "seconds": round(seconds, 3), "breakdown_ms": summary}


def fresh_prefills(model, draft, aux, lengths: list[int]) -> list[dict]:
    """First and second time to the first token of prompts of lengths no request brought before, on the loading
    thread, with prompts padded to prefill_widths (all run once at load, as the engine does) and unpadded: is a
    new prompt shape itself slow, so that the padding earns its keep?"""
    import torch

    from backend.serve.reference.static_decode import StaticDecoder

    rows = []
    generator = torch.Generator().manual_seed(1)
    max_len = max(lengths) + 64
    for pad in (True, False):
        decoder = StaticDecoder(model, draft, aux, num_steps=3, eos_token_id=-1, max_len=max_len, pad_prefill=pad)
        decoder.warm_prefill()
        decoder.plain([1, 2, 3, 4], 3)
        decoder.generate([1, 2, 3, 4], 8)
        for length in lengths:
            prompt = torch.randint(1, 1000, (length + (0 if pad else 1),), generator=generator).tolist()
            for attempt in (1, 2):
                for speculative in (True, False):
                    torch.cuda.synchronize()
                    began = time.perf_counter()
                    (decoder.generate if speculative else decoder.plain)(prompt, 1)
                    torch.cuda.synchronize()
                    ms = 1000 * (time.perf_counter() - began)
                    rows.append(
                        {"padded": pad, "length": len(prompt), "attempt": attempt, "kind": "speculative" if speculative else "plain", "ms": round(ms, 2)}
                    )
    return rows


def triton_agreement(model, aux, prompts, max_new: int, max_len: int) -> dict:
    """The Triton attention against SDPA on this GPU in bf16: the kernel's largest error against a float32 SDPA
    beside bf16 SDPA's own, per shape; and plain greedy decoding's tokens with each kind (bf16 rounding may part
    them after a while: the matching prefix says when)."""
    import torch
    import torch.nn.functional as F

    from backend.serve.reference.static_decode import StaticDecoder
    from backend.serve.reference.triton_attention import decode_attention
    from benchmarks.bench_decode_speed import prefix_match

    generator = torch.Generator(device="cuda").manual_seed(0)
    shapes = []
    for rows_per_head, bucket, last in ((3, 612, 300), (12, 612, 300), (3, 1160, 1100), (12, 4096, 100)):
        seq = rows_per_head // 3
        q = torch.randn(1, 3, rows_per_head, 64, device="cuda", dtype=torch.bfloat16, generator=generator)
        k = torch.randn(1, 3, bucket, 64, device="cuda", dtype=torch.bfloat16, generator=generator)
        v = torch.randn(1, 3, bucket, 64, device="cuda", dtype=torch.bfloat16, generator=generator)
        positions = torch.arange(last - seq + 1, last + 1, device="cuda")
        visible = (torch.arange(bucket, device="cuda")[None, :] <= positions[:, None]).repeat(3, 1)
        exact = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=visible, scale=0.125)
        sdpa = F.scaled_dot_product_attention(q, k, v, attn_mask=visible, scale=0.125)
        ours = decode_attention(q, k, v, positions, 0.125)
        shapes.append(
            {"rows": rows_per_head, "bucket": bucket, "last_position": last,
             "triton_max_abs_error": float((ours.float() - exact).abs().max()), "sdpa_bf16_max_abs_error": float((sdpa.float() - exact).abs().max())}
        )  # fmt: skip
    outputs = {}
    for kind in ("sdpa", "triton"):
        decoder = StaticDecoder(model, None, aux, eos_token_id=-1, max_len=max_len, attention=kind)
        outputs[kind] = [decoder.plain(prompt, max_new).output_ids for prompt in prompts]
    prefixes = [prefix_match(a, b) for a, b in zip(outputs["sdpa"], outputs["triton"])]
    return {"kernel_vs_float32_sdpa": shapes, "plain_tokens_identical": sum(a == b for a, b in zip(outputs["sdpa"], outputs["triton"])),
            "of": len(prompts), "matching_prefix": prefixes, "new_tokens": max_new}  # fmt: skip


def _products(model) -> dict[str, tuple[int, int, dict]]:
    """The target layer's products as (columns, inner, which parts ride along), as StaticTarget calls them."""
    config = model.config
    hidden, heads = config.hidden_size, config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    qkv = (heads + 2 * (getattr(config, "num_key_value_heads", None) or heads)) * head_dim
    return {
        "qkv": (qkv, hidden, {"norm": True}),
        "o_proj": (hidden, heads * head_dim, {"residual": True}),
        "gate_up": (2 * config.intermediate_size, hidden, {"norm": True}),
        "down": (hidden, config.intermediate_size, {"gated": True, "residual": True}),
        "lm_head": (config.vocab_size, hidden, {}),
    }


def _operands(rows: int, columns: int, inner: int, parts: dict, generator):
    import torch

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, device="cuda", generator=generator) * scale).to(torch.bfloat16)

    x = randn(1, rows, 2 * inner if parts.get("gated") else inner)
    norm = randn(inner) if parts.get("norm") else None
    residual = randn(1, rows, columns) if parts.get("residual") else None
    return x, randn(columns, inner, scale=inner**-0.5), norm, residual


def _eager_product(x, weight, norm, residual, gated: bool):
    from backend.serve.reference.static_decode import eager_linear

    return eager_linear(x, weight, norm=norm, eps=1e-5, residual=residual, gated=gated)


def _graphed_us(call, repeats: int = 20, replays: int = 20) -> float:
    """Microseconds per call of `call`, captured `repeats` times in a row in one CUDA graph (the kernels' chain as a
    decode step runs them), replayed."""
    import torch

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        call()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(repeats):
            call()
    return 1000 * replay_ms(graph, replays) / repeats


def linear_shapes(model, aux, prompts, max_new: int, max_len: int) -> list[dict]:
    """Each product of the target's step at 1, 2, 4 and 8 rows (a decode, a verify of 1, 3 and 7 steps), timed alone under a CUDA graph: the eager ops around
    cuBLAS, cuBLAS alone, and triton_linear's kernel at its default tile and at half / double / 4x the columns (its
    rows in turn against each weight tile where there are several), and over several rows as a row grid of 1, 2 or 4
    rows a program (1: the linear kind "triton-rows", each row the one-row kernel at its tile)."""
    import torch
    import torch.nn.functional as F

    from backend.serve.reference.triton_linear import MAX_TILE, launch, tiles
    from backend.serve.reference.triton_runtime import next_power_of_two

    generator = torch.Generator(device="cuda").manual_seed(1)
    rows_out = []
    for rows in (1, 2, 4, 8):
        for name, (columns, inner, parts) in _products(model).items():
            x, weight, norm, residual = _operands(rows, columns, inner, parts, generator)
            gated = bool(parts.get("gated"))
            plain_x = x[..., :inner] if gated else x
            row: dict = {"product": name, "rows": rows, "columns": columns, "inner": inner, "weight_mb": round(weight.numel() * 2 / 1e6, 2)}
            row["eager_ops_us"] = round(_graphed_us(lambda: _eager_product(x, weight, norm, residual, gated)), 2)
            row["cublas_alone_us"] = round(_graphed_us(lambda: F.linear(plain_x, weight)), 2)
            default = tiles(rows, columns, inner)
            row["triton_default_tile"] = list(default)
            row["triton_us"] = {}
            for factor in (0.5, 1, 2, 4):
                column_block = int(default[1] * factor)
                if column_block < 2 or column_block > 128:
                    continue
                inner_block = max(16, min(next_power_of_two(inner), 2 * MAX_TILE // column_block, MAX_TILE // default[0]))
                tile = (default[0], column_block, inner_block)
                row["triton_us"][f"{column_block}x{inner_block}"] = round(
                    _graphed_us(lambda tile=tile: launch(x, weight, None, norm, 1e-5, residual, gated, tile)), 2
                )
            if rows > 1:
                row["triton_row_grid_us"] = {  # rows a program: 1 (the linear kind "triton-rows"), 2, 4
                    per: round(
                        _graphed_us(lambda per=per: launch(x, weight, None, norm, 1e-5, residual, gated, tiles(per, columns, inner), rows_per_program=per)), 2
                    )
                    for per in (1, 2, 4)
                    if per < rows
                }
            rows_out.append(row)
    return rows_out


def linear_agreement(model, aux, prompts, max_new: int, max_len: int) -> dict:
    """triton_linear against the eager ops on this GPU in bf16: the largest error of each against a float32
    computation, per product at 4 rows; and plain greedy decoding's tokens with each linear kind."""
    import torch

    from backend.serve.reference.static_decode import StaticDecoder
    from backend.serve.reference.triton_linear import skinny_linear
    from benchmarks.bench_decode_speed import prefix_match

    generator = torch.Generator(device="cuda").manual_seed(2)
    shapes = []
    for name, (columns, inner, parts) in _products(model).items():
        x, weight, norm, residual = _operands(4, columns, inner, parts, generator)
        gated = bool(parts.get("gated"))
        exact = _eager_product(x.float(), weight.float(), None if norm is None else norm.float(), None if residual is None else residual.float(), gated)
        ours = skinny_linear(x, weight, norm=norm, eps=1e-5, residual=residual, gated=gated)
        eager = _eager_product(x, weight, norm, residual, gated)
        shapes.append(
            {
                "product": name,
                "triton_max_abs_error": float((ours.float() - exact).abs().max()),
                "eager_bf16_max_abs_error": float((eager.float() - exact).abs().max()),
            }
        )
    outputs = {}
    for linear in ("torch", "triton"):
        decoder = StaticDecoder(model, None, aux, eos_token_id=-1, max_len=max_len, attention="triton", linear=linear)
        outputs[linear] = [decoder.plain(prompt, max_new).output_ids for prompt in prompts]
    pairs = list(zip(outputs["torch"], outputs["triton"]))
    return {"kernel_vs_float32": shapes, "plain_tokens_identical": sum(a == b for a, b in pairs), "of": len(prompts),
            "matching_prefix": [prefix_match(a, b) for a, b in pairs], "new_tokens": max_new}  # fmt: skip


def measure_variant(name: str, spec: dict, model, draft, aux, prompts, max_new: int, max_len: int, profile_steps: int) -> dict:
    import torch._dynamo

    from backend.serve.reference.static_decode import StaticDecoder
    from benchmarks.bench_decode_speed import set_inductor

    # A new StaticDecoder passes the guards of the last one's compiled steps (same code, same shapes): without a reset
    # a later variant reuses the first one's kernels whatever its inductor options (2026-12-02: a 5.8 s "compile").
    torch._dynamo.reset()
    previous = set_inductor(spec.get("inductor", {}))
    began = time.perf_counter()
    kernels = {"attention": spec.get("attention", "sdpa"), "linear": spec.get("linear", "torch")}
    try:
        plain = StaticDecoder(model, None, aux, eos_token_id=-1, max_len=max_len, compile=spec["compile"], **kernels)
        row: dict = {"variant": name, "inductor": spec.get("inductor", {}), **kernels}
        row["plain"] = decode_rate(plain, prompts, max_new, speculative=False)
        longest = max(len(p) for p in prompts)
        bucket = plain._bucket(longest + max_new)
        graph = plain.graphs.get(("decode", bucket))
        row["decode_graph_replay_ms"] = round(replay_ms(graph, 500), 4) if graph is not None else None
        plain._set_scalars(longest, 0, 0, 1)
        row["decode_kernels"] = kernel_table(lambda: plain._decode_fn(bucket), profile_steps)
        eagle = StaticDecoder(model, draft, aux, num_steps=3, eos_token_id=-1, max_len=max_len, compile=spec["compile"], **kernels)
        row["eagle_k3"] = decode_rate(eagle, prompts, max_new, speculative=True)
        row["eagle_k3"]["speedup_per_round_vs_plain_token"] = round(
            row["plain"]["breakdown_ms"]["round_wall_ms"] / max(row["eagle_k3"]["breakdown_ms"]["round_wall_ms"], 1e-9), 3
        )
        row["verify_kernels"] = kernel_table(lambda: eagle._verify_fn(bucket), profile_steps)
        row["draft_round_kernels"] = kernel_table(lambda: eagle._draft_fn(bucket), profile_steps)
        if name == "graphs_attention_triton":
            try:
                row["triton_agreement"] = triton_agreement(model, aux, prompts, max_new, max_len)
            except Exception as error:
                row["triton_agreement"] = {"error": f"{type(error).__name__}: {error}"[:500]}
        if name == "graphs_linear_triton":
            for key, check in (("linear_agreement", linear_agreement), ("linear_shapes", linear_shapes)):
                try:
                    row[key] = check(model, aux, prompts, max_new, max_len)
                except Exception as error:
                    row[key] = {"error": f"{type(error).__name__}: {error}"[:500]}
        if name == "graphs":
            try:  # its own decoders (context for the longest), so a failure here keeps the row measured above
                row["fresh_prefills"] = fresh_prefills(model, draft, aux, [23, 77, 301, 613])
            except Exception as error:
                row["fresh_prefills"] = {"error": f"{type(error).__name__}: {error}"[:500]}
        row["seconds_to_measure"] = round(time.perf_counter() - began, 1)
        return row
    finally:
        set_inductor(previous)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--profile", default="smollm2-135m")
    parser.add_argument(
        "--variants",
        nargs="+",
        default=["graphs_attention_triton", "compiled_attention_triton", "compiled", "compiled_coordinate_descent", "compiled_attention_math"],
        choices=list(VARIANTS),
    )
    parser.add_argument("--prompt-lengths", type=int, nargs="+", default=[40, 180, 420])
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--max-len", type=int, help="the static cache's positions (default: the longest prompt + new tokens + 64)")
    parser.add_argument("--profile-steps", type=int, default=20)
    parser.add_argument("--budget-s", type=float, default=400, help="skip the variants that would start after this many seconds")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    import torch

    from benchmarks.probe_first_token import build

    device = torch.device("cuda")
    model, draft, aux, _ = build(args.profile, "bfloat16", device)
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1, 1000, (length,), generator=generator).tolist() for length in args.prompt_lengths]
    max_len = args.max_len or max(args.prompt_lengths) + args.max_new_tokens + 64
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    report: dict = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "weight_bytes": weight_bytes, "max_len": max_len, "variants": []}
    started = time.perf_counter()
    for name in args.variants:
        if time.perf_counter() - started > args.budget_s:
            report["variants"].append({"variant": name, "skipped": f"past --budget-s {args.budget_s}"})
            continue
        try:
            row = measure_variant(name, VARIANTS[name], model, draft, aux, prompts, args.max_new_tokens, max_len, args.profile_steps)
        except Exception as error:  # one variant's failure (an inductor option this torch lacks) leaves the others measured
            row = {"variant": name, "error": f"{type(error).__name__}: {error}"[:500]}
        report["variants"].append(row)
        torch.cuda.empty_cache()  # the variant's decoders (caches, graph pools) are garbage now
        brief = {k: row[k] for k in ("variant", "decode_graph_replay_ms", "seconds_to_measure", "error") if k in row}
        if "plain" in row:
            brief.update(plain_tok_s=row["plain"]["tok_s"], eagle_tok_s=row["eagle_k3"]["tok_s"], decode_kernels=row["decode_kernels"]["us_per_step_by_kind"])
        print(json.dumps(brief), flush=True)
        if args.out:
            args.out.write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
