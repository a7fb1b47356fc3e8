"""TTT attention of the EAGLE-3 draft: causal over step-0 keys plus per-step diagonal keys, in eager, sdpa and flex backends."""
from __future__ import annotations

import argparse
import math
import time
from functools import lru_cache

import torch
import torch.nn.functional as F

BACKENDS = ("eager", "sdpa", "flex")


class AttentionBackendError(ValueError):
    """An unknown attention backend was asked for, or one this torch/device cannot run."""


def default_backend(device: torch.device | str) -> str:
    """flex on CUDA (compiled kernel, fastest), sdpa elsewhere (flex has no backward on CPU)."""
    if torch.device(device).type == "cuda" and flex_available():
        return "flex"
    return "sdpa"


def check_backend(name: str, device: torch.device | str) -> str:
    if name not in BACKENDS:
        raise AttentionBackendError(f"attention backend {name!r} is unknown; choose one of {', '.join(BACKENDS)}")
    if name == "flex" and not flex_available():
        raise AttentionBackendError(f"attention backend 'flex' needs torch.nn.attention.flex_attention (torch {torch.__version__} lacks it); use 'sdpa'")
    return name


def ttt_attention(
    query: torch.Tensor,
    key0: torch.Tensor,
    value0: torch.Tensor,
    diag_keys: list[torch.Tensor],
    diag_values: list[torch.Tensor],
    backend: str = "eager",
    compiled_merge: bool = False,
) -> torch.Tensor:
    """Attention of one TTT step.

    query [B, nh, S, d] (step k, RoPE at t+k); key0/value0 [B, nkv, S, d]: the step-0 keys/values
    (RoPE at t), attended causally (s <= t); diag_keys/values: k tensors [B, nkv, S, d] from steps 1..k,
    of which query row t sees only row t (the TTT "tree" mask). Returns [B, nh, S, d].
    """
    if backend == "eager":
        return _eager(query, key0, value0, diag_keys, diag_values)
    if backend == "sdpa":
        return _sdpa(query, key0, value0, diag_keys, diag_values)
    if backend == "flex":
        return _flex(query, key0, value0, diag_keys, diag_values, compiled_merge)
    raise AttentionBackendError(f"attention backend {backend!r} is unknown; choose one of {', '.join(BACKENDS)}")


def _group(query: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    batch, heads, seq, dim = query.shape
    return query.view(batch, num_kv_heads, heads // num_kv_heads, seq, dim)


def _diagonal_scores(query_grouped: torch.Tensor, diag_keys: list[torch.Tensor], scale: float) -> torch.Tensor:
    """[B, nkv, g, S, k]: score of query row t against row t of each diagonal key tensor."""
    return torch.stack([(query_grouped * key.unsqueeze(2)).sum(-1) for key in diag_keys], dim=-1) * scale


def _eager(query, key0, value0, diag_keys, diag_values):
    batch, heads, seq, dim = query.shape
    num_kv = key0.shape[1]
    scale = 1.0 / math.sqrt(dim)
    grouped = _group(query, num_kv)
    causal = torch.einsum("bkgsd,bktd->bkgst", grouped, key0) * scale
    future = torch.ones(seq, seq, dtype=torch.bool, device=query.device).triu(1)
    causal = causal.masked_fill(future, float("-inf"))
    scores = causal if not diag_keys else torch.cat([causal, _diagonal_scores(grouped, diag_keys, scale)], dim=-1)
    probs = torch.softmax(scores.float(), dim=-1).to(query.dtype)
    out = torch.einsum("bkgst,bktd->bkgsd", probs[..., :seq], value0)
    for index, value in enumerate(diag_values):
        out = out + probs[..., seq + index, None] * value.unsqueeze(2)
    return out.reshape(batch, heads, seq, dim)


def _repeat_kv(tensor: torch.Tensor, groups: int) -> torch.Tensor:
    if groups == 1:
        return tensor
    batch, num_kv, seq, dim = tensor.shape
    return tensor[:, :, None].expand(batch, num_kv, groups, seq, dim).reshape(batch, num_kv * groups, seq, dim)


@lru_cache(maxsize=32)
def _ttt_mask(seq: int, steps: int, device: torch.device) -> torch.Tensor:
    """[S, (steps+1)*S] bool: causal over the first S keys, identity over each following block of S."""
    causal = torch.ones(seq, seq, dtype=torch.bool, device=device).tril()
    eye = torch.eye(seq, dtype=torch.bool, device=device)
    return torch.cat([causal] + [eye] * steps, dim=1)


def _sdpa(query, key0, value0, diag_keys, diag_values):
    groups = query.shape[1] // key0.shape[1]
    if not diag_keys:
        return F.scaled_dot_product_attention(query, _repeat_kv(key0, groups), _repeat_kv(value0, groups), is_causal=True)
    keys = _repeat_kv(torch.cat([key0, *diag_keys], dim=2), groups)
    values = _repeat_kv(torch.cat([value0, *diag_values], dim=2), groups)
    mask = _ttt_mask(query.shape[2], len(diag_keys), query.device)
    return F.scaled_dot_product_attention(query, keys, values, attn_mask=mask)


# --- flex: one causal kernel over step-0 K/V that also returns its log-sum-exp; the k diagonal
# terms are merged analytically, so every step reuses one block mask and one compiled kernel.

def flex_available() -> bool:
    try:
        import torch.nn.attention.flex_attention  # noqa: F401  # imported only to see whether it is there
    except ImportError:
        return False
    return True


@lru_cache(maxsize=None)
def _flex_function(device_type: str):
    from torch.nn.attention.flex_attention import flex_attention

    if device_type == "cuda":
        return torch.compile(flex_attention)
    return flex_attention  # CPU: unfused reference path (forward only), used for checks


def _causal(batch, head, q_index, kv_index):
    return q_index >= kv_index


@lru_cache(maxsize=32)
def _causal_block_mask(seq: int, device: torch.device):
    from torch.nn.attention.flex_attention import create_block_mask

    return create_block_mask(_causal, None, None, seq, seq, device=device)


def _flex_causal_with_lse(query, key0, value0):
    flex = _flex_function(query.device.type)
    block_mask = _causal_block_mask(query.shape[2], query.device)
    try:
        from torch.nn.attention.flex_attention import AuxRequest
    except ImportError:  # torch < 2.9: legacy flag
        return flex(query, key0, value0, block_mask=block_mask, enable_gqa=True, return_lse=True)
    out, aux = flex(query, key0, value0, block_mask=block_mask, enable_gqa=True, return_aux=AuxRequest(lse=True))
    return out, aux.lse


def _flex(query, key0, value0, diag_keys, diag_values, compiled_merge: bool = False):
    out, lse = _flex_causal_with_lse(query, key0, value0)
    if not diag_keys:
        return out
    if compiled_merge:
        from backend.train.draft import compiled

        return compiled(_merge_diagonal)(out, lse, query, key0.shape[1], diag_keys, diag_values)
    return _merge_diagonal(out, lse, query, key0.shape[1], diag_keys, diag_values)


def _merge_diagonal(out, lse, query, num_kv: int, diag_keys, diag_values):
    """Fold the k diagonal keys/values into the causal result through its log-sum-exp (exact softmax merge)."""
    batch, heads, seq, dim = query.shape
    grouped = _group(query, num_kv).float()
    diag = _diagonal_scores(grouped, [key.float() for key in diag_keys], 1.0 / math.sqrt(dim))
    lse = lse.float().view(batch, num_kv, heads // num_kv, seq)
    top = torch.maximum(lse, diag.amax(-1))
    causal_weight = torch.exp(lse - top)
    diag_weight = torch.exp(diag - top.unsqueeze(-1))
    total = causal_weight + diag_weight.sum(-1)
    merged = _group(out, num_kv).float() * causal_weight.unsqueeze(-1)
    for index, value in enumerate(diag_values):
        merged = merged + diag_weight[..., index, None] * value.float().unsqueeze(2)
    merged = merged / total.unsqueeze(-1)
    return merged.to(query.dtype).reshape(batch, heads, seq, dim)


# --- self-check and timing, for the lead's GPU run:
#   python -m backend.train.attention --device cuda            (8B draft shape, bf16)
#   python -m backend.train.attention --device cpu --small     (what the tests also check)

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


LLAMA_8B_DRAFT = dict(hidden_size=4096, num_attention_heads=32, num_key_value_heads=8, head_dim=128, intermediate_size=14336,
                      rms_norm_eps=1e-5, rope_theta=500000.0, max_position_embeddings=4096, vocab_size=128256,
                      draft_vocab_size=32000, target_hidden_size=4096, aux_layer_ids=[1, 15, 28], torch_dtype="bfloat16")


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

    config = DraftModelConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=128,
                              rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=512, vocab_size=100,
                              draft_vocab_size=60, target_hidden_size=64, aux_layer_ids=[1, 2, 3], torch_dtype="float32")
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
