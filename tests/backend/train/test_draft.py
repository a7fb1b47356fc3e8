"""The EAGLE-3 draft: config mapping, width refusal, TTT semantics, attention backends, incremental decoding."""

import ast
import sys

import pytest
import torch

from backend.profiles import load_profile
from backend.train.draft import DraftKVCache, DraftModelConfig, Eagle3Draft, FeatureWidthError
from backend.train.vocab import build_vocab_mapping
from tests.fixtures.env import ROOT

BENCHMARKS = ROOT / "benchmarks"


def bench_attention():
    """benchmarks/bench_attention.py, where the backend comparison and the timing CLI live."""
    sys.path.insert(0, str(BENCHMARKS))
    try:
        import bench_attention
    finally:
        sys.path.remove(str(BENCHMARKS))
    return bench_attention


pytestmark = pytest.mark.usefixtures("limited_torch_threads")


def small_config(**overrides) -> DraftModelConfig:
    values = dict(
        hidden_size=32,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=64,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        max_position_embeddings=256,
        vocab_size=40,
        draft_vocab_size=24,
        target_hidden_size=32,
        aux_layer_ids=[1, 2, 4],
        torch_dtype="float32",
        ttt_length=4,
    )
    values.update(overrides)
    return DraftModelConfig(**values)


def make_draft(config: DraftModelConfig, seed: int = 0, backend: str | None = "eager") -> Eagle3Draft:
    torch.manual_seed(seed)
    draft = Eagle3Draft(config, attn_backend=backend, init_std=0.2)
    draft.load_target_embedding(torch.randn(config.vocab_size, config.hidden_size))
    for norm in (draft.norm, draft.midlayer.input_layernorm, draft.midlayer.hidden_norm, draft.midlayer.post_attention_layernorm):
        norm.weight.data.uniform_(0.5, 1.5)
    return draft


def random_batch(config: DraftModelConfig, batch=2, seq=12, seed=1):
    generator = torch.Generator().manual_seed(seed)
    aux = torch.randn(batch, seq, config.aux_width, generator=generator)
    ids = torch.randint(0, config.vocab_size, (batch, seq), generator=generator)
    return aux, ids


def test_tiny_profile_config_maps_to_sglang_config_and_back():
    config = DraftModelConfig.from_profile(load_profile("tiny"))
    assert (config.hidden_size, config.target_hidden_size, config.aux_layer_ids) == (128, 128, [1, 3, 4])
    assert (config.vocab_size, config.draft_vocab_size, config.head_dim, config.ttt_length) == (259, 192, 32, 7)
    hf = config.to_hf_config({"val_acc": [0.8, 0.79], "val_acc_step": 300})
    assert hf["architectures"] == ["LlamaForCausalLMEagle3"]
    assert hf["model_type"] == "llama" and hf["num_hidden_layers"] == 1 and hf["tie_word_embeddings"] is False
    assert hf["draft_vocab_size"] == 192 and hf["target_hidden_size"] == 128
    assert hf["eagle_config"] == {"eagle_aux_hidden_state_layer_ids": [1, 3, 4], "use_aux_hidden_state": True}
    block = hf["eagle3_console"]
    assert block["trained_aux_width"] == 384 and block["trained_aux_layer_ids"] == [1, 3, 4]
    assert block["ttt_length"] == 7 and block["val_acc"] == [0.8, 0.79] and block["val_acc_step"] == 300
    assert DraftModelConfig.from_hf_config(hf) == config


def test_from_hf_config_names_missing_fields():
    hf = small_config().to_hf_config()
    hf["draft_vocab_size"] = None
    del hf["hidden_size"]
    with pytest.raises(ValueError, match="hidden_size, draft_vocab_size"):
        DraftModelConfig.from_hf_config(hf)


def test_one_layer_hidden_state_is_refused_naming_both_widths():
    config = DraftModelConfig.from_profile(load_profile("tiny"))
    draft = Eagle3Draft(config)
    draft.load_target_embedding(torch.randn(259, 128))
    one_layer = torch.randn(1, 5, 128)
    with pytest.raises(FeatureWidthError) as info:
        draft.ttt_forward(one_layer, torch.zeros(1, 5, dtype=torch.long), ttt_length=2)
    message = str(info.value)
    assert "384" in message and "3 layers x target hidden 128" in message and "got 128" in message
    assert "one layer's hidden state instead of three concatenated" in message and "nothing was computed" in message
    with pytest.raises(FeatureWidthError, match="width 384 .* got 256"):
        draft.project(torch.randn(1, 5, 256))


def test_sglang_width_check_silently_skips_fc_for_one_layer():
    """What llama_eagle3.py does: a width-H feature bypasses fc; the strict path refuses it."""
    config = small_config()
    draft = make_draft(config)
    final_hidden = torch.randn(1, 3, config.hidden_size)
    assert torch.equal(draft.input_hidden(final_hidden, sglang_width_check=True), final_hidden)
    with pytest.raises(FeatureWidthError):
        draft.input_hidden(final_hidden)


def test_forward_needs_the_target_embedding():
    config = small_config()
    draft = Eagle3Draft(config)
    aux, ids = random_batch(config)
    with pytest.raises(RuntimeError, match="load_target_embedding"):
        draft.ttt_forward(aux, ids, ttt_length=2)
    with pytest.raises(ValueError, match=r"\(41, 32\).*\(40, 32\)"):
        draft.load_target_embedding(torch.zeros(41, 32))


def test_ttt_step_k_sees_only_tokens_up_to_t_plus_1_plus_k_and_aux_up_to_t():
    config = small_config()
    draft = make_draft(config).eval()
    aux, ids = random_batch(config, batch=1, seq=10)
    t = 4
    with torch.no_grad():
        base = draft.ttt_forward(aux, ids, ttt_length=4)
        for step in range(4):
            later_ids = ids.clone()
            later_ids[0, t + 2 + step :] = (later_ids[0, t + 2 + step :] + 7) % config.vocab_size
            later_aux = aux.clone()
            later_aux[0, t + 1 :] += 3.0
            changed = draft.ttt_forward(later_aux, later_ids, ttt_length=4)
            assert torch.allclose(changed[step][0, t], base[step][0, t], atol=1e-5), f"step {step} saw the future"
            if t + 1 + step < 10:
                token_changed = ids.clone()
                token_changed[0, t + 1 + step] = (token_changed[0, t + 1 + step] + 1) % config.vocab_size
                moved = draft.ttt_forward(aux, token_changed, ttt_length=4)
                assert not torch.allclose(moved[step][0, t], base[step][0, t]), f"step {step} ignored token t+1+k"


def test_ttt_step_k_attends_to_its_own_earlier_steps_at_the_same_position():
    """Perturbing step 1's input at t changes step 2's output at t only (the diagonal key), not at t+1."""
    config = small_config()
    draft = make_draft(config).eval()
    aux, ids = random_batch(config, batch=1, seq=8)
    with torch.no_grad():
        base = draft.ttt_forward(aux, ids, ttt_length=3)
        changed_ids = ids.clone()
        changed_ids[0, 5] = (changed_ids[0, 5] + 3) % config.vocab_size  # token x_{t+1+k} for (t=3, k=1), (t=4, k=0)
        changed = draft.ttt_forward(aux, changed_ids, ttt_length=3)
    # step 2 at t=3 reads x_6, x_5 enters through step 1 at t=3 (diagonal) -> changes
    assert not torch.allclose(changed[2][0, 3], base[2][0, 3])
    # step 1 at t=2 reads x_4 and its diagonal chain at t=2 reads x_3, x_4: x_5 only reaches it through step-0
    # keys at positions >= 4, which are in its future -> unchanged
    assert torch.allclose(changed[1][0, 2], base[1][0, 2], atol=1e-5)


@pytest.mark.parametrize("backend", ["sdpa"])
def test_backends_match_eager_outputs_and_gradients_through_the_model(backend):
    config = small_config()
    aux, ids = random_batch(config)
    results = {}
    for name in ("eager", backend):
        draft = make_draft(config, backend=name)
        logits = draft.ttt_forward(aux, ids, ttt_length=4)
        loss = sum((step_logits.float() ** 2).mean() * 0.8**k for k, step_logits in enumerate(logits))
        loss.backward()
        grads = {n: p.grad.clone() for n, p in draft.named_parameters() if p.grad is not None}
        results[name] = (logits, grads)
    (ref_logits, ref_grads), (logits, grads) = results["eager"], results[backend]
    for ref, got in zip(ref_logits, logits):
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-4)
    assert set(grads) == set(ref_grads) and "fc.weight" in grads and "embed_tokens.weight" not in grads
    for name in ref_grads:
        torch.testing.assert_close(grads[name], ref_grads[name], atol=1e-5, rtol=1e-4, msg=name)


def test_flex_forward_matches_eager_on_cpu():
    config = small_config()
    aux, ids = random_batch(config)
    with torch.no_grad():
        ref = make_draft(config, backend="eager").ttt_forward(aux, ids, ttt_length=4)
        got = make_draft(config, backend="flex").ttt_forward(aux, ids, ttt_length=4)
    for ref_step, got_step in zip(ref, got):
        torch.testing.assert_close(got_step, ref_step, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("backend", ["sdpa", "flex"])
def test_attention_kernels_match_eager(backend):
    shape = dict(batch=2, heads=4, kv_heads=2, seq=40, dim=16, steps=3)
    result = bench_attention().compare_backends(backend, shape=shape, device="cpu", dtype=torch.float32, backward=backend != "flex")
    assert result["out_max_abs_diff"] < 1e-5
    if backend != "flex":
        assert result["grad_max_abs_diff"] < 1e-5


def test_attention_benchmark_small_checks_run_on_cpu(capsys):
    """`benchmarks/bench_attention.py --device cpu --small`: every backend against eager, alone and through the draft."""
    assert bench_attention().main(["--device", "cpu", "--small"]) == 0
    rows = [ast.literal_eval(line) for line in capsys.readouterr().out.splitlines()]  # the CLI prints one dict per line
    assert [row["backend"] for row in rows] == ["sdpa", "flex", "sdpa", "flex"]
    assert all(row.get("out_max_abs_diff", 0) < 1e-5 and row.get("logits_max_abs_diff", 0) < 1e-4 for row in rows)


def test_loss_positions_select_rows_per_step():
    config = small_config()
    draft = make_draft(config).eval()
    aux, ids = random_batch(config)
    mask = torch.rand(ids.shape, generator=torch.Generator().manual_seed(3)) > 0.5
    with torch.no_grad():
        full = draft.ttt_forward(aux, ids, ttt_length=2)
        picked = draft.ttt_forward(aux, ids, ttt_length=2, loss_positions=mask)
        per_step = draft.ttt_forward(aux, ids, ttt_length=2, loss_positions=[mask, ~mask])
    torch.testing.assert_close(picked[1], full[1][mask])
    torch.testing.assert_close(per_step[1], full[1][~mask])


def test_incremental_decoding_reproduces_ttt_logits():
    """extend (step 0 over committed positions, in two chunks) + draft_step == ttt_forward at the last position."""
    config = small_config()
    draft = make_draft(config).eval()
    aux, ids = random_batch(config, batch=1, seq=14)
    t = 8
    with torch.no_grad():
        ttt = draft.ttt_forward(aux, ids, ttt_length=4)
        cache = DraftKVCache()
        draft.extend(draft.project(aux[:, :5]), ids[:, 1:6], cache)
        hidden, logits = draft.extend(draft.project(aux[:, 5 : t + 1]), ids[:, 6 : t + 2], cache)
        torch.testing.assert_close(logits[:, -1], ttt[0][:, t], atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(logits[:, 0], ttt[0][:, 5], atol=1e-5, rtol=1e-4)
        hidden = hidden[:, -1:]
        for step in range(1, 4):
            hidden, logits = draft.draft_step(hidden, ids[:, t + 1 + step : t + 2 + step], cache)
            torch.testing.assert_close(logits[:, 0], ttt[step][:, t], atol=1e-5, rtol=1e-4)
        assert cache.length == t + 1 and len(cache.diag_keys) == 3


def test_vocab_mapping_from_counts_and_its_checks():
    counts = torch.tensor([5, 0, 9, 9, 1, 0, 3, 0])
    d2t, t2d = build_vocab_mapping(counts, 5)
    assert t2d.tolist() == [True, False, True, True, True, False, True, False]
    assert (d2t + torch.arange(5)).tolist() == [0, 2, 3, 4, 6] and d2t.dtype == torch.int64
    config = small_config(vocab_size=8, draft_vocab_size=5)
    draft = Eagle3Draft(config)
    draft.set_vocab_mapping(d2t, t2d)
    assert draft.draft_to_target_ids(torch.tensor([0, 1, 4])).tolist() == [0, 2, 6]
    with pytest.raises(ValueError, match="offsets, not absolute"):
        draft.set_vocab_mapping(d2t + torch.arange(5) + 3, t2d)
    with pytest.raises(ValueError, match="disagree"):
        draft.set_vocab_mapping(d2t, torch.roll(t2d, 1))
    assert draft.d2t.tolist() == d2t.tolist()  # a refused mapping leaves the installed one


def test_a_draft_head_from_the_target_scores_draft_ids_as_the_target_scores_their_ids():
    counts = torch.tensor([5, 0, 9, 9, 1, 0, 3, 0])
    config = small_config(vocab_size=8, draft_vocab_size=5)
    draft = Eagle3Draft(config)
    draft.set_vocab_mapping(*build_vocab_mapping(counts, 5))
    target_head, target_norm = torch.randn(8, config.hidden_size), torch.rand(config.hidden_size) + 0.5
    draft.load_target_head(target_head, target_norm)
    hidden = torch.randn(3, config.hidden_size)
    normed = hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + config.rms_norm_eps) * target_norm
    target_logits = normed @ target_head.T
    draft_logits = draft.logits(hidden)
    torch.testing.assert_close(draft_logits, target_logits[:, [0, 2, 3, 4, 6]])
    assert draft.lm_head.weight.requires_grad and draft.norm.weight.requires_grad

    before = draft.lm_head.weight.detach().clone()
    with pytest.raises(ValueError, match=r"target lm_head has shape \(8, 16\).*left as initialised"):
        draft.load_target_head(torch.randn(8, 16), None)
    with pytest.raises(ValueError, match="final norm"):
        draft.load_target_head(target_head, torch.ones(16))
    assert torch.equal(draft.lm_head.weight, before)


def test_bf16_autocast_forward_and_backward_run_and_track_fp32():
    """The trainer runs ttt_forward under bf16 autocast with fp32 weights."""
    config = small_config()
    aux, ids = random_batch(config)
    draft = make_draft(config, backend="sdpa")
    with torch.no_grad():
        reference = draft.ttt_forward(aux, ids, ttt_length=3)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = draft.ttt_forward(aux, ids, ttt_length=3, loss_positions=[ids > 5] * 3)
    assert logits[0].dtype == torch.bfloat16 and logits[2].shape == (int((ids > 5).sum()), config.draft_vocab_size)
    sum(step.float().logsumexp(-1).mean() for step in logits).backward()
    assert draft.midlayer.self_attn.q_proj.weight.grad.dtype == torch.float32
    scale = reference[2].abs().max()
    assert (logits[2].float() - reference[2][ids > 5]).abs().max() < 0.05 * scale


@pytest.mark.parametrize("backend", ["eager", "sdpa"])
def test_ttt_hidden_is_ttt_forward_without_the_lm_head(backend):
    """The trainer's path (ttt_hidden, then lm_head inside the fused loss) computes the same logits as ttt_forward."""
    config = small_config()
    draft = make_draft(config, backend=backend)
    aux, ids = random_batch(config)
    with torch.no_grad():
        logits = draft.ttt_forward(aux, ids, ttt_length=4)
        states = draft.ttt_hidden(aux, ids, ttt_length=4)
    assert states.shape == (4, 2, 12, config.hidden_size)
    for step, step_logits in enumerate(logits):
        assert torch.allclose(draft.lm_head(states[step]), step_logits, rtol=1e-5, atol=1e-6)


# --- the layer owns its forward: the model's outputs are bit for bit what the model computed before -----------------


def _old_rms(hidden, norm):
    dtype = hidden.dtype
    hidden = hidden.float()
    return norm.weight * (hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + norm.eps)).to(dtype)


def _old_rotate(tensor):
    first, second = tensor.chunk(2, dim=-1)
    return torch.cat([-second, first], dim=-1)


def old_layer_step(draft, embeds, hidden, positions, attend):
    """One step as Eagle3Draft computed it when the layer only held parameters (its _qkv and _finish): q|k|v and
    gate|up fused and cast once to the autocast dtype, RoPE in the query's dtype, a pre-norm output state."""
    layer, config = draft.midlayer, draft.config
    attn, mlp = layer.self_attn, layer.mlp
    device = attn.q_proj.weight.device.type
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else attn.q_proj.weight.dtype
    qkv = torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight], dim=0).to(dtype)
    gate_up = torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight], dim=0).to(dtype)
    batch, seq, _ = hidden.shape
    heads, kv_heads, dim = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    joined = torch.cat([_old_rms(embeds, layer.input_layernorm), _old_rms(hidden, layer.hidden_norm)], dim=-1)
    query, key, value = torch.nn.functional.linear(joined, qkv).split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    query = query.view(batch, seq, heads, dim).transpose(1, 2)
    key = key.view(batch, seq, kv_heads, dim).transpose(1, 2)
    value = value.view(batch, seq, kv_heads, dim).transpose(1, 2)
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    angles = positions.float()[:, None] * inv_freq[None, :]
    angles = torch.cat([angles, angles], dim=-1)
    cos, sin = angles.cos().to(query.dtype), angles.sin().to(query.dtype)
    query = query * cos + _old_rotate(query) * sin
    key = key * cos + _old_rotate(key) * sin
    out = attend(query, key, value).transpose(1, 2).reshape(batch, seq, -1)
    hidden = hidden + attn.o_proj(out)
    gate, up = torch.nn.functional.linear(_old_rms(hidden, layer.post_attention_layernorm), gate_up).chunk(2, dim=-1)
    return hidden + mlp.down_proj(torch.nn.functional.silu(gate) * up)


def old_ttt_states(draft, aux, ids, ttt_length):
    """Pre-norm output state of each TTT step, the old loop: step-0 K/V causal plus the diagonal K/V of steps 1..k."""
    from backend.train.attention import ttt_attention

    seq = ids.shape[1]
    hidden = draft.fc(aux)
    padded = torch.nn.functional.pad(ids, (0, ttt_length), value=0)
    kv = {"key0": None, "value0": None, "keys": [], "values": []}

    def attend(query, key, value):
        if kv["key0"] is None:
            kv["key0"], kv["value0"] = key, value
        else:
            kv["keys"].append(key)
            kv["values"].append(value)
        return ttt_attention(query, kv["key0"], kv["value0"], kv["keys"], kv["values"], draft.attn_backend)

    states = []
    for step in range(ttt_length):
        embeds = draft.embed_tokens(padded[:, 1 + step : 1 + step + seq])
        hidden = old_layer_step(draft, embeds, hidden, torch.arange(seq) + step, attend)
        states.append(hidden)
    return states


def old_prefix_attention(query, keys, values, first_query_pos):
    groups = query.shape[1] // keys.shape[1]
    keys, values = keys.repeat_interleave(groups, dim=1), values.repeat_interleave(groups, dim=1)
    scores = query @ keys.transpose(-1, -2) / (query.shape[-1] ** 0.5)
    query_pos = torch.arange(query.shape[2])[:, None] + first_query_pos
    scores = scores.masked_fill(torch.arange(keys.shape[2])[None, :] > query_pos, float("-inf"))
    return torch.softmax(scores.float(), dim=-1).to(query.dtype) @ values


@pytest.mark.parametrize("backend", ["eager", "sdpa"])
@pytest.mark.parametrize("autocast", [False, True])
def test_ttt_logits_and_states_are_bit_identical_to_the_old_model_math(backend, autocast):
    config = small_config()
    draft = make_draft(config, backend=backend)
    aux, ids = random_batch(config)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        old_states = old_ttt_states(draft, aux, ids, 4)
        logits = draft.ttt_forward(aux, ids, ttt_length=4)
        states = draft.ttt_hidden(aux, ids, ttt_length=4)
        old_logits = [draft.lm_head(_old_rms(state, draft.norm)) for state in old_states]
        old_normed = [_old_rms(state, draft.norm) for state in old_states]
    assert logits[0].dtype == (torch.bfloat16 if autocast else torch.float32)
    for step in range(4):
        assert torch.equal(logits[step], old_logits[step]), f"step {step} logits moved"
        assert torch.equal(states[step], old_normed[step]), f"step {step} normed state moved"


def test_decoding_logits_are_bit_identical_to_the_old_model_math():
    config = small_config()
    draft = make_draft(config).eval()
    aux, ids = random_batch(config, batch=1, seq=14)
    t = 8
    with torch.no_grad():
        cache = DraftKVCache()
        hidden, logits = draft.extend(draft.project(aux[:, : t + 1]), ids[:, 1 : t + 2], cache)
        new = [logits]
        hidden = hidden[:, -1:]
        for step in range(1, 4):
            hidden, logits = draft.draft_step(hidden, ids[:, t + 1 + step : t + 2 + step], cache)
            new.append(logits)

        committed = {}

        def commit(query, key, value):
            committed["keys"], committed["values"], committed["diag"] = key, value, []
            return old_prefix_attention(query, key, value, 0)

        def step_attend(query, key, value):
            committed["diag"].append((key, value))
            keys = torch.cat([committed["keys"], *(k for k, _ in committed["diag"])], dim=2)
            values = torch.cat([committed["values"], *(v for _, v in committed["diag"])], dim=2)
            return old_prefix_attention(query, keys, values, keys.shape[2] - 1)

        hidden = old_layer_step(draft, draft.embed_tokens(ids[:, 1 : t + 2]), draft.project(aux[:, : t + 1]), torch.arange(t + 1), commit)
        old = [draft.lm_head(_old_rms(hidden, draft.norm))]
        hidden = hidden[:, -1:]
        for step in range(1, 4):
            hidden = old_layer_step(draft, draft.embed_tokens(ids[:, t + 1 + step : t + 2 + step]), hidden, torch.tensor([t + step]), step_attend)
            old.append(draft.lm_head(_old_rms(hidden, draft.norm)))
    for step, (got, want) in enumerate(zip(new, old)):
        assert torch.equal(got, want), f"decoding step {step} logits moved"
    with pytest.raises(RuntimeError, match="before extend"):
        draft.draft_step(hidden, ids[:, :1], DraftKVCache())


def test_checkpoint_keys_are_sglang_s_midlayer_names():
    """Moving the forward into the layer kept every parameter and buffer name and shape a checkpoint holds."""
    keys = {name: tuple(tensor.shape) for name, tensor in make_draft(small_config()).state_dict().items()}
    assert keys == {
        "embed_tokens.weight": (40, 32),
        "fc.weight": (32, 96),
        "lm_head.weight": (24, 32),
        "norm.weight": (32,),
        "d2t": (24,),
        "t2d": (40,),
        "midlayer.self_attn.q_proj.weight": (64, 64),
        "midlayer.self_attn.k_proj.weight": (32, 64),
        "midlayer.self_attn.v_proj.weight": (32, 64),
        "midlayer.self_attn.o_proj.weight": (32, 64),
        "midlayer.mlp.gate_proj.weight": (64, 32),
        "midlayer.mlp.up_proj.weight": (64, 32),
        "midlayer.mlp.down_proj.weight": (32, 64),
        "midlayer.input_layernorm.weight": (32,),
        "midlayer.hidden_norm.weight": (32,),
        "midlayer.post_attention_layernorm.weight": (32,),
    }


@pytest.mark.slow
def test_compiled_layer_regions_compile_two_graphs_for_any_number_of_lengths():
    """Bucketed real data brings ~11 sequence lengths: the compiled regions (the training path on CUDA, here on the CPU
    backend) stop compiling after the second length and give the eager layer's states at every length."""
    from torch._dynamo.utils import counters

    from tests.fixtures.drafts import HIDDEN, draft_config

    torch.manual_seed(0)
    draft = Eagle3Draft(draft_config(), init_std=0.02)
    draft.load_target_embedding(torch.randn(draft_config().vocab_size, HIDDEN) * 0.02)
    draft.set_attention_backend("sdpa")
    width = draft.fc.weight.shape[1]
    graphs = []
    for seq in (16, 24, 32, 48, 64):
        aux, ids = torch.randn(2, seq, width), torch.randint(0, 200, (2, seq))
        compiled = list(draft._ttt_steps(aux, ids, 2, 0, compile_regions=True))
        sum(h.float().pow(2).mean() for h in compiled).backward()
        graphs.append(counters["stats"]["unique_graphs"])
        with torch.no_grad():
            eager = list(draft._ttt_steps(aux, ids, 2, 0))
        assert all(torch.allclose(a.detach(), b, atol=1e-5, rtol=1e-4) for a, b in zip(compiled, eager))
    assert graphs[1:] == [graphs[1]] * 4  # the lengths after the second compile nothing (static shapes: each did)
