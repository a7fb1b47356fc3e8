"""Static-cache EAGLE-3 decoding: preallocated target and draft KV, fixed-shape steps, CUDA graphs on CUDA.

StaticDecoder has SpecDecoder's interface and results (plain, plain_generate, generate with the same acceptance
counts). The target runs from its own weights (a Llama-family causal LM) over a preallocated KV cache; every decode
step has one of two widths (1 for plain decoding, 1 + branches x num_steps for a verify), attends over a fixed power-of-two
prefix of the cache, and a rejected draft is rolled back by moving a position counter (rows past it are masked and
overwritten later). The draft's KV is preallocated too, and one draft round (step 0 over the newly committed rows,
then num_steps - 1 chained steps) is one fixed-shape call. On CUDA each of those calls is captured once per
(kind, cache prefix) as a torch.cuda.CUDAGraph over static input/output buffers and replayed; on CPU the very same
functions run eagerly, so the CPU tests exercise the code the graphs capture.
"""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from backend.serve.reference import triton_attention, triton_linear, triton_runtime
from backend.serve.reference.spec_decode import NO_DRAFT, GenerateResult, SpecDecoder
from backend.serve.reference.static_tree import ROOT, accepted_path, ancestor_bits, candidate_depths, grow_tree
from backend.serve.spec_setting import TreeSetting, verify_width
from backend.train.draft import Eagle3Draft, rotate_half

MIN_BUCKET = 256  # smallest cache prefix a step attends over; prefixes double up to max_len
MIN_PREFILL = 16  # smallest padded prompt width (pad_prefill)
# How the target's steps attend over the cache. "sdpa": F.scaled_dot_product_attention with the backend torch picks
# (cuDNN's flash kernel on an H200 with torch 2.11: 12.8 us a layer for one query over 612 keys, 34 % of a compiled
# decode step; benchmarks/results/h200_round5_decode_profile.json). "efficient": SDPA held to the memory-efficient
# kernel (math where that is missing, as on CPU). "math": matmul, masked softmax in float32, matmul, which
# torch.compile fuses around the two products. "triton": triton_attention.decode_attention for steps (it reads only
# the keys up to the step's positions; a prompt goes to SDPA). Which is fastest on a GPU: profile_decode_step.py.
ATTENTION_KINDS = ("sdpa", "efficient", "math", "triton")
# "auto": triton on a CUDA device where its kernels run, else sdpa. On one H200 (2026-12-03, one call, SmolLM2-135M,
# compiled steps) triton took a decode step from 1.69 to 1.02 ms and a 4-row verify from 1.71 to 1.09 ms.
ATTENTION_CHOICES = ("auto", *ATTENTION_KINDS)
# How the target's steps multiply by their weights. "torch": F.linear (cuBLAS on a GPU), the RMSNorm and the SiLU gate
# as kernels of their own. "triton": triton_linear.skinny_linear, the norm, the gate, the bias and the residual inside
# the product, for the products where it beat cuBLAS on an H200 (triton_linear.prefers: one row, not the LM head; a
# decode step went from 1.01 to 0.83 ms, plain decoding from 897-955 to 1,124-1,127 tok/s in one call, 2026-12-03);
# the rest (a verify's rows, the LM head, a prompt) go to F.linear. "triton-all": the kernel for a verify's rows too
# (up to triton_linear.MAX_ROWS; its loop over the rows lost to "triton" in whole steps: a 4-row verify 1.48 vs 1.08
# ms, a 7-row one 5.48 vs 1.12, one H200, 2026-12-03). "triton-rows": a step's rows too, up to
# triton_linear.ROW_GRID_MAX_ROWS (its comment has the timings that set it), each row in programs of its own running
# the one-row kernel, so each row's product is the one-row decode's bit for bit and bf16 speculation gives plain
# decoding's tokens. The draft's steps take the target's kinds.
LINEAR_KINDS = ("torch", "triton", "triton-all", "triton-rows")
# "auto": triton-rows on a CUDA device where its kernel runs, else torch.
LINEAR_CHOICES = ("auto", *LINEAR_KINDS)


class StaticUnsupported(ValueError):
    """The target is not a model the static runner implements (the eager SpecDecoder still serves it)."""


class KernelUnavailable(ValueError):
    """An attention or linear kind asked for by name cannot run on this device or target (the reason says why)."""


class ContextTooLong(ValueError):
    """A request needs more positions than the static cache holds."""


def _doublings(smallest: int, max_len: int) -> list[int]:
    """smallest, 2 x smallest, ... below max_len, then max_len itself."""
    sizes, size = [], smallest
    while size < max_len:
        sizes.append(size)
        size *= 2
    return sizes + [max_len]


def prefill_widths(max_len: int) -> list[int]:
    """Widths a prompt is padded to on CUDA: 16, 32, ... and max_len; every one is run once at load, so a prompt
    never brings a shape the decoder has not run. (The 55-68 ms first tokens that suggested per-shape costs on
    2026-12-02 were requests on new threads: engine.Engine decodes on one thread; probe_first_token.py.)"""
    return _doublings(MIN_PREFILL, max_len)


def length_buckets(max_len: int) -> list[int]:
    """Cache prefixes a step may attend over: 256, 512, ... and max_len itself."""
    return _doublings(MIN_BUCKET, max_len)


def _rms(hidden: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' LlamaRMSNorm (normalise in fp32, round to the input dtype, scale), in one fused kernel where torch has it."""
    dtype = hidden.dtype
    if hasattr(F, "rms_norm"):
        return weight * F.rms_norm(hidden.float(), (hidden.shape[-1],), eps=eps).to(dtype)
    hidden = hidden.float()
    hidden = hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + eps)
    return weight * hidden.to(dtype)


def visible_keys(bucket: int, slots: torch.Tensor, gaps: torch.Tensor | None = None, tree: torch.Tensor | None = None) -> torch.Tensor:
    """[rows, bucket]: row r sees the keys up to its cache slot, less [gaps[r, 0], gaps[r, 1]) when given, and with
    tree [rows, 2] (window start, int64 bits) only those keys of [start, start + TREE_WINDOW) whose bit is set."""
    keys = torch.arange(bucket, device=slots.device)[None, :]
    visible = keys <= slots[:, None]
    if gaps is not None:
        visible = visible & ((keys < gaps[:, :1]) | (keys >= gaps[:, 1:]))
    if tree is not None:
        offset = keys - tree[:, :1]
        inside = (offset >= 0) & (offset < triton_attention.TREE_WINDOW)
        seen = torch.bitwise_right_shift(tree[:, 1:], torch.where(inside, offset, 0)) & 1
        visible = visible & (~inside | (seen == 1))
    return visible


def _norm_eps(norm) -> float:
    eps = getattr(norm, "variance_epsilon", None)
    return float(eps if eps is not None else norm.eps)


def eager_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    norm: torch.Tensor | None = None,
    eps: float = 0.0,
    residual: torch.Tensor | None = None,
    gated: bool = False,
) -> torch.Tensor:
    """residual + linear(rms_norm(x) * norm, weight, bias) in eager ops, each part optional; gated: x is gate | up
    and the input is silu(gate) * up (what triton_linear.skinny_linear does in one kernel)."""
    if gated:
        gate, up = x.chunk(2, dim=-1)
        x = F.silu(gate) * up
    if norm is not None:
        x = _rms(x, norm, eps)
    out = F.linear(x, weight, bias)
    return out if residual is None else residual + out


def routed_linear(
    kind: str, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *, norm=None, eps: float, residual=None, gated=False
) -> torch.Tensor:
    """eager_linear's result for a step's rows x [1, rows, in], through the Triton kernel where linear kind `kind`
    (LINEAR_KINDS, resolved) prefers it, else the eager ops."""
    row_grid = kind == "triton-rows"
    if kind != "torch" and triton_linear.prefers(x.shape[1], weight.shape[0], many_rows=kind == "triton-all", row_grid=row_grid):
        return triton_linear.skinny_linear(x, weight, bias, norm=norm, eps=eps, residual=residual, gated=gated, row_grid=row_grid)
    return eager_linear(x, weight, bias, norm=norm, eps=eps, residual=residual, gated=gated)


def _resolve_kind(what: str, choice: str, device: torch.device, triton_reason: Callable[[], str | None], fallback: str, auto: str) -> str:
    """An attention or linear choice as run on `device`: "auto" is `auto` (a triton kind) on a CUDA device where its
    kernels run, else `fallback`; a triton kind where they cannot run is refused with the reason (KernelUnavailable)."""
    if choice != "auto" and not choice.startswith("triton"):
        return choice
    reason = triton_reason()
    if choice == "auto":
        return auto if device.type == "cuda" and reason is None else fallback
    if reason:
        raise KernelUnavailable(f"{what} {choice!r} cannot run here: {reason}")
    return choice


@dataclass
class _Layer:
    w_input: torch.Tensor
    qkv: torch.Tensor  # q|k|v stacked: one product per step
    qkv_bias: torch.Tensor | None
    o_proj: torch.Tensor
    o_bias: torch.Tensor | None
    w_post: torch.Tensor
    gate_up: torch.Tensor  # gate|up stacked
    down: torch.Tensor


def _stack(*modules) -> tuple[torch.Tensor, torch.Tensor | None]:
    weight = torch.cat([m.weight.detach() for m in modules], dim=0)
    biases = [m.bias for m in modules]
    if all(b is None for b in biases):
        return weight, None
    return weight, torch.cat(
        [b.detach() if b is not None else torch.zeros(m.weight.shape[0], dtype=weight.dtype, device=weight.device) for m, b in zip(modules, biases)]
    )


class StaticTarget:
    """A Llama-family causal LM run from its own weights over a preallocated KV cache [layers, 1, kv_heads, max_len, d]."""

    def __init__(self, model, aux_layer_ids: list[int], feed: str, max_len: int, attention: str = "sdpa", linear: str = "torch"):
        config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        self._check_supported(model, config)
        if attention not in ATTENTION_CHOICES:
            raise ValueError(f"attention {attention!r}: expected one of {', '.join(ATTENTION_CHOICES)}")
        if linear not in LINEAR_CHOICES:
            raise ValueError(f"linear {linear!r}: expected one of {', '.join(LINEAR_CHOICES)}")
        inner = model.model
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = getattr(config, "num_key_value_heads", None) or self.num_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        device = inner.embed_tokens.weight.device
        self.attention = _resolve_kind("attention", attention, device, lambda: triton_attention.unavailable_reason(device, self.head_dim), "sdpa", "triton")
        self.linear = _resolve_kind("linear", linear, device, lambda: triton_runtime.unavailable_reason(device), "torch", "triton-rows")
        self.groups = self.num_heads // self.num_kv_heads
        self.scale = self.head_dim**-0.5
        self.embed = inner.embed_tokens.weight.detach()
        self.final_norm = inner.norm.weight.detach()
        self.eps = _norm_eps(inner.norm)
        self.lm_head = model.get_output_embeddings().weight.detach()
        rotary = inner.rotary_emb
        self.inv_freq = rotary.inv_freq.detach().float()
        self.rope_scaling = float(getattr(rotary, "attention_scaling", 1.0) or 1.0)
        self.layers = []
        for layer in inner.layers:
            attn, mlp = layer.self_attn, layer.mlp
            qkv, qkv_bias = _stack(attn.q_proj, attn.k_proj, attn.v_proj)
            gate_up, _ = _stack(mlp.gate_proj, mlp.up_proj)
            o_bias = attn.o_proj.bias.detach() if attn.o_proj.bias is not None else None
            self.layers.append(
                _Layer(
                    layer.input_layernorm.weight.detach(),
                    qkv,
                    qkv_bias,
                    attn.o_proj.weight.detach(),
                    o_bias,
                    layer.post_attention_layernorm.weight.detach(),
                    gate_up,
                    mlp.down_proj.weight.detach(),
                )
            )
        self.aux_layer_ids = list(aux_layer_ids)
        self.feed = feed
        self.max_len = max_len
        self.dtype, self.device = self.embed.dtype, self.embed.device
        shape = (1, self.num_kv_heads, max_len, self.head_dim)  # one tensor per layer: whole buffers, no views, mutated in place
        self.keys = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in self.layers]
        self.values = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in self.layers]

    @staticmethod
    def _check_supported(model, config) -> None:
        problems = []
        if getattr(config, "hidden_act", "silu") != "silu":
            problems.append(f"hidden_act {config.hidden_act!r} (only silu)")
        if getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True):
            problems.append("sliding-window attention")
        inner = getattr(model, "model", None)
        layers = getattr(inner, "layers", None)
        if inner is None or layers is None or not hasattr(inner, "rotary_emb") or not hasattr(inner.rotary_emb, "inv_freq"):
            problems.append("no model.layers / model.rotary_emb.inv_freq (not a Llama-family layout)")
        elif getattr(inner.rotary_emb, "rope_type", "default") == "dynamic":
            problems.append("dynamic RoPE scaling (its frequencies change with the length)")
        else:
            first = layers[0]
            needed = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
            names = {name for name, _ in first.named_modules()}
            missing = [name for name in needed if name not in names]
            extra = [name for name in ("self_attn.q_norm", "self_attn.k_norm") if name in names]
            if missing or extra:
                problems.append(f"decoder layer lacks {missing} or has {extra}")
        if problems:
            raise StaticUnsupported(f"{type(model).__name__} cannot run on the static-cache decoder: {'; '.join(problems)}")

    @property
    def feature_width(self) -> int:
        hidden = self.embed.shape[1]
        return hidden * len(self.aux_layer_ids) if self.feed == "aux" else hidden

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        angles = positions.float()[:, None] * self.inv_freq[None, :]
        angles = torch.cat([angles, angles], dim=-1)
        return (angles.cos() * self.rope_scaling).to(self.dtype), (angles.sin() * self.rope_scaling).to(self.dtype)

    def forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        bucket: int,
        all_logits: bool,
        logits_row: torch.Tensor | None = None,
        slots: torch.Tensor | None = None,
        gaps: torch.Tensor | None = None,
        tree: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """tokens [1, S] at RoPE positions [S]: writes their K/V at cache `slots` (default: the positions), each row
        attending over cache[:bucket] up to its own slot, less its row of `gaps` [S, 2] ([lo, hi): a tree's other
        branches), and of `tree` [S, 2] (window start, bits: an EAGLE tree's verify, each node seeing its
        ancestors). Without all_logits only one row gets logits: the last, or `logits_row` (a one-element index on
        the device: a padded prompt's last real row).

        Returns (logits [1, S or 1, V], features [1, S, F]: the aux layers' outputs concatenated, or the final
        normed hidden state for feed last_hidden). Rows at or past the position counter are never read unmasked.
        """
        seq = tokens.shape[1]
        heads, kv_heads, dim, groups = self.num_heads, self.num_kv_heads, self.head_dim, self.groups
        slots = positions if slots is None else slots
        hidden = F.embedding(tokens, self.embed)
        cos, sin = self.rope(positions)
        cos_rows, sin_rows = cos[:, None], sin[:, None]  # [S, 1, d]: one angle per row for all its heads
        visible = visible_keys(bucket, slots, gaps, tree).repeat(groups, 1)  # rows grouped by kv head: row j*S + s is head j of row s
        captured: dict[int, torch.Tensor] = {}
        for index, layer in enumerate(self.layers):
            qkv = self._linear(hidden, layer.qkv, layer.qkv_bias, norm=layer.w_input)
            query_key, value = qkv.split([(heads + kv_heads) * dim, kv_heads * dim], dim=-1)
            # the rows stay in the product's [1, S, heads, d] layout: a verify's rows then need no copy into a grouped
            # one and back (round 21's profile: 3 more kernels a layer than a decode step, ~0.1 ms of a 1.1 ms verify)
            query_key = query_key.view(1, seq, heads + kv_heads, dim)
            query_key = query_key * cos_rows + rotate_half(query_key) * sin_rows  # RoPE of q and k in one pass
            query, key = query_key.split([heads, kv_heads], dim=2)
            keys, values = self.keys[index], self.values[index]
            keys.index_copy_(2, slots, key.transpose(1, 2))
            values.index_copy_(2, slots, value.view(1, seq, kv_heads, dim).transpose(1, 2))
            out = self._attend(query, keys[:, :, :bucket], values[:, :, :bucket], visible, slots, gaps, tree)
            hidden = self._linear(out.reshape(1, seq, heads * dim), layer.o_proj, layer.o_bias, residual=hidden)
            gate_up = self._linear(hidden, layer.gate_up, norm=layer.w_post)
            hidden = self._linear(gate_up, layer.down, residual=hidden, gated=True)
            if index in self.aux_layer_ids:
                captured[index] = hidden
        normed = _rms(hidden, self.final_norm, self.eps)
        if not all_logits:
            normed_rows = normed[:, -1:] if logits_row is None else normed.index_select(1, logits_row)
        logits = self._linear(normed if all_logits else normed_rows, self.lm_head)
        features = torch.cat([captured[i] for i in self.aux_layer_ids], dim=-1) if self.feed == "aux" else normed
        return logits, features

    def _linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *, norm=None, residual=None, gated=False) -> torch.Tensor:
        """residual + linear(rms_norm(x) * norm, weight, bias), each part optional; gated: x is gate | up and the
        input is silu(gate) * up. One Triton kernel where the linear kind prefers it, else the eager ops."""
        return routed_linear(self.linear, x, weight, bias, norm=norm, eps=self.eps, residual=residual, gated=gated)

    def _attend(
        self,
        query: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        visible: torch.Tensor,
        slots: torch.Tensor,
        gaps: torch.Tensor | None,
        tree: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """query [1, S, heads, d] over keys/values [1, kv_heads, bucket, d]; returns [1, S, heads, d]. visible
        [groups x S, bucket] for the grouped kinds (row r is the step's row r % S, at cache slot slots[r % S],
        skipping its row of gaps and its tree's hidden slots)."""
        seq, heads, dim = query.shape[1], query.shape[2], query.shape[3]
        if self.attention == "triton" and triton_attention.fits(self.groups * seq):
            return triton_attention.heads_attention(query, keys, values, slots, self.scale, gaps, tree)
        grouped = query.transpose(1, 2).reshape(1, self.num_kv_heads, self.groups * seq, dim)  # row j*S + s: head j of row s
        if self.attention == "math":
            scores = torch.matmul(grouped, keys.transpose(-1, -2)) * self.scale
            scores = scores.masked_fill(~visible, float("-inf"))
            out = torch.matmul(torch.softmax(scores.float(), dim=-1).to(grouped.dtype), values)
        elif self.attention == "efficient":
            with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]):
                out = F.scaled_dot_product_attention(grouped, keys, values, attn_mask=visible, scale=self.scale)
        else:
            out = F.scaled_dot_product_attention(grouped, keys, values, attn_mask=visible, scale=self.scale)
        return out.reshape(1, heads, seq, dim).transpose(1, 2)


class StaticDraft:
    """The draft's decoder layer over a preallocated KV cache [1, kv_heads, max_len, d], from its own weights.

    A round's chained steps write their K/V at the positions right after the committed ones (where the next round's
    commit will overwrite them), so every step attends causally by position over one cache: the committed rows and
    its own chain, the keys EAGLE-3's test-time training shows each step (TTTAttention). The products go through
    routed_linear and the attention through the Triton kernel when the target's kinds say so."""

    def __init__(self, draft: Eagle3Draft, max_len: int, attention: str = "math", linear: str = "torch"):
        layer = draft.midlayer
        attn, mlp = layer.self_attn, layer.mlp
        self.draft = draft
        self.heads, self.kv_heads, self.head_dim = attn.num_heads, attn.num_kv_heads, attn.head_dim
        self.groups = self.heads // self.kv_heads
        self.eps = layer.input_layernorm.eps
        dtype, device = draft.fc.weight.dtype, draft.fc.weight.device
        # the Triton attention where the target's is Triton and the draft's head size suits the kernel; else the eager
        # draft's own math formula
        runs = attention == "triton" and triton_attention.unavailable_reason(device, self.head_dim) is None
        self.attention = "triton" if runs else "math"
        self.linear = linear
        self.keys = torch.zeros(1, self.kv_heads, max_len, self.head_dim, dtype=dtype, device=device)
        self.values = torch.zeros_like(self.keys)
        # weights stacked once: q|k|v (2.2 MB for SmolLM2's draft, re-concatenated at every step before), gate|up
        self.w_input, self.w_hidden = layer.input_layernorm.weight.detach(), layer.hidden_norm.weight.detach()
        self.qkv = layer.qkv_weight().detach()
        self.o_proj, self.w_post = attn.o_proj.weight.detach(), layer.post_attention_layernorm.weight.detach()
        self.gate_up = torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]).detach()
        self.down = mlp.down_proj.weight.detach()

    def layer(
        self,
        positions: torch.Tensor,
        embeds: torch.Tensor,
        hidden: torch.Tensor,
        bucket: int,
        slots: torch.Tensor | None = None,
        gaps: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The decoder layer over rows at RoPE `positions` (embeds, hidden [1, S, H]): their K/V into the cache at
        `slots` (default: the positions), each row attending over the cache's first `bucket` slots up to its own, less
        its row of `gaps` [S, 2]. Returns the pre-norm output state [1, S, H]."""
        seq, heads, kv_heads, dim = hidden.shape[1], self.heads, self.kv_heads, self.head_dim
        slots = positions if slots is None else slots
        joined = torch.cat([_rms(embeds, self.w_input, self.eps), _rms(hidden, self.w_hidden, self.eps)], dim=-1)
        qkv = self._linear(joined, self.qkv)
        query, key, value = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
        cos, sin = self.draft.midlayer.self_attn.rope(positions, hidden.dtype)
        query = query.view(1, seq, heads, dim).transpose(1, 2)
        key = key.view(1, seq, kv_heads, dim).transpose(1, 2)
        query = query * cos + rotate_half(query) * sin
        key = key * cos + rotate_half(key) * sin
        self.keys.index_copy_(2, slots, key)
        self.values.index_copy_(2, slots, value.view(1, seq, kv_heads, dim).transpose(1, 2))
        grouped = query.reshape(1, kv_heads, self.groups * seq, dim)  # row r: head r // seq of the group, row r % seq
        out = self._attend(grouped, self.keys[:, :, :bucket], self.values[:, :, :bucket], slots, gaps)
        out = out.reshape(1, heads, seq, dim).transpose(1, 2).reshape(1, seq, heads * dim)
        hidden = self._linear(out, self.o_proj, residual=hidden)
        gate_up = self._linear(hidden, self.gate_up, norm=self.w_post)
        return self._linear(gate_up, self.down, residual=hidden, gated=True)

    def _linear(self, x: torch.Tensor, weight: torch.Tensor, *, norm=None, residual=None, gated=False) -> torch.Tensor:
        return routed_linear(self.linear, x, weight, norm=norm, eps=self.eps, residual=residual, gated=gated)

    def _attend(self, query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, slots: torch.Tensor, gaps: torch.Tensor | None) -> torch.Tensor:
        """Grouped query rows [1, kv_heads, rows, d] over keys/values [1, kv_heads, bucket, d], causal by cache slot
        less the gaps."""
        if self.attention == "triton" and triton_attention.fits(query.shape[2]):
            return triton_attention.decode_attention(query, keys, values, slots, self.head_dim**-0.5, gaps)
        visible = visible_keys(keys.shape[2], slots, gaps).repeat(self.groups, 1)
        scores = query @ keys.transpose(-1, -2) / math.sqrt(self.head_dim)
        scores = scores.masked_fill(~visible, float("-inf"))
        return torch.softmax(scores.float(), dim=-1).to(query.dtype) @ values


@dataclass
class StepTimes:
    """Per-round seconds measured while `StaticDecoder.step_times` is set (CUDA events on CUDA)."""

    draft: list[float] = field(default_factory=list)
    verify: list[float] = field(default_factory=list)
    decode: list[float] = field(default_factory=list)
    prefill: list[float] = field(default_factory=list)  # per request: the prompt through the target (and the draft), to the first token
    round_wall: list[float] = field(default_factory=list)
    pending: list[tuple[str, Any, Any]] = field(default_factory=list)

    def summary(self) -> dict[str, float | int]:
        def mean_ms(values):
            return 1000 * sum(values) / len(values) if values else 0.0

        rounds = len(self.round_wall)
        gpu = [d + v for d, v in zip(self.draft, self.verify)] if self.verify else self.decode
        host = [wall - busy for wall, busy in zip(self.round_wall, gpu)]
        return {
            "rounds": rounds,
            "draft_ms": mean_ms(self.draft),
            "verify_ms": mean_ms(self.verify),
            "decode_ms": mean_ms(self.decode),
            "prefill_ms": mean_ms(self.prefill),
            "round_wall_ms": mean_ms(self.round_wall),
            "host_ms": mean_ms(host),
        }


class StaticDecoder(SpecDecoder):
    """SpecDecoder's decoding from a static KV cache: the same tokens and acceptance counts, fixed-shape steps,
    CUDA graphs on CUDA (use_graphs=None: on when the target is on CUDA). compile=True runs the steps through
    torch.compile (fusion of the small element-wise kernels) before they are captured; `attention` picks how the
    target's steps attend (ATTENTION_CHOICES), `linear` how they multiply by their weights (LINEAR_KINDS); `branches`
    how many of the draft's best first tokens each round chains and verifies (1: a chain, SpecDecoder's rounds);
    `topk` > 1 drafts SGLang's EAGLE tree instead (top-k beams over num_steps, the best num_draft_tokens - 1
    candidates verified: static_tree.py), with the rounds draft_tree.replay predicts."""

    def __init__(
        self,
        target_model,
        draft: Eagle3Draft | None,
        aux_layer_ids: list[int] | None = None,
        num_steps: int = 5,
        feed: str = "aux",
        eos_token_id: int | list[int] | None = None,
        max_len: int | None = None,
        use_graphs: bool | None = None,
        compile: bool = False,
        pad_prefill: bool | None = None,
        attention: str = "sdpa",
        linear: str = "torch",
        branches: int = 1,
        topk: int = 1,
        num_draft_tokens: int | None = None,
    ):
        super().__init__(target_model, draft, aux_layer_ids, num_steps, feed, eos_token_id)
        device = self.target.device
        if branches < 1 or (draft is not None and branches > draft.config.draft_vocab_size):
            raise ValueError(f"branches must be between 1 and the draft's vocabulary size, got {branches}")
        tree = TreeSetting.served(num_steps, topk, num_draft_tokens)  # refuses what SGLang would not run
        if topk > 1 and branches > 1:
            raise ValueError(f"first-step branches ({branches}) and an EAGLE tree (topk {topk}) do not combine: choose one")
        if tree.num_draft_tokens - 1 > triton_attention.TREE_WINDOW or (draft is not None and topk > draft.config.draft_vocab_size):
            raise ValueError(f"setting {tree.label}: at most {triton_attention.TREE_WINDOW + 1} draft tokens and a topk within the draft's vocabulary")
        self.use_graphs = device.type == "cuda" if use_graphs is None else use_graphs
        self.pad_prefill = self.use_graphs if pad_prefill is None else pad_prefill  # prompts padded to prefill_widths
        if self.use_graphs and device.type != "cuda":
            raise ValueError("CUDA graphs need the target on a CUDA device")
        # a verify's rows: the last emitted token, then each branch's num_steps proposals (branch-major); the draft
        # commits at most one branch's accepted rows and the bonus row: commit_width
        self.branches, self.commit_width, self.topk = branches, num_steps + 1, topk
        # a tree verifies num_draft_tokens rows (the root, then the chosen nodes in candidate order); its beams, like the
        # branches, draft in lanes of their own
        self.width = verify_width(num_steps, topk, tree.num_draft_tokens, branches)
        self.lanes = topk if topk > 1 else branches
        limit = getattr(target_model.config, "max_position_embeddings", None) or 4096
        self.max_len = int(max_len or limit)
        # compiled steps attend over the whole cache: one compile per step kind instead of one per prefix
        self.buckets = [self.max_len] if compile else length_buckets(self.max_len)
        self.prefill_widths = prefill_widths(self.max_len)
        self.static_target = StaticTarget(target_model, self.aux_layer_ids, feed, self.max_len, attention, linear)
        target = self.static_target
        draft_room = max(self.width, self.commit_width + self.lanes * (num_steps - 1))  # past a request's last position
        self.static_draft = StaticDraft(draft, self.max_len + draft_room, target.attention, target.linear) if draft is not None else None
        width, feature_width = self.width, self.static_target.feature_width
        # target start, draft start, pending rows, decode token, the prompt's last row, a moved branch's first slot, its
        # new first slot
        self.scalars = torch.zeros(7, dtype=torch.long, device=device)
        self._staged = torch.zeros(7, dtype=torch.long, pin_memory=device.type == "cuda")
        self._tree_layout(device)
        # the prompt (padded with zeros; one more for the draft's shifted tokens), its last row's logits, its features
        self.prompt_tokens = torch.zeros(1, self.max_len + 1, dtype=torch.long, device=device)
        self.prompt_positions = torch.arange(self.max_len + 1, device=device)
        self.prompt_logits = torch.zeros(1, 1, self.static_target.lm_head.shape[0], dtype=self.static_target.dtype, device=device)
        self.prompt_features = torch.zeros(1, self.max_len, feature_width, dtype=self.static_target.dtype, device=device)
        self.pending_features = torch.zeros(1, self.commit_width, feature_width, dtype=self.static_target.dtype, device=device)
        self.pending_tokens = torch.zeros(1, self.commit_width, dtype=torch.long, device=device)
        self.verify_tokens = torch.zeros(1, width, dtype=torch.long, device=device)
        # the verify's greedy ids, then the proposals, then (branches > 1) the branch whose rows were kept; a tree's: the
        # accepted count, the greedy ids of the root and the accepted nodes' rows, those rows (static_tree.accepted_path)
        report_size = 2 + 2 * num_steps if topk > 1 else 2 * width - 1 + (branches > 1)
        self.report = torch.zeros(report_size, dtype=torch.long, device=device)
        self.decoded = torch.zeros(1, dtype=torch.long, device=device)
        self.graphs: dict[tuple[str, int], Any] = {}
        self.device = device
        with self._device_scope():
            self.pool = torch.cuda.graph_pool_handle() if self.use_graphs else None
        self.step_times: StepTimes | None = None
        self.compiled = compile
        self._verify_fn, self._draft_fn, self._decode_fn, self._move_fn = self._verify, self._draft_round, self._decode, self._move_branch
        if compile:
            import torch._dynamo.config as dynamo_config

            dynamo_config.cache_size_limit = max(64, dynamo_config.cache_size_limit)  # one graph per (step kind, cache prefix)
            self._verify_fn = torch.compile(self._verify, dynamic=False)
            self._draft_fn = torch.compile(self._draft_round, dynamic=False)
            self._decode_fn = torch.compile(self._decode, dynamic=False)
            self._move_fn = torch.compile(self._move_branch, dynamic=False)

    def _tree_layout(self, device: torch.device) -> None:
        """Where a verify's rows sit, relative to its first position s: row 0 (the last emitted token) at s; branch b's
        proposal j at RoPE position s + 1 + j, in cache slot s + 1 + b * num_steps + j, not seeing the slots of the
        branches before it ([s + 1, s + 1 + b * num_steps)); parents: the row each proposal is checked against."""
        steps, branches = self.num_steps, self.branches
        rows = [(b, j) for b in range(branches) for j in range(steps)]
        self.tree_offsets = torch.tensor([0] + [1 + j for _, j in rows], device=device)
        self.tree_gaps = torch.tensor([[0, 0]] + [[1, 1 + b * steps] for b, _ in rows], device=device)
        self.tree_parents = torch.tensor([0 if j == 0 else b * steps + j for b, j in rows], device=device)
        # the draft's chained steps: branch b's step in slot committed + b * (num_steps - 1) + step, not seeing the slots
        # of the branches before it ([committed, committed + b * (num_steps - 1)))
        self.branch_offsets = torch.arange(self.lanes, device=device) * (steps - 1)
        self.branch_gaps = torch.stack([torch.zeros_like(self.branch_offsets), self.branch_offsets], dim=1)
        # an EAGLE tree's (topk > 1): each candidate's depth; the chosen nodes' parents and depths (the draft round
        # writes them for the verify); the accepted nodes' rows by depth (the verify writes them for the K/V move)
        self.candidate_depths = candidate_depths(steps, self.topk, device)
        self.node_parents = torch.full((self.width - 1,), ROOT, dtype=torch.long, device=device)
        self.node_depths = torch.ones(self.width - 1, dtype=torch.long, device=device)
        self.path_rows = torch.zeros(steps, dtype=torch.long, device=device)

    # --- the fixed-shape steps (what the graphs capture) ------------------------------------------------
    # Each under no_grad of its own: torch.compile traces a step for autograd when the caller has grad on and the draft's
    # parameters require it, and the Triton kernels have no backward (2026-12-03: a profile's compiled variants failed so).

    def _positions(self, start: torch.Tensor, width: int) -> torch.Tensor:
        return start + torch.arange(width, device=start.device)

    @torch.no_grad()
    def _decode(self, bucket: int) -> None:
        """Plain decode: the token in scalars[3] at position scalars[0] -> its greedy successor in `decoded`."""
        logits, _ = self.static_target.forward(self.scalars[3:4].view(1, 1), self.scalars[0:1], bucket, all_logits=False)
        self.decoded.copy_(logits[0, -1:].argmax(-1))

    @torch.no_grad()
    def _verify(self, bucket: int) -> None:
        """Verify `verify_tokens` at positions scalars[0].. (a chain, or the branches' tree): greedy ids into the report,
        and the kept branch's rows (the one whose proposals match longest; a chain's own) become the pending rows."""
        start = self.scalars[0:1]
        if self.topk > 1:
            self._verify_tree(start, bucket)
            return
        if self.branches == 1:
            logits, features = self.static_target.forward(self.verify_tokens, self._positions(start, self.width), bucket, all_logits=True)
            greedy = logits[0].argmax(-1)
            self.pending_features.copy_(features)
            self.pending_tokens[0].copy_(greedy)
            self.report[: self.width].copy_(greedy)
            self.report[self.width :].copy_(self.verify_tokens[0, 1:])
            return
        slots = self._positions(start, self.width)
        logits, features = self.static_target.forward(
            self.verify_tokens, start + self.tree_offsets, bucket, all_logits=True, slots=slots, gaps=start + self.tree_gaps
        )
        greedy = logits[0].argmax(-1)
        proposals = self.verify_tokens[0, 1:]
        matched = (proposals == greedy.index_select(0, self.tree_parents)).view(self.branches, self.num_steps)
        branch = matched.long().cumprod(1).sum(1).argmax()  # the first of the longest
        rows = torch.cat([torch.zeros_like(start), 1 + branch * self.num_steps + torch.arange(self.num_steps, device=start.device)])
        self.pending_features.copy_(features.index_select(1, rows))
        self.pending_tokens[0].copy_(greedy.index_select(0, rows))
        self.report[: self.width].copy_(greedy)
        self.report[self.width : -1].copy_(proposals)
        self.report[-1:].copy_(branch.view(1))

    def _verify_tree(self, start: torch.Tensor, bucket: int) -> None:
        """Verify the tree the draft round left (verify_tokens, node_parents, node_depths): node n in slot start + 1 + n
        at RoPE position start + its depth, seeing the committed keys, the root and its own ancestors' slots. The
        accepted path's rows become the pending rows and path_rows; the report says how many and which."""
        steps, zero = self.num_steps, torch.zeros(1, dtype=torch.long, device=start.device)
        masks = torch.stack([(start + 1).expand(self.width), torch.cat([zero, ancestor_bits(self.node_parents, steps)])], dim=1)
        positions = start + torch.cat([zero, self.node_depths])
        slots = self._positions(start, self.width)
        logits, features = self.static_target.forward(self.verify_tokens, positions, bucket, all_logits=True, slots=slots, tree=masks)
        greedy = logits[0].argmax(-1)
        accepted, path = accepted_path(self.verify_tokens[0, 1:], greedy, self.node_parents, self.node_depths, steps)
        rows = torch.cat([zero, path])
        self.pending_features.copy_(features.index_select(1, rows))
        self.pending_tokens[0].copy_(greedy.index_select(0, rows))
        self.path_rows.copy_(path)
        self.report[:1].copy_(accepted)
        self.report[1 : steps + 2].copy_(greedy.index_select(0, rows))
        self.report[steps + 2 :].copy_(path)

    @torch.no_grad()
    def _move_branch(self, bucket: int) -> None:
        """The target's K/V of num_steps slots from scalars[5].. to scalars[6]..: a kept branch other than the first
        into the positions its tokens now hold (the slots past its accepted ones are overwritten before any read). A
        tree's accepted nodes move from their slots (path_rows) to the positions after the round's first."""
        if self.topk > 1:
            start, depth = self.scalars[0:1], torch.arange(self.num_steps, device=self.scalars.device)
            destination = start + 1 + depth
            source = torch.where(depth < self.report[:1], start + self.path_rows, destination)
        else:
            source = self._positions(self.scalars[5:6], self.num_steps)
            destination = self._positions(self.scalars[6:7], self.num_steps)
        for keys, values in zip(self.static_target.keys, self.static_target.values):
            keys.index_copy_(2, destination, keys.index_select(2, source))
            values.index_copy_(2, destination, values.index_select(2, source))

    @torch.no_grad()
    def _draft_round(self, bucket: int) -> None:
        """Commit the first scalars[2] pending rows at draft positions scalars[1].., then draft num_steps proposals
        per branch: the first step's `branches` best tokens, each chained greedily.

        Writes verify_tokens = [last emitted token, branch 0's proposals, branch 1's, ...]."""
        if self.topk > 1:
            self._draft_tree(bucket)
            return
        state, draft, steps = self.static_draft, self._required_draft, self.num_steps
        assert state is not None
        out, logits, row, committed = self._commit_pending(bucket)
        if self.branches > 1:  # one row per branch from here on: [1, branches, ...]
            tokens = draft.draft_to_target_ids(logits.topk(self.branches, dim=-1).indices)
            out = out.repeat(1, self.branches, 1)
            gaps = committed + self.branch_gaps
        else:
            tokens = draft.draft_to_target_ids(logits.argmax(-1)).view(1, 1)
        proposals = [tokens]
        for step in range(steps - 1):
            if self.branches > 1:
                where = (committed + step).expand(self.branches)
                out = state.layer(where, draft._embed(tokens), out, bucket, slots=committed + self.branch_offsets + step, gaps=gaps)
            else:
                out = state.layer(committed + step, draft._embed(tokens), out, bucket)
            tokens = draft.draft_to_target_ids(draft.logits(out).argmax(-1))
            proposals.append(tokens)
        self.verify_tokens[0, :1].copy_(self.pending_tokens[0].index_select(0, row))
        self.verify_tokens[0, 1:].copy_(torch.cat(proposals).transpose(0, 1).reshape(-1))  # [steps, branches] -> branch-major

    def _commit_pending(self, bucket: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The draft's step 0 over the first scalars[2] pending rows at draft positions scalars[1]..: the last committed
        row's output [1, 1, H] and logits [1, Vd], that row's index, and the first position past the committed ones."""
        state, draft = self.static_draft, self._required_draft
        assert state is not None
        start, count = self.scalars[1:2], self.scalars[2:3]
        positions = self._positions(start, self.commit_width)
        hidden = self._draft_input(self.pending_features)
        out = state.layer(positions, draft._embed(self.pending_tokens), hidden, bucket)
        row = count - 1
        logits = draft.logits(out).index_select(1, row)[:, -1]
        return out.index_select(1, row), logits, row, start + count

    def _draft_tree(self, bucket: int) -> None:
        """Commit the pending rows, then SGLang's tree: the draft's top-k first tokens as beams, num_steps - 1 chained
        steps over them (beam j in lane j's slots, committed + j * (num_steps - 1) + step, whichever beam its parent
        was, as SGLang's KV lanes), each expanding every beam by its top-k children and keeping the best k; the best
        width - 1 candidates by path probability go to verify_tokens[1:], their parents and depths to node_parents
        and node_depths."""
        state, draft, steps, k = self.static_draft, self._required_draft, self.num_steps, self.topk
        assert state is not None
        out, logits, row, committed = self._commit_pending(bucket)
        gaps = committed + self.branch_gaps

        def chained(step: int, draft_ids: torch.Tensor, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            embeds = draft._embed(draft.draft_to_target_ids(draft_ids).view(1, k))
            out = state.layer((committed + step).expand(k), embeds, hidden, bucket, slots=committed + self.branch_offsets + step, gaps=gaps)
            return out, draft.logits(out)[0]

        # the beams along the sequence of one row
        chosen, ids, node_parents, _ = grow_tree(logits[0], out.expand(1, k, -1), chained, steps, k, self.width - 1, beam_axis=1)
        self.verify_tokens[0, :1].copy_(self.pending_tokens[0].index_select(0, row))
        self.verify_tokens[0, 1:].copy_(draft.draft_to_target_ids(ids))
        self.node_parents.copy_(node_parents)
        self.node_depths.copy_(self.candidate_depths.index_select(0, chosen))

    @torch.no_grad()
    def _prompt_step(self, width: int) -> None:
        """The target's prefill of prompt_tokens[:, :width] at positions 0..width-1: the logits of row scalars[4] (the
        prompt's last real row) into prompt_logits, every row's features into prompt_features."""
        tokens, positions = self.prompt_tokens[:, :width], self.prompt_positions[:width]
        logits, features = self.static_target.forward(tokens, positions, self._bucket(width), all_logits=False, logits_row=self.scalars[4:5])
        self.prompt_logits.copy_(logits)
        self.prompt_features[:, :width].copy_(features)

    @torch.no_grad()
    def _draft_prompt_step(self, width: int) -> None:
        """The draft's prompt rows at positions 0..width-1: prompt features t with prompt token t + 1."""
        draft, state = self._required_draft, self.static_draft
        assert state is not None
        positions = self.prompt_positions[:width]
        hidden = self._draft_input(self.prompt_features[:, :width])
        state.layer(positions, draft._embed(self.prompt_tokens[:, 1 : width + 1]), hidden, self._bucket(width))

    # --- running them ----------------------------------------------------------------------------------

    def _device_scope(self):
        """The target's GPU as the current device: a request thread's default is cuda:0, graphs and streams are per device."""
        return torch.cuda.device(self.device) if self.device.type == "cuda" else contextlib.nullcontext()

    def _bucket(self, needed: int) -> int:
        for size in self.buckets:
            if size >= needed:
                return size
        raise ContextTooLong(f"{needed} positions exceed the static cache's {self.max_len} (max_len); nothing more was decoded")

    def _check_room(self, prompt_len: int, max_new_tokens: int, extra: int) -> None:
        needed = prompt_len + max(max_new_tokens, 0) + extra
        if needed > self.max_len:
            raise ContextTooLong(
                f"a prompt of {prompt_len} tokens plus {max_new_tokens} new ones (+{extra} verify slack) needs {needed} positions; "
                f"the static cache holds {self.max_len}. Nothing was decoded."
            )

    def _set_scalars(self, *values: int, first: int = 0) -> None:
        """scalars[first], scalars[first + 1], ... = values, copied to the device behind the work already queued."""
        end = first + len(values)
        for index, value in enumerate(values, start=first):
            self._staged[index] = value
        self.scalars[first:end].copy_(self._staged[first:end], non_blocking=True)

    def _run(self, kind: str, function: Callable[[int], None], bucket: int) -> None:
        if not self.use_graphs:
            function(bucket)
            return
        graph = self.graphs.get((kind, bucket))
        if graph is None:
            graph = self.graphs[(kind, bucket)] = self._capture(function, bucket)
        graph.replay()

    def _capture(self, function: Callable[[int], None], bucket: int):
        """Warm up on a side stream (compiles, allocator settles), then capture; every step is idempotent in its inputs."""
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                function(bucket)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            function(bucket)
        return graph

    def _clock(self):
        if self.step_times is None:
            return None
        if self.use_graphs or self.target.device.type == "cuda":
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def _interval(self, name: str, begin, end) -> None:
        if self.step_times is not None and begin is not None:
            self.step_times.pending.append((name, begin, end))

    def _resolve_times(self) -> None:
        times = self.step_times
        if times is None:
            return
        for name, begin, end in times.pending:
            seconds = begin.elapsed_time(end) / 1000 if isinstance(begin, torch.cuda.Event) else end - begin
            getattr(times, name).append(seconds)
        times.pending.clear()

    def _width(self, rows: int) -> int:
        """The width `rows` prompt rows run at: the next of prefill_widths when padding, else their own."""
        return next(w for w in self.prefill_widths if w >= rows) if self.pad_prefill else rows

    def _prefill(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The prompt through the static target, padded to _width (a graph per width when padding on CUDA): the rows
        past the prompt write K/V at positions no step reads before overwriting them (every step writes its rows
        before it attends). Returns (the last row's logits [1, 1, V], features [1, S, F]): views of the decoder's
        buffers, good until the next prompt."""
        seq = ids.shape[1]
        self.prompt_tokens[0, :seq].copy_(ids[0])
        self.prompt_tokens[0, seq:].zero_()
        self._set_scalars(seq - 1, first=4)
        self._run_prompt("prompt", self._prompt_step, self._width(seq))
        return self.prompt_logits, self.prompt_features[:, :seq]

    def _draft_prompt(self, rows: int) -> None:
        """Commit the draft's first `rows` prompt rows (after _prefill of that prompt), padded like _prefill."""
        self._run_prompt("draft_prompt", self._draft_prompt_step, self._width(rows))

    def _run_prompt(self, kind: str, function: Callable[[int], None], width: int) -> None:
        """A prompt step: captured per padded width when padding under graphs, else run eagerly (an unpadded prompt
        would capture a graph per length)."""
        if self.pad_prefill:
            self._run(kind, function, width)
        else:
            function(width)

    def warm_prefill(self) -> None:
        """Run every padded prompt width once (the target's prefill and the draft's prompt commit; on CUDA each is
        captured then): no request brings a width first. Only when padding (on CUDA); a CPU decoder has no per-shape
        cost worth it."""
        if not self.pad_prefill:
            return
        with torch.no_grad(), self._device_scope():
            for width in self.prefill_widths:
                self._prefill(torch.zeros(1, width, dtype=torch.long, device=self.device))
                if self.static_draft is not None:
                    self._draft_prompt(width)

    def warm_steps(self, every_bucket: bool | None = None) -> int:
        """Run each step kind once at every cache prefix (on CUDA each is captured then; every_bucket=None: when using
        graphs) and return how many ran: no request pays a capture. On the H200 (2026-12-03) the first prompt of 3,397
        tokens took 2.21 s where its plain decode took 0.42 s: verify, draft and move captured at two new prefixes."""
        if not (self.use_graphs if every_bucket is None else every_bucket):
            return 0
        kinds: list[tuple[str, Callable[[int], None]]] = [("decode", self._decode_fn)]
        if self.static_draft is not None:
            kinds += [("draft", self._draft_fn), ("verify", self._verify_fn), ("move", self._move_fn)]
        with torch.no_grad(), self._device_scope():
            # positions 0.. of the cache: what the steps write there, a request's prefill writes again
            self._set_scalars(1, 0, 1, 0)
            self._set_scalars(1 + self.num_steps, 1, first=5)
            for bucket in self.buckets:
                for kind, function in kinds:
                    self._run(kind, function, bucket)
        return len(self.buckets) * len(kinds)

    # --- decoding --------------------------------------------------------------------------------------

    def plain(self, input_ids, max_new_tokens: int) -> GenerateResult:
        """Plain greedy decoding, one width-1 step per token (SpecDecoder.plain's stop rules and results)."""
        with torch.no_grad(), self._device_scope():
            return self._plain(input_ids, max_new_tokens)

    def generate(self, input_ids, max_new_tokens: int) -> GenerateResult:
        """Speculative greedy decoding; the same tokens, verify_ct and accepted_per_round as SpecDecoder.generate."""
        with torch.no_grad(), self._device_scope():
            return self._generate(input_ids, max_new_tokens)

    def _plain(self, input_ids, max_new_tokens: int) -> GenerateResult:
        ids = self._prompt(input_ids)
        self._check_room(ids.shape[1], max_new_tokens, 1)
        begin = self._clock()
        logits, _ = self._prefill(ids)
        result = GenerateResult(output_ids=[], completion_tokens=0, verify_ct=0)
        token, position = int(logits[0, -1].argmax()), ids.shape[1]
        self._interval("prefill", begin, self._clock())
        while not self._done(result, max_new_tokens):
            self._emit(result, [token], max_new_tokens)
            if self._done(result, max_new_tokens):
                break
            begin_wall, begin = time.perf_counter(), self._clock()
            self._set_scalars(position, 0, 0, token)
            self._run("decode", self._decode_fn, self._bucket(position + 1))
            end = self._clock()
            token = int(self.decoded.item())
            position += 1
            if self.step_times is not None:
                self._interval("decode", begin, end)
                self.step_times.round_wall.append(time.perf_counter() - begin_wall)
        self._resolve_times()
        return result

    def _kept(self, report: list[int]) -> tuple[int, int, list[int]]:
        """From a verify's report: the kept branch (the verify's choice: the first of the longest), its accepted
        proposals, and the tokens the round emits (the accepted ones and the target's next). A tree's "branch" is 1
        when its accepted nodes are not in the slots their positions name (their K/V must move), else 0."""
        width, steps = self.width, self.num_steps
        if self.topk > 1:
            accepted = report[0]
            moved = report[steps + 2 : steps + 2 + accepted] != list(range(1, accepted + 1))
            return int(moved), accepted, report[1 : accepted + 2]
        greedy, proposals = report[:width], report[width : 2 * width - 1]
        branch = report[-1] if self.branches > 1 else 0
        rows = [0]
        while len(rows) <= steps and proposals[branch * steps + len(rows) - 1] == greedy[rows[-1]]:
            rows.append(1 + branch * steps + len(rows) - 1)
        return branch, len(rows) - 1, [greedy[row] for row in rows]

    def _generate(self, input_ids, max_new_tokens: int) -> GenerateResult:
        state = self.static_draft
        if state is None:
            raise ValueError(NO_DRAFT)
        ids = self._prompt(input_ids)
        prompt_len, width = ids.shape[1], self.width
        self._check_room(prompt_len, max_new_tokens, width)
        prefill_begin = self._clock()
        logits, features = self._prefill(ids)
        result = self._speculative_result(features)
        if max_new_tokens <= 0:
            return result
        last = int(logits[0, -1].argmax())
        self._emit(result, [last])
        self._draft_input(features[:, -1:])  # refuses a feature of the wrong width before anything is captured
        if prompt_len > 1:  # the draft's prompt rows but the last; the last one rides the first round
            self._draft_prompt(prompt_len - 1)
        self.pending_features[:, :1].copy_(features[:, -1:])
        self.pending_tokens[0, 0] = last
        self._interval("prefill", prefill_begin, self._clock())
        target_start, draft_start, count = prompt_len, prompt_len - 1, 1
        while not self._done(result, max_new_tokens):
            bucket = self._bucket(target_start + width)
            begin_wall, begin = time.perf_counter(), self._clock()
            self._set_scalars(target_start, draft_start, count)
            self._run("draft", self._draft_fn, bucket)
            middle = self._clock()
            self._run("verify", self._verify_fn, bucket)
            end = self._clock()
            branch, accepted, emitted = self._kept(self.report.tolist())
            if branch and accepted:  # the kept branch's (or tree path's) K/V into the positions its accepted tokens now hold
                if self.topk == 1:
                    self._set_scalars(target_start + 1 + branch * self.num_steps, target_start + 1, first=5)
                self._run("move", self._move_fn, bucket)
            result.verify_ct += 1
            result.accepted_per_round.append(accepted)
            self._emit(result, emitted, max_new_tokens)
            target_start, draft_start, count = target_start + accepted + 1, draft_start + count, accepted + 1
            if self.step_times is not None:
                self._interval("draft", begin, middle)
                self._interval("verify", middle, end)
                self.step_times.round_wall.append(time.perf_counter() - begin_wall)
        self._resolve_times()
        return result
