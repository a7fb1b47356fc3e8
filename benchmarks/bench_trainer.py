#!/usr/bin/env python3
"""Training-step speed of our EAGLE-3 trainer at the Llama-3.1-8B draft shape, against the SpecForge anchor.

What runs is the trainer's own step (backend.train.trainer.Trainer.train_step): teacher logits from a
frozen bf16 lm_head over stored last hidden states (SpecForge's offline mode), the 7-step TTT unroll
under bf16 autocast, the 0.8^k soft-CE loss, backward, clipping and AdamW. Inputs are synthetic
offline hidden states: aux [1, 2048, 12288], last hidden [1, 2048, 4096], built so that ~95 % of
the teacher's argmax tokens fall in the 32000-token draft vocab (as in the anchor run).

Reported: median step time, tokens/s, peak memory, achieved TFLOP/s and MFU against a bf16 8192^3
matmul measured in the same process, with the anchor file's analytic FLOP count (36.21 TFLOP/step),
and the ratio against SpecForge (the anchor numbers in shared/reference/trainer-anchor-specforge-h200.md,
or specforge_bench.py JSON files given with --specforge-json).

  one H200:        python benchmarks/bench_trainer.py --json $OUT/ours_1gpu.json [--specforge-json sf.json ...]
  N GPUs:          torchrun --standalone --nproc_per_node N benchmarks/bench_trainer.py \
                       --json $OUT/ours_Ngpu.json --baseline-json $OUT/ours_1gpu.json
  CPU smoke test:  python benchmarks/bench_trainer.py --small --json /tmp/bench_small.json
"""

from __future__ import annotations

import os

# NVLink multicast stays off on the lent machines; set before torch.distributed initialises anything.
for _key, _value in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"), ("NVSHMEM_DISABLE_NVLS", "1")):
    os.environ.setdefault(_key, _value)

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

# SpecForge on one H200 (trainer-anchor-specforge-h200.md): medians over its two runs.
SPECFORGE_ANCHOR = {
    "specforge flex_attention+FSDP (script default)": {"step_ms": 121.5, "tokens_per_s": 16888, "peak_gib": 13.63},
    "specforge flex_attention, no FSDP": {"step_ms": 116.85, "tokens_per_s": 17527, "peak_gib": 12.70},
    "specforge sdpa+FSDP": {"step_ms": 162.45, "tokens_per_s": 12616, "peak_gib": 18.77},
}
LOSS_STEPS = 50
SHAPES = {"llama": "llama3.1-8b", "kimi": "kimi-k2.5"}  # --shape: the profile whose draft/target shape is benchmarked


def analytic_flops(hidden, intermediate, heads, kv_heads, head_dim, vocab, draft_vocab, seq, ttt) -> dict:
    """Matmul FLOPs of one step at batch 1, counted as the anchor does (dense S x S attention every TTT step).

    Per TTT step (forward): q/k/v from the 2H input, o_proj, SwiGLU MLP, draft lm_head, attention over
    the first block plus the per-position dot products with earlier steps; backward = 2 x forward.
    fc (3H -> H) runs once (forward + weight grad); the frozen teacher head runs forward only.
    """
    per_step = {
        "qkv_proj": 2 * seq * (2 * hidden) * (heads + 2 * kv_heads) * head_dim,
        "o_proj": 2 * seq * heads * head_dim * hidden,
        "mlp": 3 * 2 * seq * hidden * intermediate,
        "draft_lm_head": 2 * seq * hidden * draft_vocab,
        "attention_first_block": 2 * 2 * seq * seq * head_dim * heads,
    }
    forward = sum(sum(per_step.values()) + 2 * 2 * seq * head_dim * heads * k for k in range(ttt))
    fc = 2 * seq * 3 * hidden * hidden
    teacher = 2 * seq * hidden * vocab
    return {
        "per_ttt_step_forward": per_step,
        "ttt_forward": forward,
        "fc_forward": fc,
        "teacher_head_forward": teacher,
        "train_step_total": 3 * forward + 2 * fc + teacher,
    }


def profile_for(args):
    from backend.profiles import load_profile, parse_profile

    if not args.small:
        return load_profile(SHAPES[args.shape])
    return parse_profile(
        {
            "name": "bench-small",
            "target": {
                "path": "synthetic",
                "architecture": "LlamaForCausalLM",
                "hidden_size": 128,
                "num_layers": 8,
                "vocab_size": 1024,
                "aux_layer_ids": [1, 3, 4],
                "dtype": "float32",
            },
            "draft": {
                "hidden_size": 128,
                "num_attention_heads": 4,
                "num_key_value_heads": 2,
                "intermediate_size": 256,
                "draft_vocab_size": 256,
                "max_position_embeddings": 512,
            },
            "train": {"learning_rate": 1e-4, "batch_size": 1, "seq_len": 128, "ttt_length": 7, "grad_clip": 0.5, "dtype": "float32"},
        },
        "bench-small",
    )


class SyntheticOffline:
    """One stored offline sample, the same on every rank, already on the device; teacher logits from a frozen lm_head.

    Every rank holding the same sample makes DDP's averaged gradient equal the single-GPU gradient, so the first
    50 losses of an N-GPU run must match the 1-GPU run up to bf16 noise: a check of the multi-GPU path itself.
    """

    def __init__(self, profile, device, rank: int, world_size: int, dtype):
        import torch

        target, draft = profile.target, profile.draft
        hidden, vocab, draft_vocab, seq = target.hidden_size, target.vocab_size, draft.draft_vocab_size, profile.train.seq_len
        generator = torch.Generator().manual_seed(1)
        self.selected = torch.sort(torch.randperm(vocab, generator=generator)[:draft_vocab]).values
        self.lm_head = (torch.randn(vocab, hidden, generator=generator) * hidden**-0.5).to(device, dtype)
        self.embed = torch.randn(vocab, hidden, generator=generator) * 0.02
        rank_gen = torch.Generator().manual_seed(100)
        in_draft = torch.rand(seq, generator=rank_gen) < 0.95
        tokens = torch.where(
            in_draft, self.selected[torch.randint(0, draft_vocab, (seq,), generator=rank_gen)], torch.randint(0, vocab, (seq,), generator=rank_gen)
        )
        rows = self.lm_head[tokens.to(device)].float().cpu()
        # A hidden state aligned with the chosen token's lm_head row makes that token the teacher's argmax.
        last = 15.0 * rows / rows.square().sum(-1, keepdim=True) + 0.1 * torch.randn(seq, hidden, generator=rank_gen)
        self.last_hidden = last[None].to(device, dtype)
        self.aux = torch.randn(1, seq, len(target.aux_layer_ids) * hidden, generator=rank_gen).to(device, dtype)
        self.input_ids = torch.randint(0, vocab, (1, seq), generator=rank_gen).to(device)
        self.loss_mask = torch.ones(1, seq, dtype=torch.uint8, device=device)
        self.aux_width, self.hidden_size, self.vocab_size = self.aux.shape[-1], hidden, vocab
        self.world_size = world_size

    def size(self, split: str) -> int:
        return self.world_size

    def batch(self, split, indices, device):
        import torch

        from backend.train.data import TrainBatch

        with torch.no_grad():
            logits = torch.nn.functional.linear(self.last_hidden, self.lm_head)
        return TrainBatch(self.input_ids, self.loss_mask, self.aux, logits)

    def vocab_mapping(self):
        import torch

        d2t = self.selected - torch.arange(self.selected.numel())
        t2d = torch.zeros(self.vocab_size, dtype=torch.bool)
        t2d[self.selected] = True
        return d2t, t2d

    def embed_weight(self):
        return self.embed

    def describe_target(self) -> dict:
        return {"path": "synthetic"}


def flops_text(value: float, per_second: bool = False) -> str:
    unit = "TFLOP" if value >= 1e12 else "GFLOP"
    return f"{value / (1e12 if unit == 'TFLOP' else 1e9):.2f} {unit}" + ("/s" if per_second else "")


def sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def matmul_rate(device, size: int, dtype) -> float:
    import torch

    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    for _ in range(3):
        torch.mm(a, b)
    times = []
    for _ in range(10):
        sync(device)
        start = time.perf_counter()
        torch.mm(a, b)
        sync(device)
        times.append(time.perf_counter() - start)
    return 2 * size**3 / statistics.median(times)


def run(args):
    """(distributed context, result dict) of one benchmark run on this rank."""
    import torch

    from backend.train.attention import default_backend
    from backend.train.draft import DraftModelConfig, Eagle3Draft
    from backend.train.trainer import TrainOptions, Trainer, init_distributed

    profile = profile_for(args)
    device_name = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    ctx = init_distributed(device_name)
    device = ctx.device
    compute_dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    torch.manual_seed(0)
    rate = matmul_rate(device, args.matmul_size or (8192 if device.type == "cuda" else 1024), compute_dtype)

    source = SyntheticOffline(profile, device, ctx.rank, ctx.world_size, compute_dtype)
    config = DraftModelConfig.from_profile(profile)
    draft = Eagle3Draft(config, attn_backend=args.attn_backend)
    draft.load_target_embedding(source.embed_weight())
    draft.set_vocab_mapping(*source.vocab_mapping())
    extra = {} if args.compile is None else {"compile": bool(args.compile)}  # the pre-compile trainer (--code-root) has no such option
    trainer = Trainer(TrainOptions(profile=profile, attn_backend=args.attn_backend, max_steps=100_000, **extra))
    trainer.attach(ctx, source, draft)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)

    total_steps = max(args.warmup + args.steps, LOSS_STEPS)
    losses, grad_norms, times = [], [], []
    for step in range(total_steps):
        sync(device)
        start = time.perf_counter()
        result, grad_norm, _lr = trainer.train_step(step)
        sync(device)
        elapsed = time.perf_counter() - start
        if step >= args.warmup:
            times.append(elapsed)
        losses.append(result.total.detach())
        grad_norms.append(grad_norm)
        if step < args.warmup and ctx.is_main:
            print(f"warm-up step {step}: {elapsed * 1e3:.1f} ms", flush=True)
    losses_t = torch.stack(losses).double()
    ctx.all_reduce(losses_t)
    loss_values = (losses_t / ctx.world_size).tolist()
    timed = times[: args.steps]
    step_s = statistics.median(timed)
    seq = profile.train.seq_len
    flops = analytic_flops(
        config.hidden_size,
        config.intermediate_size,
        config.num_attention_heads,
        config.num_key_value_heads,
        config.head_dim,
        config.vocab_size,
        config.draft_vocab_size,
        seq,
        profile.train.ttt_length,
    )
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
    reserved = torch.cuda.max_memory_reserved(device) / 2**30 if device.type == "cuda" else None
    mine = {
        "rank": ctx.rank,
        "device": str(device),
        "median_step_ms": step_s * 1e3,
        "min_step_ms": min(timed) * 1e3,
        "max_step_ms": max(timed) * 1e3,
        "tokens_per_s": seq / step_s,
        "peak_mem_allocated_gib": peak,
        "peak_mem_reserved_gib": reserved,
    }
    per_rank = _gather(ctx, mine)
    result = {
        "shape": "small" if args.small else f"{SHAPES[args.shape]} draft",
        "world_size": ctx.world_size,
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "attn_backend": draft.attn_backend or default_backend(device),
        "dtype": str(compute_dtype),
        "seq": seq,
        "batch_per_rank": 1,
        "ttt_length": profile.train.ttt_length,
        "warmup_steps": args.warmup,
        "timed_steps": len(timed),
        "matmul_tflops": rate / 1e12,
        "flops_analytic": flops,
        "median_step_ms": step_s * 1e3,
        "step_ms": [t * 1e3 for t in timed],
        "tokens_per_s_per_rank": seq / step_s,
        "tokens_per_s": seq * ctx.world_size / max(r["median_step_ms"] for r in per_rank) * 1e3,
        "achieved_tflops_per_rank": flops["train_step_total"] / step_s / 1e12,
        "mfu": flops["train_step_total"] / step_s / rate,
        "peak_mem_allocated_gib": peak,
        "peak_mem_reserved_gib": reserved,
        "per_rank": per_rank,
        "losses_first_50": loss_values[:LOSS_STEPS],
        "grad_norm_last": float(grad_norms[-1]),
        "finite": all(v == v and abs(v) != float("inf") for v in loss_values),
        "env": {k: os.environ.get(k) for k in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS")},
    }
    result["code_root"] = str(args.code_root) if args.code_root else "this checkout"
    result["compile"] = getattr(trainer, "compiled", None)
    result["mixed_bf16_master_weights"] = getattr(trainer, "mixed", None)
    result["shape_name"] = args.shape if not args.small else "small"
    if args.profile and ctx.world_size == 1:
        result["profile"] = profile_steps(trainer, total_steps, device, steps=2)
    if args.flop_counter and ctx.world_size == 1:
        result["flops_counter_total"] = count_flops(trainer)
    return ctx, result


KERNEL_GROUPS = (  # (group, substrings of the kernel name), first match wins
    ("gemm", ("gemm", "cutlass", "nvjet", "xmma", "cublas", "sm90_")),
    ("attention (flex/flash)", ("flex", "flash", "fmha", "triton_tem")),
    ("triton fused (inductor)", ("triton_",)),
    ("optimizer, clip, master copies", ("adam", "fusedoptimizer", "multi_tensor", "foreach")),
    ("softmax/logsumexp/reductions", ("softmax", "logsumexp", "reduce", "norm")),
    ("copies/casts", ("copy", "cast", "convert", "cat", "index", "gather", "scatter")),
    ("elementwise", ("elementwise", "vectorized", "unrolled")),
)
ANNOTATIONS = ("#", "ProfilerStep", "Optimizer.")  # record_function ranges, not kernels: their device time is their kernels'


def group_kernels(kernels: list[dict]) -> dict[str, float]:
    groups: dict[str, float] = {}
    for row in kernels:
        lowered = row["name"].lower()
        group = next((name for name, keys in KERNEL_GROUPS if any(key in lowered for key in keys)), "other")
        groups[group] = groups.get(group, 0.0) + row["device_ms"]
    return dict(sorted(groups.items(), key=lambda kv: -kv[1]))


def profile_steps(trainer, first_step: int, device, steps: int = 2) -> dict:
    """torch.profiler over `steps` training steps: top kernels by device time, time by kernel group, GPU busy share."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    sync(device)
    start = time.perf_counter()
    with profile(activities=activities) as prof:
        for index in range(steps):
            trainer.train_step(first_step + index)
        sync(device)
    wall = time.perf_counter() - start
    rows = []
    for event in prof.key_averages():
        self_device = getattr(event, "self_device_time_total", None)
        if self_device is None:
            self_device = getattr(event, "self_cuda_time_total", 0)
        if getattr(event, "device_type", None) == DeviceType.CUDA or (self_device and getattr(event, "device_type", None) != DeviceType.CPU):
            rows.append({"name": event.key[:160], "count": event.count, "device_ms": self_device / 1e3 / steps})
    kernels = sorted((r for r in rows if r["device_ms"] > 0 and not any(a in r["name"] for a in ANNOTATIONS)), key=lambda r: -r["device_ms"])
    groups = group_kernels(kernels)
    busy = sum(r["device_ms"] for r in kernels)
    sort_key = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    try:
        table = prof.key_averages().table(sort_by=sort_key, row_limit=40, max_name_column_width=90)
    except Exception as exc:
        table = f"(table unavailable: {exc!r})"
    return {
        "steps": steps,
        "wall_ms_per_step": wall * 1e3 / steps,
        "gpu_busy_ms_per_step": busy,
        "gpu_idle_share": max(0.0, 1 - busy / (wall * 1e3 / steps)) if wall and device.type == "cuda" else None,
        "groups_ms_per_step": groups,
        "top_kernels": kernels[:40],
        "table": table,
    }


def _gather(ctx, mine: dict) -> list[dict]:
    if not ctx.enabled:
        return [mine]
    import torch.distributed as dist

    gathered = [None] * ctx.world_size
    dist.all_gather_object(gathered, mine)
    return gathered


def count_flops(trainer) -> float:
    """FlopCounterMode over one forward+backward (no optimizer step), as the anchor's cross-check."""
    from torch.utils.flop_counter import FlopCounterMode

    counter = FlopCounterMode(display=False)
    with counter:
        batch = trainer.source.batch("train", [0], trainer.ctx.device)
        trainer._forward(batch, trainer.model).total.backward()
    trainer.optimizer.zero_grad(set_to_none=True)
    return counter.get_total_flops()


def compare(result: dict, specforge_files: list[Path], baseline: Path | None) -> list[str]:
    lines = []
    peers = {} if specforge_files else dict(SPECFORGE_ANCHOR)
    for path in specforge_files:
        if not Path(path).is_file():  # e.g. that SpecForge run failed earlier in the same device call
            lines.append(f"  vs {path}: no such file, not compared")
            continue
        data = json.loads(Path(path).read_text())
        # specforge_bench.py (20e2e3f0) records the commit; bench_specforge_v03.py the version and the commit
        version = data.get("specforge_version") or (data.get("specforge_commit") or "?")[:8]
        label = f"specforge {version} {data.get('backend')} fsdp={int(bool(data.get('fsdp')))} ({Path(path).name})"
        peers[label] = {
            "step_ms": data["median_step_ms"],
            "tokens_per_s": data["tokens_per_s"],
            "peak_gib": data.get("peak_mem_allocated_gib"),
            "mfu": data.get("mfu_vs_measured_matmul"),
            "commit": data.get("specforge_commit"),
        }
    result["peers"] = peers
    ours = result["tokens_per_s_per_rank"]
    for label, peer in peers.items():
        ratio = ours / peer["tokens_per_s"]
        result.setdefault("ratios", {})[label] = ratio
        if result["peak_mem_allocated_gib"] and peer.get("peak_gib"):
            result.setdefault("peak_memory_ratios", {})[label] = result["peak_mem_allocated_gib"] / peer["peak_gib"]
        lines.append(
            f"  vs {label}: {ratio:.2f}x tokens/s per GPU ({ours:.0f} vs {peer['tokens_per_s']:.0f}; step {result['median_step_ms']:.1f} vs {peer['step_ms']:.1f} ms"
            + (
                f"; peak {result['peak_mem_allocated_gib']:.2f} vs {peer['peak_gib']:.2f} GiB"
                if result["peak_mem_allocated_gib"] and peer.get("peak_gib")
                else ""
            )
            + (f"; MFU {100 * result['mfu']:.1f} vs {100 * peer['mfu']:.1f} %)" if peer.get("mfu") else ")")
        )
    if baseline:
        single = json.loads(Path(baseline).read_text())
        efficiency = result["tokens_per_s"] / (result["world_size"] * single["tokens_per_s_per_rank"])
        result["scaling"] = {"baseline": str(baseline), "baseline_tokens_per_s": single["tokens_per_s_per_rank"], "efficiency": efficiency}
        lines.append(
            f"  scaling: {result['tokens_per_s']:.0f} tok/s on {result['world_size']} GPUs = {100 * efficiency:.1f}% of {result['world_size']} x {single['tokens_per_s_per_rank']:.0f} (1 GPU)"
        )
        lines.append(loss_match(result, single))
    return lines


LOSS_MATCH_TOLERANCE = 0.02  # relative; bf16 autocast and reduction order differ between 1 and N GPUs


def loss_match(result: dict, single: dict) -> str:
    """Do the first losses of this run match the baseline's (same sample on every rank)?"""
    ours, theirs = result.get("losses_first_50") or [], single.get("losses_first_50") or []
    pairs = [(a, b) for a, b in zip(ours, theirs) if b]
    if not pairs:
        return "  losses: no baseline losses to compare"
    worst = max(abs(a - b) / abs(b) for a, b in pairs)
    ok = worst <= LOSS_MATCH_TOLERANCE
    result["loss_match"] = {"steps": len(pairs), "max_rel_diff": worst, "tolerance": LOSS_MATCH_TOLERANCE, "match": ok}
    verdict = "match" if ok else "DO NOT match"
    return f"  losses: first {len(pairs)} steps {verdict} the 1-GPU run within noise (max relative difference {worst:.4f}, tolerance {LOSS_MATCH_TOLERANCE})"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", type=Path, help="write the result here")
    parser.add_argument("--small", action="store_true", help="a small shape that runs on CPU in seconds (smoke test)")
    parser.add_argument("--device", help="cuda (default when present) or cpu")
    parser.add_argument("--attn-backend", choices=["eager", "sdpa", "flex"], help="TTT attention kernel (default: flex on CUDA)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20, help="timed steps (at least 50 steps run so 50 losses are saved)")
    parser.add_argument("--matmul-size", type=int, help="square bf16 matmul for the peak rate (default 8192 on CUDA)")
    parser.add_argument("--flop-counter", action="store_true", help="also count FLOPs of one step with FlopCounterMode")
    parser.add_argument("--specforge-json", type=Path, action="append", default=[], help="specforge_bench.py output(s) to compare against")
    parser.add_argument("--baseline-json", type=Path, help="this script's 1-GPU JSON: report scaling efficiency")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="llama", help="llama: Llama-3.1-8B draft (default); kimi: Kimi-K2.5 draft")
    parser.add_argument("--compile", type=int, choices=[0, 1], help="torch.compile the layer functions (default: the trainer's, on for CUDA)")
    parser.add_argument("--profile", action="store_true", help="also run 2 steps under torch.profiler; kernel table and groups go in the JSON")
    parser.add_argument(
        "--code-root",
        type=Path,
        help="import backend/ from this tree instead (e.g. an export of an older commit, to measure it beside this one in the same process setup)",
    )
    parser.add_argument("--label", help="a name for this run in the JSON")
    args = parser.parse_args(argv)
    if args.code_root:
        sys.path.insert(0, str(args.code_root.resolve()))
    ctx, result = run(args)
    result["label"] = args.label
    if ctx.is_main:
        lines = compare(result, args.specforge_json, args.baseline_json)
        print(
            f"ours ({result['shape']}, {result['attn_backend']}, {result['world_size']} x {result['device_name']}): "
            f"median step {result['median_step_ms']:.1f} ms, {result['tokens_per_s_per_rank']:.0f} tok/s per rank, "
            f"{result['tokens_per_s']:.0f} tok/s total, {flops_text(result['achieved_tflops_per_rank'] * 1e12, True)} per rank, "
            f"MFU {100 * result['mfu']:.1f}% of the measured {flops_text(result['matmul_tflops'] * 1e12, True)} matmul "
            f"(analytic {flops_text(result['flops_analytic']['train_step_total'])}/step)"
        )
        for rank in result["per_rank"]:
            peak = f", peak {rank['peak_mem_allocated_gib']:.2f} GiB (reserved {rank['peak_mem_reserved_gib']:.2f})" if rank["peak_mem_allocated_gib"] else ""
            print(f"  rank {rank['rank']} ({rank['device']}): {rank['median_step_ms']:.1f} ms/step, {rank['tokens_per_s']:.0f} tok/s{peak}")
        if "flops_counter_total" in result:
            print(
                f"  FlopCounterMode: {flops_text(result['flops_counter_total'])} (analytic {flops_text(result['flops_analytic']['train_step_total'])}; "
                "the trainer skips the draft lm_head where no target is scored)"
            )
        print("\n".join(lines))
        print(f"  losses (first {len(result['losses_first_50'])} steps): {' '.join(f'{v:.3f}' for v in result['losses_first_50'][:10])} ...")
        if "profile" in result:
            prof = result["profile"]
            print(
                f"  profile: {prof['wall_ms_per_step']:.1f} ms/step wall, GPU busy {prof['gpu_busy_ms_per_step']:.1f} ms; "
                + ", ".join(f"{k} {v:.1f}" for k, v in prof["groups_ms_per_step"].items())
            )
        if args.json:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps(result, indent=1) + "\n")
            print(f"  wrote {args.json}")
    if ctx.enabled:
        import torch.distributed as dist

        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
