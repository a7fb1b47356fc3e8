"""The EAGLE-3 draft model (SGLang's LlamaForCausalLMEagle3): config, TTT training forward and incremental decoding steps."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Callable, Iterator

import torch
from torch import nn

from backend.train.attention import check_backend, compiled, default_backend, ttt_attention

ARCHITECTURE = "LlamaForCausalLMEagle3"
CONSOLE_BLOCK = "eagle3_console"
FORMAT_VERSION = 1


class FeatureWidthError(ValueError):
    """The draft was handed hidden features of the wrong width (e.g. one layer instead of three)."""


class DraftConfigError(ValueError):
    """A draft config.json lacks a field or holds a value the draft cannot be built from."""


@dataclass
class DraftModelConfig:
    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    vocab_size: int
    draft_vocab_size: int
    target_hidden_size: int
    aux_layer_ids: list[int] = field(default_factory=list)
    torch_dtype: str = "bfloat16"
    ttt_length: int = 7

    def __post_init__(self) -> None:
        if self.num_attention_heads % self.num_key_value_heads:
            raise DraftConfigError(f"num_attention_heads ({self.num_attention_heads}) must be a multiple of num_key_value_heads ({self.num_key_value_heads})")
        if self.draft_vocab_size > self.vocab_size:
            raise DraftConfigError(f"draft_vocab_size ({self.draft_vocab_size}) exceeds vocab_size ({self.vocab_size})")
        if not self.aux_layer_ids:
            raise DraftConfigError("aux_layer_ids is empty: the draft needs the target layers its fc input is built from")

    @property
    def aux_width(self) -> int:
        """Width of the concatenated aux hidden states fc expects: len(aux_layer_ids) x target hidden."""
        return len(self.aux_layer_ids) * self.target_hidden_size

    @classmethod
    def from_profile(cls, profile) -> "DraftModelConfig":
        draft, target = profile.draft, profile.target
        return cls(
            hidden_size=draft.hidden_size,
            num_attention_heads=draft.num_attention_heads,
            num_key_value_heads=draft.num_key_value_heads,
            head_dim=draft.head_dim or draft.hidden_size // draft.num_attention_heads,
            intermediate_size=draft.intermediate_size,
            rms_norm_eps=draft.rms_norm_eps,
            rope_theta=draft.rope_theta,
            max_position_embeddings=draft.max_position_embeddings,
            vocab_size=target.vocab_size,
            draft_vocab_size=draft.draft_vocab_size,
            target_hidden_size=target.hidden_size,
            aux_layer_ids=list(target.aux_layer_ids),
            torch_dtype=profile.train.dtype,
            ttt_length=profile.train.ttt_length,
        )

    def to_hf_config(self, extra: dict | None = None) -> dict:
        """The config.json SGLang reads, plus an `eagle3_console` block (SGLang ignores unknown keys).

        `extra` (e.g. {"val_acc": [...], "val_acc_step": 300, "epoch": 0, "step": 300}) is merged into
        the eagle3_console block.
        """
        console = {
            "format_version": FORMAT_VERSION,
            "trained_aux_width": self.aux_width,
            "trained_aux_layer_ids": list(self.aux_layer_ids),
            "aux_layer_convention": "output_of_layer",
            "ttt_length": self.ttt_length,
        }
        console.update(extra or {})
        return {
            "architectures": [ARCHITECTURE],
            "model_type": "llama",
            "hidden_size": self.hidden_size,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "intermediate_size": self.intermediate_size,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": None,
            "max_position_embeddings": self.max_position_embeddings,
            "num_hidden_layers": 1,
            "vocab_size": self.vocab_size,
            "draft_vocab_size": self.draft_vocab_size,
            "target_hidden_size": self.target_hidden_size,
            "tie_word_embeddings": False,
            "attention_bias": False,
            "mlp_bias": False,
            "torch_dtype": self.torch_dtype,
            "eagle_config": {
                "eagle_aux_hidden_state_layer_ids": list(self.aux_layer_ids),
                "use_aux_hidden_state": True,
            },
            CONSOLE_BLOCK: console,
        }

    @classmethod
    def from_hf_config(cls, config: dict) -> "DraftModelConfig":
        required = ["hidden_size", "num_attention_heads", "intermediate_size", "vocab_size", "draft_vocab_size"]
        missing = [key for key in required if config.get(key) is None]
        if missing:
            raise DraftConfigError(f"draft config lacks {', '.join(missing)} (null counts as missing); nothing was built")
        if config.get("num_hidden_layers", 1) != 1:
            raise DraftConfigError(f"draft config has num_hidden_layers={config['num_hidden_layers']}; this draft has exactly 1 layer")
        console = config.get(CONSOLE_BLOCK) or {}
        eagle = config.get("eagle_config") or {}
        aux_ids = eagle.get("eagle_aux_hidden_state_layer_ids") or console.get("trained_aux_layer_ids")
        if not aux_ids:
            raise DraftConfigError("draft config names no aux layers (eagle_config.eagle_aux_hidden_state_layer_ids); nothing was built")
        hidden = config["hidden_size"]
        heads = config["num_attention_heads"]
        return cls(
            hidden_size=hidden,
            num_attention_heads=heads,
            num_key_value_heads=config.get("num_key_value_heads") or heads,
            head_dim=config.get("head_dim") or hidden // heads,
            intermediate_size=config["intermediate_size"],
            rms_norm_eps=config.get("rms_norm_eps", 1e-6),
            rope_theta=config.get("rope_theta", 10000.0),
            max_position_embeddings=config.get("max_position_embeddings", 2048),
            vocab_size=config["vocab_size"],
            draft_vocab_size=config["draft_vocab_size"],
            target_hidden_size=config.get("target_hidden_size") or hidden,
            aux_layer_ids=list(aux_ids),
            torch_dtype=config.get("torch_dtype") or "bfloat16",
            ttt_length=console.get("ttt_length", 7),
        )

    def as_dict(self) -> dict:
        return asdict(self)


Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
"""(query [B, nh, S, d], key, value [B, nkv, S, d]) -> [B, nh, S, d]: what the step attends to is the caller's state
(TTTAttention while training, DraftKVCache.commit/.draft while decoding), as SGLang's layers leave it to forward_batch."""


# --- the decoder layer's math as pure functions of (activations, weights): on CUDA the TTT training path runs
# them through torch.compile (one graph each, reused by every TTT step), so RMSNorm, RoPE and SwiGLU become a
# few fused kernels that save only what their backward needs.


def _rms(hidden: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm: normalise in fp32, round to the input dtype, scale."""
    dtype = hidden.dtype
    hidden = hidden.float()
    hidden = hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + eps)
    return weight * hidden.to(dtype)


def rotate_half(tensor: torch.Tensor) -> torch.Tensor:
    first, second = tensor.chunk(2, dim=-1)
    return torch.cat([-second, first], dim=-1)


def _pre_attention(
    embeds: torch.Tensor,
    hidden: torch.Tensor,
    w_input: torch.Tensor,
    w_hidden: torch.Tensor,
    qkv_weight: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    eps: float,
    heads: int,
    kv_heads: int,
    head_dim: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v [B, n, S, d] (RoPE applied) from concat(input_layernorm(embeds), hidden_norm(hidden))."""
    batch, seq, _ = hidden.shape
    joined = torch.cat([_rms(embeds, w_input, eps), _rms(hidden, w_hidden, eps)], dim=-1)
    qkv = torch.nn.functional.linear(joined, qkv_weight)
    query, key, value = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    query = query.view(batch, seq, heads, head_dim).transpose(1, 2)
    key = key.view(batch, seq, kv_heads, head_dim).transpose(1, 2)
    value = value.view(batch, seq, kv_heads, head_dim).transpose(1, 2)
    query = query * cos + rotate_half(query) * sin
    key = key * cos + rotate_half(key) * sin
    return query, key, value


def _post_attention(
    hidden: torch.Tensor,
    attn_out: torch.Tensor,
    o_weight: torch.Tensor,
    w_post: torch.Tensor,
    gate_weight: torch.Tensor,
    up_weight: torch.Tensor,
    down_weight: torch.Tensor,
    eps: float,
) -> torch.Tensor:
    """The pre-norm output state: residual + o_proj, then post-norm SwiGLU MLP + residual."""
    batch, _, seq, _ = attn_out.shape
    attn_out = attn_out.transpose(1, 2).reshape(batch, seq, -1)
    hidden = hidden + torch.nn.functional.linear(attn_out, o_weight)
    normed = _rms(hidden, w_post, eps)
    gate = torch.nn.functional.linear(normed, gate_weight)
    up = torch.nn.functional.linear(normed, up_weight)
    return hidden + torch.nn.functional.linear(torch.nn.functional.silu(gate) * up, down_weight)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return _rms(hidden, self.weight, self.eps)


class DraftAttention(nn.Module):
    """q/k/v over concat(embeds, hidden) (2H wide), RoPE over head_dim, o_proj back to H."""

    def __init__(self, config: DraftModelConfig):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_attention_heads, config.num_key_value_heads, config.head_dim
        self.rope_theta = config.rope_theta
        in_width = 2 * config.hidden_size
        self.q_proj = nn.Linear(in_width, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(in_width, self.num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(in_width, self.num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=False)

    def rope(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [S, d] at `positions` (Llama RoPE, no scaling)."""
        dim = self.head_dim
        inv_freq = 1.0 / (self.rope_theta ** (torch.arange(0, dim, 2, device=positions.device, dtype=torch.float32) / dim))
        angles = positions.float()[:, None] * inv_freq[None, :]
        angles = torch.cat([angles, angles], dim=-1)
        return angles.cos().to(dtype), angles.sin().to(dtype)


class DraftMLP(nn.Module):
    def __init__(self, config: DraftModelConfig):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)


class DraftDecoderLayer(nn.Module):
    """The draft's one decoder layer (SGLang's llama_eagle3 LlamaDecoderLayer): q/k/v read concat(input_layernorm(embed), hidden_norm(hidden))."""

    def __init__(self, config: DraftModelConfig):
        super().__init__()
        self.self_attn = DraftAttention(config)
        self.mlp = DraftMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.hidden_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def qkv_weight(self) -> torch.Tensor:
        """q|k|v stacked for one product; a TTT pass stacks them once and hands the result to every step."""
        attn = self.self_attn
        return torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight], dim=0)

    def forward(
        self,
        positions: torch.Tensor,
        embeds: torch.Tensor,
        hidden: torch.Tensor,
        attend: Attend,
        qkv_weight: torch.Tensor | None = None,
        compile_regions: bool = False,
    ) -> torch.Tensor:
        """One step at `positions` (RoPE): embeds and hidden [B, S, H] -> the PRE-norm output state [B, S, H].

        attend(q, k, v) holds the K/V the step sees; compile_regions: run the math before and after attention as
        compiled graphs (CUDA training).
        """
        attn, mlp, eps = self.self_attn, self.mlp, self.input_layernorm.eps
        cos, sin = attn.rope(positions, hidden.dtype)
        pre = compiled(_pre_attention) if compile_regions else _pre_attention
        post = compiled(_post_attention) if compile_regions else _post_attention
        qkv = self.qkv_weight() if qkv_weight is None else qkv_weight
        query, key, value = pre(
            embeds, hidden, self.input_layernorm.weight, self.hidden_norm.weight, qkv, cos, sin, eps, attn.num_heads, attn.num_kv_heads, attn.head_dim
        )
        return post(
            hidden,
            attend(query, key, value),
            attn.o_proj.weight,
            self.post_attention_layernorm.weight,
            mlp.gate_proj.weight,
            mlp.up_proj.weight,
            mlp.down_proj.weight,
            eps,
        )


class TTTAttention:
    """What the steps of one TTT unroll attend to: step 0's K/V causally, plus the diagonal K/V of steps 1..k."""

    def __init__(self, backend: str, compiled_merge: bool = False):
        self.backend, self.compiled_merge = backend, compiled_merge
        self.key0: torch.Tensor | None = None
        self.value0: torch.Tensor | None = None
        self.diag_keys: list[torch.Tensor] = []
        self.diag_values: list[torch.Tensor] = []

    def __call__(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        if self.key0 is None or self.value0 is None:
            self.key0, self.value0 = key, value
        else:
            self.diag_keys.append(key)
            self.diag_values.append(value)
        return ttt_attention(query, self.key0, self.value0, self.diag_keys, self.diag_values, self.backend, compiled_merge=self.compiled_merge)


class DraftKVCache:
    """Decoding state of the draft: step-0 K/V of committed positions plus this round's diagonal K/V."""

    def __init__(self) -> None:
        self.keys: torch.Tensor | None = None  # [B, nkv, T, d], RoPE applied at positions 0..T-1
        self.values: torch.Tensor | None = None
        self.diag_keys: list[torch.Tensor] = []  # steps 1..k of the round in progress, [B, nkv, 1, d]
        self.diag_values: list[torch.Tensor] = []

    @property
    def length(self) -> int:
        return 0 if self.keys is None else self.keys.shape[2]

    def begin_round(self) -> None:
        self.diag_keys, self.diag_values = [], []

    def commit(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        """Attend for step 0 over new positions T..T+m-1: their K/V join the committed ones and a new round starts."""
        start = self.length
        keys = self.keys = key if self.keys is None else torch.cat([self.keys, key], dim=2)
        values = self.values = value if self.values is None else torch.cat([self.values, value], dim=2)
        self.begin_round()
        return _attend_prefix(query, keys, values, start)

    def draft(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        """Attend for TTT step k >= 1 at the last committed position: every committed K/V and this round's diagonal."""
        if self.keys is None or self.values is None:
            raise RuntimeError("draft_step before extend: the draft cache holds no committed positions; nothing was computed")
        self.diag_keys.append(key)
        self.diag_values.append(value)
        keys = torch.cat([self.keys, *self.diag_keys], dim=2)
        values = torch.cat([self.values, *self.diag_values], dim=2)
        return _attend_prefix(query, keys, values, keys.shape[2] - 1)


class Eagle3Draft(nn.Module):
    """SGLang's LlamaForCausalLMEagle3: fc over 3 target layers, one decoder layer, norm, lm_head over Vd."""

    d2t: torch.Tensor  # buffers (register_buffer below), typed for the checker
    t2d: torch.Tensor

    def __init__(self, config: DraftModelConfig, attn_backend: str | None = None, init_std: float = 0.02):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.embed_tokens.weight.requires_grad_(False)
        self.fc = nn.Linear(config.aux_width, config.hidden_size, bias=False)
        self.midlayer = DraftDecoderLayer(config)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.int64))
        t2d = torch.zeros(config.vocab_size, dtype=torch.bool)
        t2d[: config.draft_vocab_size] = True
        self.register_buffer("t2d", t2d)
        self.attn_backend = attn_backend
        self.compile_regions = False  # trainer: True on CUDA (torch.compile of the per-step layer functions)
        self.embedding_loaded = False
        self._init_weights(init_std)

    def _init_weights(self, std: float) -> None:
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, mean=0.0, std=std)
        nn.init.zeros_(self.embed_tokens.weight)

    # --- setup -----------------------------------------------------------------------------------

    def load_target_embedding(self, weight: torch.Tensor) -> None:
        """Copy the target's input embedding [V, H] (frozen; never saved in checkpoints)."""
        expected = tuple(self.embed_tokens.weight.shape)
        if tuple(weight.shape) != expected:
            raise ValueError(
                f"target embedding has shape {tuple(weight.shape)} but the draft needs {expected} "
                f"(vocab_size x draft hidden_size); the draft embedding was left unchanged"
            )
        with torch.no_grad():
            self.embed_tokens.weight.copy_(weight.detach())
        self.embed_tokens.weight.requires_grad_(False)
        self.embedding_loaded = True

    def set_vocab_mapping(self, d2t: torch.Tensor, t2d: torch.Tensor) -> None:
        """Install d2t [Vd] int64 offsets (target_id = d2t[i] + i) and t2d [V] bool, after checking they agree."""
        vd, v = self.config.draft_vocab_size, self.config.vocab_size
        d2t = torch.as_tensor(d2t)
        t2d = torch.as_tensor(t2d)
        if tuple(d2t.shape) != (vd,) or tuple(t2d.shape) != (v,):
            raise ValueError(f"vocab mapping shapes d2t {tuple(d2t.shape)}, t2d {tuple(t2d.shape)}; expected ({vd},) and ({v},); mapping left unchanged")
        if d2t.dtype.is_floating_point or t2d.dtype not in (torch.bool, torch.uint8, torch.int64, torch.int32):
            raise ValueError(f"vocab mapping dtypes d2t {d2t.dtype}, t2d {t2d.dtype}; expected int64 offsets and a bool mask; mapping left unchanged")
        target_ids = d2t.long() + torch.arange(vd)
        if target_ids.min() < 0 or target_ids.max() >= v:
            raise ValueError(f"d2t maps draft ids outside 0..{v - 1} (d2t holds offsets, not absolute ids?); mapping left unchanged")
        if not torch.equal(torch.nonzero(t2d.bool()).flatten(), target_ids):
            raise ValueError("d2t and t2d disagree: d2t[i] + i must list exactly the ids t2d marks, ascending; mapping left unchanged")
        self.d2t.copy_(d2t.long())
        self.t2d.copy_(t2d.bool())

    def load_target_head(self, lm_head: torch.Tensor, norm: torch.Tensor | None) -> None:
        """Start the output layer from the target's: lm_head's rows of the draft vocabulary (set_vocab_mapping first)
        and the target's final norm weight (kept as is when None). Both stay trainable."""
        vocab, width = self.config.vocab_size, self.config.hidden_size
        if tuple(lm_head.shape) != (vocab, width):
            raise ValueError(
                f"target lm_head has shape {tuple(lm_head.shape)} but the draft's output layer needs ({vocab}, {width}) "
                "(target vocab x draft hidden size); the draft's lm_head was left as initialised"
            )
        if norm is not None and tuple(norm.shape) != (width,):
            raise ValueError(f"target final norm has shape {tuple(norm.shape)}, the draft's is ({width},); the draft's lm_head was left as initialised")
        draft_ids = (self.d2t + torch.arange(self.d2t.numel(), device=self.d2t.device)).to(lm_head.device)
        with torch.no_grad():
            self.lm_head.weight.copy_(lm_head.detach()[draft_ids])
            if norm is not None:
                self.norm.weight.copy_(norm.detach())

    def set_attention_backend(self, name: str | None) -> None:
        self.attn_backend = None if name is None else check_backend(name, self.fc.weight.device)

    def _backend(self, device: torch.device) -> str:
        return self.attn_backend or default_backend(device)

    def draft_to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]

    # --- features --------------------------------------------------------------------------------

    def project(self, aux_hidden: torch.Tensor) -> torch.Tensor:
        """fc over the concatenated aux hidden states [B, S, 3*Ht] -> [B, S, H]; refuses any other width."""
        width = aux_hidden.shape[-1]
        expected = self.config.aux_width
        if width != expected:
            raise FeatureWidthError(self._width_message(width) + "; nothing was computed")
        return self.fc(aux_hidden)

    def _width_message(self, width: int) -> str:
        config = self.config
        layers = len(config.aux_layer_ids)
        message = f"draft fc expects aux features of width {config.aux_width} ({layers} layers x target hidden {config.target_hidden_size}) but got {width}"
        if width == config.target_hidden_size:
            count = {2: "two", 3: "three", 4: "four"}.get(layers, str(layers))
            message += f" (one layer's hidden state instead of {count} concatenated)"
        return message

    def input_hidden(self, features: torch.Tensor, sglang_width_check: bool = False) -> torch.Tensor:
        """Hidden state for draft step 0 from target features.

        Strict (default): `project`. With sglang_width_check=True this mimics llama_eagle3.py: fc runs only
        when the width differs from the draft hidden size, so a 1-layer feature of width H skips fc silently.
        """
        if not sglang_width_check:
            return self.project(features)
        if features.shape[-1] == self.config.hidden_size:
            return features
        return self.project(features)

    # --- the steps, each one call of the decoder layer ---------------------------------------------------

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(hidden))

    def _embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        if not self.embedding_loaded:
            raise RuntimeError("the draft has no target embedding yet: call load_target_embedding(target embed_tokens weight) first")
        return self.embed_tokens(token_ids).to(self.fc.weight.dtype)

    def _ttt_steps(
        self, aux_hidden: torch.Tensor, input_ids: torch.Tensor, ttt_length: int, pad_token_id: int, compile_regions: bool = False
    ) -> Iterator[torch.Tensor]:
        """The pre-norm output state [B, S, H] of each TTT step k = 0..ttt_length-1 (see ttt_forward)."""
        batch, seq = input_ids.shape
        if aux_hidden.shape[:2] != (batch, seq):
            raise ValueError(f"aux_hidden is {tuple(aux_hidden.shape)} but input_ids is {tuple(input_ids.shape)}; batch and sequence must match")
        hidden = self.project(aux_hidden.to(self.fc.weight.dtype))
        padded = torch.nn.functional.pad(input_ids, (0, ttt_length), value=pad_token_id)
        positions = torch.arange(seq, device=input_ids.device)
        attend = TTTAttention(self._backend(hidden.device), compiled_merge=compile_regions)
        qkv_weight = self.midlayer.qkv_weight()
        for step in range(ttt_length):
            embeds = self._embed(padded[:, 1 + step : 1 + step + seq])
            hidden = self.midlayer(positions + step, embeds, hidden, attend, qkv_weight, compile_regions)
            yield hidden

    # --- training ---------------------------------------------------------------------------------

    def ttt_forward(
        self,
        aux_hidden: torch.Tensor,
        input_ids: torch.Tensor,
        ttt_length: int,
        loss_positions: torch.Tensor | list[torch.Tensor] | None = None,
        pad_token_id: int = 0,
    ) -> list[torch.Tensor]:
        """Logits of every TTT step k = 0..ttt_length-1, each [B, S, Vd] (SpecForge semantics).

        Step 0 at t reads fc(aux_t) and token x_{t+1}; step k reads the step k-1 pre-norm output at t
        and token x_{t+1+k} (pad_token_id beyond S). logits_k[:, t] predicts the target's distribution
        at t+1+k. Attention: causal over step-0 K/V, plus the diagonal K/V of steps 1..k; RoPE at t+k.
        loss_positions: optional bool [B, S] (or one per step): return logits only there, as [N, Vd].
        """
        batch, seq = input_ids.shape
        selections = _selections(loss_positions, ttt_length, batch * seq)
        outputs = []
        for step, hidden in enumerate(self._ttt_steps(aux_hidden, input_ids, ttt_length, pad_token_id)):
            selected = hidden if selections is None else hidden.reshape(batch * seq, -1).index_select(0, selections[step])
            outputs.append(self.logits(selected))
        return outputs

    def ttt_hidden(self, aux_hidden: torch.Tensor, input_ids: torch.Tensor, ttt_length: int, pad_token_id: int = 0) -> torch.Tensor:
        """norm(output state) of every TTT step at every position, stacked: [ttt_length, B, S, H].

        The same computation as ttt_forward without the lm_head: the trainer applies lm_head and the soft
        cross-entropy of all steps in one chunked, fused pass (loss.fused_ttt_loss), so no [S, Vd] logits
        of any step are kept. With compile_regions (on CUDA) the layer and the norm run as compiled graphs.
        """
        use_compiled = self.compile_regions and self.fc.weight.device.type == "cuda"
        norm = compiled(_rms) if use_compiled else _rms
        eps = self.norm.eps
        steps = self._ttt_steps(aux_hidden, input_ids, ttt_length, pad_token_id, use_compiled)
        return torch.stack([norm(hidden, self.norm.weight, eps) for hidden in steps])

    # --- decoding (incremental) ----------------------------------------------------------------------

    def extend(self, hidden: torch.Tensor, next_tokens: torch.Tensor, cache: DraftKVCache) -> tuple[torch.Tensor, torch.Tensor]:
        """Step 0 over newly committed positions T..T+m-1 (T = cache.length).

        hidden [B, m, H]: the projected target features of those positions; next_tokens [B, m]: token t+1
        for each. Appends their step-0 K/V to `cache`, starts a new round, and returns the pre-norm output
        [B, m, H] and logits [B, m, Vd] (the last row proposes the first draft token).
        """
        start = cache.length
        positions = torch.arange(start, start + hidden.shape[1], device=hidden.device)
        out = self.midlayer(positions, self._embed(next_tokens), hidden, cache.commit)
        return out, self.logits(out)

    def draft_step(self, prev_hidden: torch.Tensor, token: torch.Tensor, cache: DraftKVCache) -> tuple[torch.Tensor, torch.Tensor]:
        """TTT step k >= 1 of the round at t = cache.length - 1: prev_hidden [B, 1, H] (step k-1 output),
        token [B, 1] (the proposal of step k-1). Attends to all committed step-0 K/V and this round's
        diagonal K/V (steps 1..k); RoPE at t + k. Returns (pre-norm output [B, 1, H], logits [B, 1, Vd])."""
        step = len(cache.diag_keys) + 1
        position = torch.tensor([cache.length - 1 + step], device=prev_hidden.device)
        out = self.midlayer(position, self._embed(token), prev_hidden, cache.draft)
        return out, self.logits(out)


def _selections(loss_positions, steps: int, rows: int) -> list[torch.Tensor] | None:
    """Row indices (into the flattened [B*S]) per step, found with one device sync for all steps."""
    if loss_positions is None:
        return None
    masks = list(loss_positions) if isinstance(loss_positions, (list, tuple)) else [loss_positions] * steps
    if len(masks) < steps:
        raise ValueError(f"loss_positions holds {len(masks)} masks for {steps} TTT steps")
    stacked = torch.stack([mask.reshape(-1).bool() for mask in masks[:steps]])
    if stacked.shape[1] != rows:
        raise ValueError(f"loss_positions masks have {stacked.shape[1]} positions, the batch has {rows}")
    flat = torch.nonzero(stacked.reshape(-1)).flatten()
    counts = stacked.sum(1).tolist()
    return [indices - step * rows for step, indices in enumerate(flat.split(counts))]


def _attend_prefix(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, first_query_pos: int) -> torch.Tensor:
    """Dense attention for decoding: query i (at key index first_query_pos + i) sees keys 0..first_query_pos + i."""
    groups = query.shape[1] // keys.shape[1]
    if groups > 1:
        keys = keys.repeat_interleave(groups, dim=1)
        values = values.repeat_interleave(groups, dim=1)
    scores = query @ keys.transpose(-1, -2) / math.sqrt(query.shape[-1])
    query_pos = torch.arange(query.shape[2], device=query.device)[:, None] + first_query_pos
    key_pos = torch.arange(keys.shape[2], device=query.device)[None, :]
    scores = scores.masked_fill(key_pos > query_pos, float("-inf"))
    return torch.softmax(scores.float(), dim=-1).to(query.dtype) @ values
