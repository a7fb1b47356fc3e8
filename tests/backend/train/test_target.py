"""Target side: aux capture (+1 rule), teacher logits, KV-cached greedy generation, profile checks, offline extraction."""

import io
import json

import pytest
import torch
from safetensors import safe_open

from backend.profiles import parse_profile
from backend.train.data import Sample
from backend.train.extract import ExtractError, ProgressBar, bytes_per_token, extract
from backend.train.target import TargetMismatchError, TargetModel, check_aux_layer_ids, hf_layer_index, load_target
from tests.fixtures.env import mini_profile_dict


@pytest.fixture(scope="module")
def mini_target(mini_profile):
    return load_target(mini_profile)


def random_ids(batch, seq, seed=0):
    return torch.randint(0, 256, (batch, seq), generator=torch.Generator().manual_seed(seed))


def test_output_of_layer_id_is_hf_hidden_states_plus_one(mini_target):
    assert hf_layer_index(1) == 2
    ids = random_ids(2, 20)
    with torch.no_grad():
        reference = mini_target.model(input_ids=ids, output_hidden_states=True)
    result = mini_target.capture(ids)
    expected = torch.cat([reference.hidden_states[layer + 1] for layer in mini_target.aux_layer_ids], dim=-1)
    assert result.aux_hidden.shape == (2, 20, 3 * 32)
    assert torch.equal(result.aux_hidden, expected)
    assert torch.allclose(result.logits, reference.logits, atol=1e-6)


def test_last_hidden_through_lm_head_gives_the_logits(mini_target):
    ids = random_ids(1, 12, seed=1)
    with_logits = mini_target.capture(ids)
    hidden_only = mini_target.capture(ids, with_logits=False)
    assert hidden_only.logits is None and hidden_only.last_hidden.shape == (1, 12, 32)
    assert torch.allclose(mini_target.model.get_output_embeddings()(hidden_only.last_hidden), with_logits.logits, atol=1e-6)


def test_the_last_layer_cannot_be_an_aux_layer():
    check_aux_layer_ids([1, 3, 4], 8)
    with pytest.raises(TargetMismatchError, match=r"0\.\.6"):
        check_aux_layer_ids([1, 3, 7], 8)


def test_a_target_that_differs_from_its_profile_is_refused(mini_target_dir):
    raw = mini_profile_dict(mini_target_dir)
    raw["target"]["hidden_size"] = 64
    raw["draft"]["hidden_size"] = 64
    profile = parse_profile(raw, "wrong-hidden")
    with pytest.raises(TargetMismatchError, match="hidden_size: profile says 64, the model has 32"):
        load_target(profile)


def naive_greedy(model, ids, steps):
    for _ in range(steps):
        with torch.no_grad():
            token = model(input_ids=ids).logits[:, -1].argmax(-1, keepdim=True)
        ids = torch.cat([ids, token], dim=1)
    return ids


def test_kv_cached_greedy_equals_recomputing_everything(mini_target):
    prompts = random_ids(3, 10, seed=2)
    generated = mini_target.greedy_generate(prompts, 8)
    assert torch.equal(generated, naive_greedy(mini_target.model, prompts, 8)[:, 10:])


def test_left_padded_prompts_continue_as_if_unpadded(mini_target):
    short = random_ids(1, 6, seed=3)
    long = random_ids(1, 10, seed=4)
    pad = mini_target.tokenizer.pad_token_id
    batch = torch.cat([torch.cat([torch.full((1, 4), pad), short], dim=1), long])
    mask = torch.cat([torch.cat([torch.zeros(1, 4), torch.ones(1, 6)], dim=1), torch.ones(1, 10)]).long()
    generated = mini_target.greedy_generate(batch, 6, prompt_mask=mask)
    assert torch.equal(generated[0], mini_target.greedy_generate(short, 6)[0])
    assert torch.equal(generated[1], mini_target.greedy_generate(long, 6)[0])


def samples(count, length, seed=0):
    ids = random_ids(count, length, seed)
    mask = torch.ones(count, length, dtype=torch.uint8)
    mask[:, : length // 2] = 0
    return [Sample(ids[i], mask[i]) for i in range(count)]


def test_extract_writes_per_sample_shards_that_match_the_online_capture(mini_target, tmp_path, capfd):
    splits = {"train": samples(5, 16), "val": samples(2, 12, seed=9)}
    out = extract(mini_target, splits, tmp_path / "shards", batch_size=2, shard_samples=2)
    err = capfd.readouterr().err
    assert err.index("extract: 7 samples") < err.index("extract [")  # the estimate comes before the work
    meta = json.loads((out / "meta.json").read_text())
    assert meta["aux_width"] == 96 and meta["store"] == "logits" and meta["aux_layer_ids"] == [0, 1, 2]
    assert meta["splits"]["train"]["samples"] == 5 and len(meta["splits"]["train"]["shards"]) == 3
    assert meta["splits"]["val"]["tokens"] == 24
    seen = []
    for shard in meta["splits"]["train"]["shards"]:
        with safe_open(str(out / "train" / shard["file"]), framework="pt") as handle:
            prefixes = sorted({key.split(".")[0] for key in handle.keys()})
            for prefix in prefixes:
                seen.append({key: handle.get_tensor(f"{prefix}.{key}") for key in ("input_ids", "loss_mask", "aux_hidden_states", "target_logits")})
    assert len(seen) == 5
    for stored in seen:
        online = mini_target.capture(stored["input_ids"][None])
        assert torch.allclose(stored["aux_hidden_states"], online.aux_hidden[0], atol=1e-5)
        assert torch.allclose(stored["target_logits"], online.logits[0], atol=1e-5)
    written = sum(p.stat().st_size for p in out.rglob("*.safetensors"))
    assert written <= meta["estimate_bytes"]
    with safe_open(str(out / "target_head.safetensors"), framework="pt") as handle:
        assert sorted(handle.keys()) == ["embed_tokens.weight", "lm_head.weight", "norm.weight"]
        assert torch.equal(handle.get_tensor("norm.weight"), mini_target.final_norm_weight().cpu())


def test_extract_refuses_when_the_shards_will_not_fit_and_writes_nothing(mini_target, tmp_path, capfd):
    out = tmp_path / "shards"
    with pytest.raises(ExtractError, match="not enough disk space.*Nothing was written"):
        extract(mini_target, {"train": samples(4, 16), "val": samples(1, 16)}, out, keep_free_bytes=1 << 60)
    assert not out.exists()
    assert "extract: 5 samples" in capfd.readouterr().err


def test_extract_refuses_a_non_empty_directory(mini_target, tmp_path):
    (tmp_path / "old.txt").write_text("keep me")
    with pytest.raises(ExtractError, match="not empty"):
        extract(mini_target, {"train": samples(2, 8), "val": samples(1, 8)}, tmp_path)
    assert (tmp_path / "old.txt").read_text() == "keep me"


def test_bytes_per_token_counts_aux_teacher_ids_and_mask():
    # Llama-3.1-8B, bf16, last hidden stored: 3*4096 + 4096 values of 2 bytes, + 8 + 1
    assert bytes_per_token(4096, 128256, 3, "bfloat16", "last_hidden") == (3 * 4096 + 4096) * 2 + 9
    assert bytes_per_token(128, 259, 3, "float32", "logits") == (384 + 259) * 4 + 9


def test_progress_bar_reports_on_stderr_like_streams():
    stream = io.StringIO()
    bar = ProgressBar("extract", 20, stream=stream)
    for _ in range(20):
        bar.update(1)
    lines = stream.getvalue().splitlines()
    assert lines[-1].startswith("extract [##############################] 20/20")
    assert len(lines) <= 11  # not a terminal: one line per 10 %


def test_one_aux_layer_capture_gives_one_layer_width(mini_profile):
    single = TargetModel(load_target(mini_profile).model, None, mini_profile, "x", aux_layer_ids=[2])
    assert single.capture(random_ids(1, 5)).aux_hidden.shape[-1] == 32
