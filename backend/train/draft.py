"""The EAGLE-3 draft model (SGLang's LlamaForCausalLMEagle3): config, TTT training forward and incremental decoding steps."""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import torch
from torch import nn

from backend.train.attention import check_backend, default_backend, ttt_attention

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
            raise DraftConfigError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of num_key_value_heads ({self.num_key_value_heads})"
            )
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


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        dtype = hidden.dtype
        hidden = hidden.float()
        hidden = hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * hidden.to(dtype)


class DraftAttention(nn.Module):
    def __init__(self, config: DraftModelConfig):
        super().__init__()
        in_width = 2 * config.hidden_size
        self.q_proj = nn.Linear(in_width, config.num_attention_heads * config.head_dim, bias=False)
        self.k_proj = nn.Linear(in_width, config.num_key_value_heads * config.head_dim, bias=False)
        self.v_proj = nn.Linear(in_width, config.num_key_value_heads * config.head_dim, bias=False)
        self.o_proj = nn.Linear(config.num_attention_heads * config.head_dim, config.hidden_size, bias=False)


class DraftMLP(nn.Module):
    def __init__(self, config: DraftModelConfig):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)


class DraftDecoderLayer(nn.Module):
    """The draft's one decoder layer; q/k/v read concat(input_layernorm(embed), hidden_norm(hidden))."""

    def __init__(self, config: DraftModelConfig):
        super().__init__()
        self.self_attn = DraftAttention(config)
        self.mlp = DraftMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.hidden_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class _FusedWeights:
    """q|k|v and gate|up weights concatenated once per forward call (one matmul each per step)."""

    def __init__(self, layer: DraftDecoderLayer):
        attn, mlp = layer.self_attn, layer.mlp
        weight = attn.q_proj.weight
        # under autocast, cast once here rather than at each of the TTT steps' matmuls
        dtype = torch.get_autocast_dtype(weight.device.type) if torch.is_autocast_enabled(weight.device.type) else weight.dtype
        self.qkv = torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight], dim=0).to(dtype)
        self.split = [attn.q_proj.out_features, attn.k_proj.out_features, attn.v_proj.out_features]
        self.gate_up = torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight], dim=0).to(dtype)


def rotate_half(tensor: torch.Tensor) -> torch.Tensor:
    first, second = tensor.chunk(2, dim=-1)
    return torch.cat([-second, first], dim=-1)


# --- the decoder layer as pure functions of (activations, weights): the TTT training path runs them
# through torch.compile on CUDA (one compiled graph each, reused by all 7 steps), so RMSNorm, RoPE and
# SwiGLU become a few fused kernels that save only what their backward needs.

def _rms(hidden: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm.forward as a function: normalise in fp32, round to the input dtype, scale."""
    dtype = hidden.dtype
    hidden = hidden.float()
    hidden = hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + eps)
    return weight * hidden.to(dtype)


def _pre_attention(embeds, hidden, w_input, w_hidden, qkv_weight, cos, sin, eps: float, heads: int, kv_heads: int, head_dim: int):
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


def _post_attention(hidden, attn_out, o_weight, w_post, gate_weight, up_weight, down_weight, w_norm, eps: float):
    """(pre-norm output state, norm(output state)): residual + o_proj, post-norm SwiGLU MLP + residual, final norm."""
    batch, _, seq, _ = attn_out.shape
    attn_out = attn_out.transpose(1, 2).reshape(batch, seq, -1)
    hidden = hidden + torch.nn.functional.linear(attn_out, o_weight)
    normed = _rms(hidden, w_post, eps)
    gate = torch.nn.functional.linear(normed, gate_weight)
    up = torch.nn.functional.linear(normed, up_weight)
    hidden = hidden + torch.nn.functional.linear(torch.nn.functional.silu(gate) * up, down_weight)
    return hidden, _rms(hidden, w_norm, eps)


_COMPILED: dict = {}


def compiled(function):
    """torch.compile(function), built once per process (CUDA training path; see Eagle3Draft.compile_regions)."""
    found = _COMPILED.get(function)
    if found is None:
        import torch._dynamo.config as dynamo_config

        for name in ("recompile_limit", "cache_size_limit"):  # the diagonal merge compiles once per TTT step count
            if hasattr(dynamo_config, name):
                setattr(dynamo_config, name, max(64, getattr(dynamo_config, name)))
        found = _COMPILED[function] = torch.compile(function, dynamic=False)
    return found


class DraftKVCache:
    """Decoding state of the draft: step-0 K/V of committed positions plus this round's diagonal K/V."""

    def __init__(self):
        self.keys: torch.Tensor | None = None  # [B, nkv, T, d], RoPE applied at positions 0..T-1
        self.values: torch.Tensor | None = None
        self.diag_keys: list[torch.Tensor] = []  # steps 1..k of the round in progress, [B, nkv, 1, d]
        self.diag_values: list[torch.Tensor] = []

    @property
    def length(self) -> int:
        return 0 if self.keys is None else self.keys.shape[2]

    def append(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        self.keys = keys if self.keys is None else torch.cat([self.keys, keys], dim=2)
        self.values = values if self.values is None else torch.cat([self.values, values], dim=2)

    def begin_round(self) -> None:
        self.diag_keys, self.diag_values = [], []


class Eagle3Draft(nn.Module):
    """SGLang's LlamaForCausalLMEagle3: fc over 3 target layers, one decoder layer, norm, lm_head over Vd."""

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
        message = (
            f"draft fc expects aux features of width {config.aux_width} "
            f"({layers} layers x target hidden {config.target_hidden_size}) but got {width}"
        )
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

    # --- the decoder layer, step by step -------------------------------------------------------------

    def _rope(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        dim = self.config.head_dim
        inv_freq = 1.0 / (self.config.rope_theta ** (torch.arange(0, dim, 2, device=positions.device, dtype=torch.float32) / dim))
        angles = positions.float()[:, None] * inv_freq[None, :]
        angles = torch.cat([angles, angles], dim=-1)
        return angles.cos().to(dtype), angles.sin().to(dtype)

    def _qkv(self, embeds, hidden, positions, fused: _FusedWeights):
        layer, config = self.midlayer, self.config
        batch, seq, _ = hidden.shape
        joined = torch.cat([layer.input_layernorm(embeds), layer.hidden_norm(hidden)], dim=-1)
        query, key, value = torch.nn.functional.linear(joined, fused.qkv).split(fused.split, dim=-1)
        query = query.view(batch, seq, config.num_attention_heads, config.head_dim).transpose(1, 2)
        key = key.view(batch, seq, config.num_key_value_heads, config.head_dim).transpose(1, 2)
        value = value.view(batch, seq, config.num_key_value_heads, config.head_dim).transpose(1, 2)
        cos, sin = self._rope(positions, query.dtype)
        query = query * cos + rotate_half(query) * sin
        key = key * cos + rotate_half(key) * sin
        return query, key, value

    def _finish(self, hidden, attn_out, fused: _FusedWeights):
        """Residual (pre-hidden_norm input), o_proj, post-norm SwiGLU MLP: returns the PRE-norm output state."""
        layer = self.midlayer
        batch, _, seq, _ = attn_out.shape
        attn_out = attn_out.transpose(1, 2).reshape(batch, seq, -1)
        hidden = hidden + layer.self_attn.o_proj(attn_out)
        gate, up = torch.nn.functional.linear(layer.post_attention_layernorm(hidden), fused.gate_up).chunk(2, dim=-1)
        return hidden + layer.mlp.down_proj(torch.nn.functional.silu(gate) * up)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(hidden))

    def _embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        if not self.embedding_loaded:
            raise RuntimeError("the draft has no target embedding yet: call load_target_embedding(target embed_tokens weight) first")
        return self.embed_tokens(token_ids).to(self.fc.weight.dtype)

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
        if aux_hidden.shape[:2] != (batch, seq):
            raise ValueError(f"aux_hidden is {tuple(aux_hidden.shape)} but input_ids is {tuple(input_ids.shape)}; batch and sequence must match")
        hidden = self.project(aux_hidden.to(self.fc.weight.dtype))
        padded = torch.nn.functional.pad(input_ids, (0, ttt_length), value=pad_token_id)
        positions = torch.arange(seq, device=input_ids.device)
        backend = self._backend(hidden.device)
        fused = _FusedWeights(self.midlayer)
        selections = _selections(loss_positions, ttt_length, batch * seq)
        key0 = value0 = None
        diag_keys, diag_values, outputs = [], [], []
        for step in range(ttt_length):
            embeds = self._embed(padded[:, 1 + step : 1 + step + seq])
            query, key, value = self._qkv(embeds, hidden, positions + step, fused)
            if step == 0:
                key0, value0 = key, value
            else:
                diag_keys.append(key)
                diag_values.append(value)
            attn_out = ttt_attention(query, key0, value0, diag_keys, diag_values, backend)
            hidden = self._finish(hidden, attn_out, fused)
            selected = hidden if selections is None else hidden.reshape(batch * seq, -1).index_select(0, selections[step])
            outputs.append(self.logits(selected))
        return outputs

    def ttt_hidden(self, aux_hidden: torch.Tensor, input_ids: torch.Tensor, ttt_length: int, pad_token_id: int = 0) -> torch.Tensor:
        """norm(output state) of every TTT step at every position, stacked: [ttt_length, B, S, H].

        The same computation as ttt_forward without the lm_head: the trainer applies lm_head and the soft
        cross-entropy of all steps in one chunked, fused pass (loss.fused_ttt_loss), so no [S, Vd] logits
        of any step are kept. With compile_regions the layer runs as compiled functions (one graph each).
        """
        batch, seq = input_ids.shape
        if aux_hidden.shape[:2] != (batch, seq):
            raise ValueError(f"aux_hidden is {tuple(aux_hidden.shape)} but input_ids is {tuple(input_ids.shape)}; batch and sequence must match")
        layer, config = self.midlayer, self.config
        hidden = self.project(aux_hidden.to(self.fc.weight.dtype))
        padded = torch.nn.functional.pad(input_ids, (0, ttt_length), value=pad_token_id)
        positions = torch.arange(seq, device=input_ids.device)
        backend = self._backend(hidden.device)
        use_compiled = self.compile_regions and hidden.device.type == "cuda"
        pre = compiled(_pre_attention) if use_compiled else _pre_attention
        post = compiled(_post_attention) if use_compiled else _post_attention
        attn, mlp = layer.self_attn, layer.mlp
        qkv_weight = torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight], dim=0)
        eps = config.rms_norm_eps
        key0 = value0 = None
        diag_keys, diag_values, states = [], [], []
        for step in range(ttt_length):
            embeds = self._embed(padded[:, 1 + step : 1 + step + seq])
            cos, sin = self._rope(positions + step, hidden.dtype)
            query, key, value = pre(embeds, hidden, layer.input_layernorm.weight, layer.hidden_norm.weight, qkv_weight, cos, sin,
                                    eps, config.num_attention_heads, config.num_key_value_heads, config.head_dim)
            if step == 0:
                key0, value0 = key, value
            else:
                diag_keys.append(key)
                diag_values.append(value)
            attn_out = ttt_attention(query, key0, value0, diag_keys, diag_values, backend, compiled_merge=use_compiled)
            hidden, normed = post(hidden, attn_out, attn.o_proj.weight, layer.post_attention_layernorm.weight, mlp.gate_proj.weight,
                                  mlp.up_proj.weight, mlp.down_proj.weight, self.norm.weight, eps)
            states.append(normed)
        return torch.stack(states)

    # --- decoding (incremental) ----------------------------------------------------------------------

    def extend(self, hidden: torch.Tensor, next_tokens: torch.Tensor, cache: DraftKVCache) -> tuple[torch.Tensor, torch.Tensor]:
        """Step 0 over newly committed positions T..T+m-1 (T = cache.length).

        hidden [B, m, H]: the projected target features of those positions; next_tokens [B, m]: token t+1
        for each. Appends their step-0 K/V to `cache`, starts a new round, and returns the pre-norm output
        [B, m, H] and logits [B, m, Vd] (the last row proposes the first draft token).
        """
        start = cache.length
        positions = torch.arange(start, start + hidden.shape[1], device=hidden.device)
        fused = _FusedWeights(self.midlayer)
        query, key, value = self._qkv(self._embed(next_tokens), hidden, positions, fused)
        cache.append(key, value)
        cache.begin_round()
        attn_out = _attend_prefix(query, cache.keys, cache.values, start)
        out = self._finish(hidden, attn_out, fused)
        return out, self.logits(out)

    def draft_step(self, prev_hidden: torch.Tensor, token: torch.Tensor, cache: DraftKVCache) -> tuple[torch.Tensor, torch.Tensor]:
        """TTT step k >= 1 of the round at t = cache.length - 1: prev_hidden [B, 1, H] (step k-1 output),
        token [B, 1] (the proposal of step k-1). Attends to all committed step-0 K/V and this round's
        diagonal K/V (steps 1..k); RoPE at t + k. Returns (pre-norm output [B, 1, H], logits [B, 1, Vd])."""
        step = len(cache.diag_keys) + 1
        position = torch.tensor([cache.length - 1 + step], device=prev_hidden.device)
        fused = _FusedWeights(self.midlayer)
        query, key, value = self._qkv(self._embed(token), prev_hidden, position, fused)
        cache.diag_keys.append(key)
        cache.diag_values.append(value)
        keys = torch.cat([cache.keys, *cache.diag_keys], dim=2)
        values = torch.cat([cache.values, *cache.diag_values], dim=2)
        attn_out = _attend_prefix(query, keys, values, keys.shape[2] - 1)
        out = self._finish(prev_hidden, attn_out, fused)
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
