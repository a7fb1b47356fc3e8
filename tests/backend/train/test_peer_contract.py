"""The contract benchmarks/peer_specforge_draft.py relies on, held in CI without SpecForge: our saved checkpoint is the
state dict SpecForge's LlamaForCausalLMEagle3 builds from our config.json, minus the embedding, by name, shape and dtype.

SpecForge cannot be installed in CI's fast suite, so its module layout is written out here from its source
(specforge/modeling/draft/llama3_eagle.py, the same at the 0.2.0 release and at v0.3.0, commit 2768619e):
LlamaForCausalLMEagle3.__init__ builds embed_tokens [V, H] (padding_idx = pad_token_id), midlayer = LlamaDecoderLayer
(self_attn q/k/v_proj Linear(2H -> heads*head_dim / kv_heads*head_dim, bias=False), o_proj Linear(heads*head_dim -> H),
mlp gate/up/down, hidden_norm, input_layernorm, post_attention_layernorm: RMSNorm weight [H]), fc Linear(3 x
target_hidden_size -> H, bias=False), fc_norm only when config.fc_norm, norm [H], lm_head Linear(H -> draft_vocab_size),
and the buffers t2d (bool [V]) and d2t (int64 [draft_vocab_size]); AutoDraftModel.from_config(..., torch_dtype) casts
the float tensors only. target = draft + d2t[draft] (its accuracy metric and SGLang's loader agree).
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from backend.profiles import load_profile
from backend.train.checkpoint import save_checkpoint
from backend.train.draft import DraftModelConfig, Eagle3Draft
from backend.train.vocab import build_vocab_mapping

# Config keys SpecForge's LlamaForCausalLMEagle3 / LlamaAttention / LlamaMLP read (with a default where it has one).
SPECFORGE_READS = (
    "architectures",
    "hidden_size",
    "num_attention_heads",
    "num_key_value_heads",
    "intermediate_size",
    "hidden_act",
    "rms_norm_eps",
    "max_position_embeddings",
    "vocab_size",
    "draft_vocab_size",
)
FLOAT_DTYPES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}


def specforge_state(hf: dict) -> dict[str, tuple[list[int], str]]:
    """name -> (shape, dtype) of LlamaForCausalLMEagle3(config).to(torch_dtype).state_dict(), from config.json alone."""
    hidden, heads = hf["hidden_size"], hf["num_attention_heads"]
    kv_heads = hf.get("num_key_value_heads") or heads
    head_dim = hf.get("head_dim") or hidden // heads
    inter, vocab, draft_vocab = hf["intermediate_size"], hf["vocab_size"], hf["draft_vocab_size"]
    target_hidden = hf.get("target_hidden_size", hidden)
    f = FLOAT_DTYPES[hf.get("torch_dtype") or hf.get("dtype")]
    state = {
        "embed_tokens.weight": ([vocab, hidden], f),
        "midlayer.self_attn.q_proj.weight": ([heads * head_dim, 2 * hidden], f),
        "midlayer.self_attn.k_proj.weight": ([kv_heads * head_dim, 2 * hidden], f),
        "midlayer.self_attn.v_proj.weight": ([kv_heads * head_dim, 2 * hidden], f),
        "midlayer.self_attn.o_proj.weight": ([hidden, heads * head_dim], f),
        "midlayer.mlp.gate_proj.weight": ([inter, hidden], f),
        "midlayer.mlp.up_proj.weight": ([inter, hidden], f),
        "midlayer.mlp.down_proj.weight": ([hidden, inter], f),
        "midlayer.hidden_norm.weight": ([hidden], f),
        "midlayer.input_layernorm.weight": ([hidden], f),
        "midlayer.post_attention_layernorm.weight": ([hidden], f),
        "fc.weight": ([hidden, 3 * target_hidden], f),
        "norm.weight": ([hidden], f),
        "lm_head.weight": ([draft_vocab, hidden], f),
        "t2d": ([vocab], "bool"),
        "d2t": ([draft_vocab], "int64"),
    }
    if hf.get("fc_norm"):
        state.update({f"fc_norm.{i}.weight": ([target_hidden], f) for i in range(3)})
    return state


def tiny_config(**changes) -> DraftModelConfig:
    config = DraftModelConfig.from_profile(load_profile("tiny"))
    return DraftModelConfig(**{**config.as_dict(), **changes})


CONFIGS = {
    "tiny": lambda: tiny_config(),
    "gqa_wide_heads_bf16": lambda: tiny_config(num_attention_heads=4, num_key_value_heads=2, head_dim=48, torch_dtype="bfloat16"),
    "wider_target_full_vocab": lambda: tiny_config(target_hidden_size=96, draft_vocab_size=259, intermediate_size=320),
}


def saved_checkpoint(tmp_path, config: DraftModelConfig):
    torch.manual_seed(0)
    draft = Eagle3Draft(config).to(getattr(torch, config.torch_dtype))
    draft.load_target_embedding(torch.randn(config.vocab_size, config.hidden_size))
    counts = torch.randint(0, 1000, (config.vocab_size,), generator=torch.Generator().manual_seed(1))
    draft.set_vocab_mapping(*build_vocab_mapping(counts, config.draft_vocab_size))
    path = save_checkpoint(tmp_path, draft, config, epoch=0, step=1, training_state=None)
    with safe_open(str(path / "model.safetensors"), framework="pt") as handle:
        tensors = {name: handle.get_tensor(name) for name in handle.keys()}
    return path, json.loads((path / "config.json").read_text()), tensors, draft


def contract_problems(hf: dict, tensors: dict[str, torch.Tensor]) -> list[str]:
    """What SpecForge's load_state_dict(strict=False) would report, or refuse, for these tensors under this config."""
    expected = specforge_state(hf)
    got = {key: (list(t.shape), str(t.dtype).replace("torch.", "")) for key, t in tensors.items()}
    problems = [f"missing {key}" for key in sorted(set(expected) - set(got) - {"embed_tokens.weight"})]
    problems += [f"unexpected {key}" for key in sorted(set(got) - set(expected))]
    problems += [f"{key}: ours {got[key]}, SpecForge builds {expected[key]}" for key in sorted(set(got) & set(expected)) if got[key] != expected[key]]
    return problems


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_checkpoint_is_specforges_state_dict_minus_the_embedding(tmp_path, name):
    _path, hf, tensors, _draft = saved_checkpoint(tmp_path, CONFIGS[name]())
    assert "embed_tokens.weight" not in tensors  # the one key SpecForge's loader misses: serving takes the target's
    assert contract_problems(hf, tensors) == []


def test_the_contract_names_a_renamed_reshaped_or_retyped_tensor(tmp_path):
    _path, hf, tensors, _draft = saved_checkpoint(tmp_path, CONFIGS["tiny"]())
    tensors["layers.0.hidden_norm.weight"] = tensors.pop("midlayer.hidden_norm.weight")
    tensors["fc.weight"] = tensors["fc.weight"][:, : hf["target_hidden_size"]]  # one layer's width
    tensors["d2t"] = tensors["d2t"].to(torch.int32)
    assert contract_problems(hf, tensors) == [
        "missing midlayer.hidden_norm.weight",
        "unexpected layers.0.hidden_norm.weight",
        "d2t: ours ([192], 'int32'), SpecForge builds ([192], 'int64')",
        "fc.weight: ours ([128, 128], 'float32'), SpecForge builds ([128, 384], 'float32')",
    ]


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_config_json_carries_what_specforge_reads(tmp_path, name):
    _path, hf, _tensors, _draft = saved_checkpoint(tmp_path, CONFIGS[name]())
    missing = [key for key in SPECFORGE_READS if hf.get(key) is None]
    assert missing == []
    assert hf["architectures"] == ["LlamaForCausalLMEagle3"]  # what its DRAFT_REGISTRY resolves
    assert hf["hidden_act"] == "silu" and not hf.get("fc_norm") and hf.get("norm_output", True) is True
    assert hf.get("pad_token_id") is None or 0 <= hf["pad_token_id"] < hf["vocab_size"]  # nn.Embedding's padding_idx


def test_d2t_and_t2d_mean_what_specforge_computes_with_them(tmp_path):
    _path, hf, tensors, draft = saved_checkpoint(tmp_path, CONFIGS["tiny"]())
    d2t, t2d = tensors["d2t"], tensors["t2d"]
    draft_ids = torch.arange(hf["draft_vocab_size"])
    target_ids = draft_ids + d2t[draft_ids]  # SpecForge: pred_draft_token_ids + d2t[pred_draft_token_ids]
    assert torch.equal(target_ids, draft.draft_to_target_ids(draft_ids))
    assert torch.equal(target_ids, t2d.nonzero().flatten())  # t2d marks exactly those, in draft-id order
    assert int(t2d.sum()) == hf["draft_vocab_size"]
