"""TTT attention of the EAGLE-3 draft: causal over step-0 keys plus per-step diagonal keys, in eager, sdpa and flex backends."""

from __future__ import annotations

import math
import os
from functools import lru_cache
from typing import Any, Callable

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


@lru_cache(maxsize=1)
def shield_compile_workers() -> None:
    """Start inductor's pool of compile workers now, with SIGTERM blocked in them for good.

    A stop signals the job's whole process group, compile workers included. A worker killed mid-compile broke the
    trainer's compiles: on the H200 a SIGTERM with flex attention wrote no checkpoint in 160 s. Compiling in process
    instead (one thread) made the first step take over 60 s. So the pool is started here, before the first compile,
    with SIGTERM blocked while it is spawned: the sidecar and its workers inherit the blocked mask (fork and exec keep
    it), the trainer gets its SIGTERM afterwards as usual (a blocked signal waits, it is not lost), finishes its step and
    writes the checkpoint, and its exit ends the pool. SIGKILL still ends them all. EAGLE3_INDUCTOR_THREADS=N sets the
    pool size (1: compile in process)."""
    import signal
    import threading

    import torch._inductor.config as inductor_config

    if "EAGLE3_INDUCTOR_THREADS" in os.environ:
        inductor_config.compile_threads = int(os.environ["EAGLE3_INDUCTOR_THREADS"])
    from torch._inductor.async_compile import AsyncCompile, get_compile_threads

    if get_compile_threads() <= 1 or threading.current_thread() is not threading.main_thread():
        return
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    try:
        AsyncCompile.process_pool()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


_COMPILED: dict[Callable[..., Any], Callable[..., Any]] = {}


def compiled(function: Callable[..., Any]) -> Callable[..., Any]:
    """torch.compile(function), built once per process (CUDA training path; see Eagle3Draft.compile_regions)."""
    found = _COMPILED.get(function)
    if found is None:
        import torch._dynamo.config as dynamo_config

        for name in ("recompile_limit", "cache_size_limit"):  # the diagonal merge compiles once per TTT step count
            if hasattr(dynamo_config, name):
                setattr(dynamo_config, name, max(64, getattr(dynamo_config, name)))
        shield_compile_workers()
        # dynamic=None (torch's automatic dynamic shapes): one graph for the first length, one with the length symbolic
        # at the first other, reused by every bucket after. Static graphs compiled each bucketed length anew: 6 lengths
        # 155 s against 45 s on 2 CPU cores, the same outputs; on the H200 a cold run spent ~290 s before its first
        # metrics line and was still compiling new lengths half a minute into its steps (2026-12-03, rounds 10-11).
        found = _COMPILED[function] = torch.compile(function, dynamic=None)
    return found


@lru_cache(maxsize=None)
def _flex_function(device_type: str):
    from torch.nn.attention.flex_attention import flex_attention

    if device_type == "cuda":
        shield_compile_workers()
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
