#!/usr/bin/env python3
"""TTT attention backends (eager, sdpa, flex) checked against eager and timed, alone and inside the draft's ttt_forward.

python benchmarks/bench_attention.py --device cuda          (the checks, then timings at the 8B draft shape, bf16)
python benchmarks/bench_attention.py --device cpu --small   (only the small correctness checks; the tests run these)
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from backend.train.attention import BACKENDS, ttt_attention


def random_ttt_inputs(batch, heads, kv_heads, seq, dim, steps, device, dtype, seed=0, requires_grad=False):
    generator = torch.Generator(device="cpu").manual_seed(seed)

    def make(num_heads):
        tensor = torch.randn(batch, num_heads, seq, dim, generator=generator).to(device=device, dtype=dtype)
        return tensor.requires_grad_(requires_grad)

    query = make(heads)
    key0, value0 = make(kv_heads), make(kv_heads)
    diag_keys = [make(kv_heads) for _ in range(steps)]
    diag_values = [make(kv_heads) for _ in range(steps)]
    return query, key0, value0, diag_keys, diag_values


def compare_backends(backend: str, *, shape: dict, device: str, dtype: torch.dtype, backward: bool) -> dict:
    """Max abs difference of `backend` against eager (fp32 reference) for output and, optionally, gradients."""
    inputs = random_ttt_inputs(**shape, device=device, dtype=dtype, requires_grad=backward)
    reference_inputs = [tensor.detach().float().requires_grad_(backward) for tensor in _flatten(inputs)]
    ref_out = ttt_attention(*_unflatten(reference_inputs, shape["steps"]), backend="eager")
    out = ttt_attention(*inputs, backend=backend)
    result = {"backend": backend, "out_max_abs_diff": (out.float() - ref_out).abs().max().item()}
    if backward:
        upstream = torch.randn_like(ref_out)
        ref_grads = torch.autograd.grad(ref_out, reference_inputs, upstream)
        grads = torch.autograd.grad(out, _flatten(inputs), upstream.to(out.dtype))
        result["grad_max_abs_diff"] = max((g.float() - r).abs().max().item() for g, r in zip(grads, ref_grads))
    return result


def _flatten(inputs):
    query, key0, value0, diag_keys, diag_values = inputs
    return [query, key0, value0, *diag_keys, *diag_values]


def _unflatten(tensors, steps):
    return tensors[0], tensors[1], tensors[2], tensors[3 : 3 + steps], tensors[3 + steps : 3 + 2 * steps]


def time_backend(backend: str, *, shape: dict, device: str, dtype: torch.dtype, repeats: int = 10) -> float:
    """Median ms of forward+backward of all TTT steps 0..steps at `shape` (step k sees k diagonal tensors)."""
    inputs = random_ttt_inputs(**shape, device=device, dtype=dtype, requires_grad=True)
    query, key0, value0, diag_keys, diag_values = inputs

    def run():
        total = 0
        for step in range(shape["steps"] + 1):
            total = total + ttt_attention(query, key0, value0, diag_keys[:step], diag_values[:step], backend).float().sum()
        total.backward()

    return median_ms(run, device, repeats)


def median_ms(run, device, repeats: int, warmup: int = 3) -> float:
    """Median wall milliseconds of run() after warm-up, synchronizing the device around each call."""
    for _ in range(warmup):
        run()
    times = []
    for _ in range(repeats):
        _sync(device)
        start = time.perf_counter()
        run()
        _sync(device)
        times.append((time.perf_counter() - start) * 1000)
    return sorted(times)[len(times) // 2]


def _sync(device):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


LLAMA_8B_DRAFT = dict(
    hidden_size=4096,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
    intermediate_size=14336,
    rms_norm_eps=1e-5,
    rope_theta=500000.0,
    max_position_embeddings=4096,
    vocab_size=128256,
    draft_vocab_size=32000,
    target_hidden_size=4096,
    aux_layer_ids=[1, 15, 28],
    torch_dtype="bfloat16",
)


def time_draft_step(backend: str, *, device: str, seq: int = 2048, ttt_length: int = 7, mode: str = "autocast", repeats: int = 10) -> float:
    """Median ms of one draft ttt_forward + backward (loss = mean logsumexp of every step's logits) at the 8B draft shape.

    mode "autocast": fp32 weights under bf16 autocast (what backend/train/trainer.py does); "bf16": bf16 weights.
    """
    from backend.train.draft import DraftModelConfig, Eagle3Draft

    config = DraftModelConfig(**LLAMA_8B_DRAFT)
    draft = Eagle3Draft(config, attn_backend=backend).to(device)
    draft.load_target_embedding(torch.randn(config.vocab_size, config.hidden_size, device=device) * 0.02)
    if mode == "bf16":
        draft.to(torch.bfloat16)
    aux = torch.randn(1, seq, config.aux_width, device=device, dtype=torch.bfloat16)
    ids = torch.randint(0, config.vocab_size, (1, seq), device=device)

    def run():
        with torch.autocast(device_type=torch.device(device).type, dtype=torch.bfloat16, enabled=mode == "autocast"):
            logits = draft.ttt_forward(aux, ids, ttt_length)
            loss = sum(torch.logsumexp(step.float(), dim=-1).mean() * 0.8**k for k, step in enumerate(logits))
        loss.backward()
        draft.zero_grad(set_to_none=True)

    return median_ms(run, device, repeats)


def check_draft_backends(device: str) -> list[dict]:
    """ttt_forward of every backend against eager on a small random draft: max output and gradient differences."""
    from backend.train.draft import DraftModelConfig, Eagle3Draft

    config = DraftModelConfig(
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=128,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        max_position_embeddings=512,
        vocab_size=100,
        draft_vocab_size=60,
        target_hidden_size=64,
        aux_layer_ids=[1, 2, 3],
        torch_dtype="float32",
    )
    generator = torch.Generator().manual_seed(0)
    aux = torch.randn(2, 40, config.aux_width, generator=generator).to(device)
    ids = torch.randint(0, 100, (2, 40), generator=generator).to(device)
    outputs = {}
    on_cuda = torch.device(device).type == "cuda"
    for backend in BACKENDS:
        torch.manual_seed(0)
        draft = Eagle3Draft(config, attn_backend=backend, init_std=0.2).to(device)
        draft.load_target_embedding(torch.randn(100, 64, generator=generator.manual_seed(1)).to(device))
        backward = on_cuda or backend != "flex"
        with torch.set_grad_enabled(backward):
            logits = draft.ttt_forward(aux, ids, 5)
            if backward:
                sum((step.float() ** 2).mean() for step in logits).backward()
        grads = {n: p.grad for n, p in draft.named_parameters() if p.grad is not None}
        outputs[backend] = (logits, grads)
    ref_logits, ref_grads = outputs["eager"]
    report = []
    for backend in BACKENDS[1:]:
        logits, grads = outputs[backend]
        row = {"backend": backend, "logits_max_abs_diff": max((a - b).abs().max().item() for a, b in zip(logits, ref_logits))}
        if grads:
            row["grad_max_rel_diff"] = max(((grads[n] - ref_grads[n]).abs().max() / ref_grads[n].abs().max().clamp(min=1e-12)).item() for n in ref_grads)
        report.append(row)
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Check TTT attention backends against eager and time them")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--small", action="store_true", help="only the small correctness checks (no 8B-shape timing)")
    args = parser.parse_args(argv)
    small = dict(batch=2, heads=4, kv_heads=2, seq=48, dim=16, steps=3)
    big = dict(batch=1, heads=32, kv_heads=8, seq=2048, dim=128, steps=6)
    on_cuda = torch.device(args.device).type == "cuda"
    for backend in BACKENDS[1:]:
        print(compare_backends(backend, shape=small, device=args.device, dtype=torch.float32, backward=on_cuda or backend != "flex"))
    for row in check_draft_backends(args.device):
        print({"draft_ttt_forward": True, **row})
    if on_cuda and not args.small:
        for backend in BACKENDS[1:]:
            print(compare_backends(backend, shape=big, device=args.device, dtype=torch.bfloat16, backward=True))
        for backend in BACKENDS:
            ms = time_backend(backend, shape=big, device=args.device, dtype=torch.bfloat16)
            print(f"attention only, {backend}: {ms:.2f} ms fwd+bwd of 7 TTT steps at {big}")
        for backend in ("flex", "sdpa"):
            for mode in ("autocast", "bf16"):
                ms = time_draft_step(backend, device=args.device, mode=mode)
                print(f"draft ttt_forward+backward, {backend}, {mode}: {ms:.1f} ms/step (8B draft, seq 2048, TTT 7, no optimizer)")
                torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
