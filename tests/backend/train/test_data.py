"""Draft training data: target-generated tiny samples, chat templates with assistant masks, offline shards, rank sharding."""

import fcntl
import threading
import time
from pathlib import Path

import pytest
import torch

from backend.train.data import (
    bucket_length,
    BatchSampler,
    DataError,
    OfflineSource,
    OnlineSource,
    Sample,
    TinyDataSettings,
    add_train_samples,
    collate,
    conversation_samples,
    eval_batches,
    first_prompt,
    read_conversations,
    tiny_data_cache_path,
    tiny_samples,
    tokenize_conversation,
)
from backend.train.extract import extract
from backend.train.target import load_target
from backend.train.tiny import read_corpus
from tests.fixtures.chat import chat_tokenizer
from tests.fixtures.chat import write_jsonl


@pytest.fixture(scope="module")
def mini_target(mini_profile):
    return load_target(mini_profile)


def test_collate_right_pads_and_masks():
    batch = collate([Sample(torch.tensor([1, 2, 3]), torch.tensor([0, 1, 1])), Sample(torch.tensor([4]), torch.tensor([1]))], pad_id=9)
    assert batch["input_ids"].tolist() == [[1, 2, 3], [4, 9, 9]]
    assert batch["loss_mask"].tolist() == [[0, 1, 1], [1, 0, 0]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]


def test_batches_are_padded_to_a_short_ladder_of_lengths_and_count_real_tokens():
    """Real conversations have every length up to seq_len; compiled training sees at most ~2 lengths per octave."""
    lengths = {bucket_length(n) for n in range(1, 2049)}
    assert lengths == {1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048}
    assert all(n <= bucket_length(n) <= max(2, 1.5 * n) for n in range(1, 5000))
    assert bucket_length(700, cap=720) == 720 and bucket_length(1000, cap=900) == 1000  # the cap never cuts a sample
    batch = collate([Sample(torch.arange(5), torch.ones(5)), Sample(torch.arange(2), torch.ones(2))], pad_id=0)
    assert batch["input_ids"].shape == (2, 6) and batch["tokens"] == 7 and batch["loss_mask"][:, 5].sum() == 0
    assert collate([Sample(torch.arange(5), torch.ones(5))], pad_id=0, bucket=False)["input_ids"].shape == (1, 5)


def test_ranks_take_disjoint_slices_of_every_global_batch():
    samplers = [BatchSampler(50, batch_size=4, seed=1, rank=r, world_size=3) for r in range(3)]
    assert samplers[0].batches_per_epoch == 4
    epoch = [[s.next() for _ in range(4)] for s in samplers]
    flat = [i for rank in epoch for batch in rank for i in batch]
    assert len(flat) == len(set(flat)) == 48
    assert samplers[0].epoch_progress == 1.0
    nxt = samplers[0].next()  # epoch 1: a new shuffle
    assert samplers[0].epoch == 1 and nxt != epoch[0][0]


def test_sampler_state_resumes_the_same_sequence():
    sampler = BatchSampler(40, batch_size=3, seed=7)
    for _ in range(17):
        sampler.next()
    state = sampler.state_dict()
    expected = [sampler.next() for _ in range(10)]
    resumed = BatchSampler(40, batch_size=3, seed=7)
    resumed.load_state_dict(state)
    assert [resumed.next() for _ in range(10)] == expected
    other = BatchSampler(41, batch_size=3, seed=7)
    other.load_state_dict(state)  # different data: same epoch, fresh start within it
    assert (other.epoch, other.cursor) == (state["epoch"], 0)


def padded_tokens(batches, lengths):
    return sum(len(batch) * max(lengths[i] for i in batch) for batch in batches)


def test_grouped_batches_hold_similar_lengths_and_each_sample_once_an_epoch():
    lengths = [40 + (i * 7919) % 900 if i % 3 else 30 + i % 50 for i in range(1000)]  # short regenerated answers beside long chats
    plain = BatchSampler(1000, batch_size=8, seed=3)
    grouped = BatchSampler(1000, batch_size=8, seed=3, lengths=lengths)
    assert grouped.batches_per_epoch == 125
    for epoch in range(2):
        batches = [grouped.next() for _ in range(125)]
        flat = [i for batch in batches for i in batch]
        assert len(flat) == len(set(flat)) == 1000, f"epoch {epoch}: every sample once"
        plain_batches = [plain.next() for _ in range(125)]
        assert padded_tokens(batches, lengths) < 0.6 * padded_tokens(plain_batches, lengths)
    spread = [max(lengths[i] for i in b) - min(lengths[i] for i in b) for b in batches]
    assert sorted(spread)[len(spread) // 2] < 40  # the median batch spans a narrow band of lengths
    assert [len(b) for b in batches] == [8] * 125
    firsts = [batch[0] for batch in batches[:10]]
    assert firsts != sorted(firsts, key=lengths.__getitem__), "batches are shuffled, not served shortest first"


def test_grouped_sampler_resumes_and_ranks_share_each_global_batch():
    lengths = [(i * 37) % 101 + 1 for i in range(90)]
    sampler = BatchSampler(90, batch_size=4, seed=5, lengths=lengths)
    for _ in range(30):
        sampler.next()
    state = sampler.state_dict()
    expected = [sampler.next() for _ in range(12)]
    resumed = BatchSampler(90, batch_size=4, seed=5, lengths=lengths)
    resumed.load_state_dict(state)
    assert [resumed.next() for _ in range(12)] == expected
    ungrouped = BatchSampler(90, batch_size=4, seed=5)
    ungrouped.load_state_dict(state)  # another order than the checkpoint's: its epoch, from the start
    assert (ungrouped.epoch, ungrouped.cursor) == (state["epoch"], 0)
    ranks = [BatchSampler(90, batch_size=3, seed=1, rank=r, world_size=2, lengths=lengths) for r in range(2)]
    pairs = [[s.next() for s in ranks] for _ in range(15)]
    assert len({i for pair in pairs for batch in pair for i in batch}) == 90
    with pytest.raises(ValueError, match="89 lengths for 90 samples"):
        BatchSampler(90, batch_size=4, lengths=lengths[:89])


def test_sampler_refuses_data_smaller_than_one_global_batch():
    with pytest.raises(DataError, match="cannot fill one global batch"):
        BatchSampler(7, batch_size=4, world_size=2)


def test_eval_batches_split_the_validation_set_between_ranks():
    shares = [eval_batches(10, 3, rank=r, world_size=2) for r in range(2)]
    assert sorted(i for share in shares for batch in share for i in batch) == list(range(10))
    assert eval_batches(10, 3, limit=4) == [[0, 1, 2], [3]]


def test_tiny_samples_are_corpus_prompts_plus_greedy_continuations(mini_target, mini_env):
    settings = TinyDataSettings(prompt_len=16, total_len=40, train_samples=12, val_samples=4)
    before = set(mini_env.glob("tiny-data-*.safetensors"))
    messages = []
    splits = tiny_samples(mini_target, settings, log=messages.append)
    assert len(splits["train"]) == 12 and len(splits["val"]) == 4
    bars = [m for m in messages if m.startswith("tiny data [")]  # the job log's (and the Logs screen's) progress bar
    assert bars[0].startswith("tiny data [--------------------]  0/16 samples   0%") and "16/16 samples 100%" in bars[-1]
    train_corpus, val_corpus = read_corpus(mini_target.path, "train"), read_corpus(mini_target.path, "val")
    for split, corpus in (("train", train_corpus), ("val", val_corpus)):
        for sample in splits[split]:
            assert sample.loss_mask.tolist() == [0] * 16 + [1] * 24
            assert bytes(sample.input_ids[:16].tolist()) in corpus
            continuation = mini_target.greedy_generate(sample.input_ids[None, :16], 24)[0]
            assert torch.equal(continuation, sample.input_ids[16:])
    assert len(set(mini_env.glob("tiny-data-*.safetensors")) - before) == 1
    again = tiny_samples(mini_target, settings)
    assert all(torch.equal(a.input_ids, b.input_ids) for a, b in zip(again["train"], splits["train"]))


def test_a_second_generator_waits_for_the_first_says_so_and_reads_its_cache(mini_target, mini_env):
    settings = TinyDataSettings(prompt_len=8, total_len=16, train_samples=4, val_samples=2, seed=3)
    cache = tiny_data_cache_path(mini_target, settings)
    assert cache.parent == mini_env and not cache.exists()
    messages, result = [], {}
    with open(cache.with_name(f".{cache.name}.lock"), "a+") as held:  # the other process's lock
        fcntl.flock(held, fcntl.LOCK_EX)
        held.write("4243\n")
        held.flush()
        waiter = threading.Thread(target=lambda: result.update(splits=tiny_samples(mini_target, settings, log=messages.append)))
        waiter.start()
        deadline = time.monotonic() + 60
        while not messages and time.monotonic() < deadline:
            time.sleep(0.05)
        assert messages and messages[0].startswith(f"waiting for another process building the tiny draft data {cache.name} (pid 4243)"), messages
        produced = tiny_samples(mini_target, settings, cache_dir=mini_env / "elsewhere")  # what the other process generates
        (mini_env / "elsewhere" / cache.name).rename(cache)
        fcntl.flock(held, fcntl.LOCK_UN)
    waiter.join(timeout=60)
    assert not any(m.startswith("generating the tiny draft data") for m in messages), "the waiter must read the cache, not generate again"
    assert all(torch.equal(a.input_ids, b.input_ids) for a, b in zip(result["splits"]["train"], produced["train"]))


def test_chat_template_masks_exactly_the_assistant_turns():
    tokenizer = chat_tokenizer()
    messages = [
        {"role": "user", "content": "hello there"},
        {"role": "assistant", "content": "how are you ?"},
        {"role": "user", "content": "fine thanks"},
        {"role": "assistant", "content": "bye !"},
    ]
    sample = tokenize_conversation(tokenizer, messages, max_len=100)
    tokens = tokenizer.convert_ids_to_tokens(sample.input_ids.tolist())
    trained = [t for t, m in zip(tokens, sample.loss_mask.tolist()) if m]
    assert trained == ["how", "are", "you", "?", "<|end|>", "bye", "!", "<|end|>"]
    truncated = tokenize_conversation(tokenizer, messages, max_len=6)
    assert len(truncated.input_ids) == 6
    assert tokenize_conversation(tokenizer, messages[:1], max_len=100) is None  # nothing to train on


def test_conversation_file_errors_name_the_line(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"conversations": [{"role": "user", "content": "hi"}]}\n{"conversations": [{"role": "user"}]}\n')
    with pytest.raises(DataError, match=r"bad.jsonl:2: each turn needs string 'role' and 'content'"):
        read_conversations(bad)
    (tmp_path / "notjson.jsonl").write_text("{oops\n")
    with pytest.raises(DataError, match=r"notjson.jsonl:1: not JSON"):
        read_conversations(tmp_path / "notjson.jsonl")
    with pytest.raises(DataError, match="does not exist"):
        read_conversations(tmp_path / "missing.jsonl")


def test_conversations_split_into_train_and_held_out_validation(tmp_path):
    records = [{"conversations": [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "fine " * (i + 1)}]} for i in range(20)]
    splits = conversation_samples(chat_tokenizer(), write_jsonl(tmp_path / "c.jsonl", records), max_len=64, val_fraction=0.1)
    assert len(splits["train"]) == 18 and len(splits["val"]) == 2
    train_ids = {tuple(s.input_ids.tolist()) for s in splits["train"]}
    assert not train_ids & {tuple(s.input_ids.tolist()) for s in splits["val"]}


def chat_sample(prompt: list[int], answer: list[int]) -> Sample:
    return Sample(torch.tensor(prompt + answer), torch.tensor([0] * len(prompt) + [1] * len(answer)))


def test_added_train_samples_drop_the_conversations_held_out_for_validation():
    splits = {"train": [chat_sample([1, 2], [3])], "val": [chat_sample([5, 6], [7, 8]), chat_sample([9], [4])]}
    extra = {
        "train": [
            chat_sample([5, 6], [70, 71, 72]),  # the first val conversation, answered by someone else: dropped
            chat_sample([5, 6, 7], [8]),  # a longer prompt is another conversation: kept
            chat_sample([9], [4]),  # the second val sample itself: dropped
            chat_sample([1, 2], [30]),  # a train prompt again: kept (a second answer to learn from)
            chat_sample([11], [12]),
        ],
        "val": [chat_sample([13], [14])],
    }
    lines = []
    merged = add_train_samples(splits, extra, "sharegpt/", lines.append)
    assert [s.input_ids.tolist() for s in merged["train"]] == [[1, 2, 3], [5, 6, 7, 8], [1, 2, 30], [11, 12]]
    assert merged["val"] is splits["val"] and len(splits["train"]) == 1  # validation unchanged; the input not mutated
    assert lines == ["conversations: +3 train samples from sharegpt/ (2 dropped: their first prompt is a val sample's; its 1 val samples not used)"]
    assert first_prompt(chat_sample([], [1, 2])) == b"" and first_prompt(Sample(torch.tensor([1, 2]), torch.tensor([0, 0]))) == first_prompt(
        chat_sample([1, 2], [])
    )


# Past two turns this template ends in the turn count, so a prefix's rendering is no prefix of the whole text: those
# conversations take the by-prefix path, the shorter ones the character-span path, in one batch.
COUNTING_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} <|end|> {% endfor %}"
    "{% if messages|length > 2 %}{{ 'hello ' * (messages|length) }}{% endif %}{% if add_generation_prompt %}<|assistant|> {% endif %}"
)


def _records(count):
    words = ["hello there", "how are you ?", "fine thanks", "bye !"]
    turns = [[("user", words[i % 4]), ("assistant", " ".join(words[: 1 + i % 4] * (1 + i % 5)))] * (1 + i % 3) for i in range(count)]
    return [[{"role": role, "content": text} for role, text in conversation] for conversation in turns]


def _mask_by_any_span(tokenizer, messages, max_len, template):
    """The mask the way it was first defined: a token is trained when its first character is in any assistant span."""
    from backend.train.data import _assistant_spans

    text, spans = _assistant_spans(tokenizer, messages, template)
    offsets = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"][:max_len]
    return [int(any(start <= begin < end for start, end in spans)) for begin, _ in offsets]


@pytest.mark.parametrize("template", [None, COUNTING_TEMPLATE])
def test_a_batch_tokenizes_each_conversation_as_it_alone_does(template):
    from backend.train.data import _assistant_spans, conversation_tokens, conversations_tokens

    tokenizer, conversations = chat_tokenizer(), _records(60)
    batched = conversations_tokens(tokenizer, conversations, 24, template)
    assert batched == [conversation_tokens(tokenizer, messages, 24, template) for messages in conversations]
    by_span = [i for i, messages in enumerate(conversations) if _assistant_spans(tokenizer, messages, template) is not None]
    assert len(by_span) == (60 if template is None else 20)  # the counting template: only the one-answer conversations
    for i in by_span:
        assert batched[i] is not None and batched[i][1] == _mask_by_any_span(tokenizer, conversations[i], 24, template)
    assert max(len(ids) for ids, _ in batched) == 24 and all(len(ids) == len(mask) for ids, mask in batched)
    cut = conversations_tokens(tokenizer, [[{"role": "user", "content": "hello there " * 20}, {"role": "assistant", "content": "bye"}]], 24, template)
    assert cut == [None]  # the answer past max_len: nothing trained


def test_tokenizing_a_file_logs_progress_and_caches_what_it_tokenized(tmp_path):
    records = [{"conversations": messages} for messages in _records(150)]
    records[7]["conversations"] = records[7]["conversations"][:1]  # no answer: dropped when read
    path = write_jsonl(tmp_path / "c.jsonl", records)
    messages = []
    splits = conversation_samples(chat_tokenizer(), path, max_len=24, cache_dir=tmp_path / "cache", log=messages.append)
    assert sum(len(s) for s in splits.values()) == 149
    assert messages[-2].startswith("tokenizing [####################] 149/149 conversations 100%")
    assert messages[-1].startswith("conversations: cached the tokenized samples at ")
    again = conversation_samples(chat_tokenizer(), path, max_len=24, cache_dir=tmp_path / "cache")
    for split in ("train", "val"):
        assert all(torch.equal(a.input_ids, b.input_ids) and torch.equal(a.loss_mask, b.loss_mask) for a, b in zip(splits[split], again[split]))


@pytest.mark.parametrize("store", ["logits", "last_hidden"])
def test_offline_shards_feed_the_same_batches_as_the_online_target(mini_target, mini_profile, tmp_path, store):
    ids = torch.randint(0, 256, (6, 14), generator=torch.Generator().manual_seed(5))
    splits = {
        "train": [Sample(ids[i], torch.ones(14, dtype=torch.uint8)) for i in range(4)],
        "val": [Sample(ids[i, : 6 + i], torch.ones(6 + i, dtype=torch.uint8)) for i in range(4, 6)],
    }
    extract(mini_target, splits, tmp_path / "shards", store=store, batch_size=3)
    offline, online = OfflineSource(tmp_path / "shards", mini_profile), OnlineSource(mini_target, splits)
    assert offline.size("train") == 4 and offline.size("val") == 2
    # extraction sorts by length, so compare sample by sample through the stored ids
    for split in ("train", "val"):
        for index in range(offline.size(split)):
            stored = offline.batch(split, [index], "cpu")
            n = stored.tokens  # batches are padded to their bucket length; compare the real positions
            match = [i for i, s in enumerate(splits[split]) if torch.equal(s.input_ids, stored.input_ids[0, :n])]
            live = online.batch(split, match[:1], "cpu")
            assert torch.allclose(stored.aux_hidden[:, :n], live.aux_hidden[:, :n], atol=1e-5)
            assert torch.allclose(stored.target_logits[:, :n], live.target_logits[:, :n], atol=1e-4)
    assert torch.equal(offline.embed_weight(), mini_target.embed_weight())
    padded = offline.batch("val", [0, 1], "cpu")
    assert padded.input_ids.shape == (2, bucket_length(11)) and padded.tokens == 21 and padded.loss_mask[0, 10:].sum() == 0


def test_offline_shards_of_other_aux_layers_are_refused(mini_profile, tmp_path):
    target = load_target(mini_profile, aux_layer_ids=[0, 1, 1])
    ids = torch.randint(0, 256, (3, 8))
    extract(
        target, {"train": [Sample(i, torch.ones(8, dtype=torch.uint8)) for i in ids], "val": [Sample(ids[0], torch.ones(8, dtype=torch.uint8))]}, tmp_path / "s"
    )
    with pytest.raises(DataError, match=r"holds aux layers \[0, 1, 1\] but profile 'mini' trains on \[0, 1, 2\]"):
        OfflineSource(tmp_path / "s", mini_profile)


def test_an_unfinished_extraction_is_refused(tmp_path, mini_profile):
    (tmp_path / "train").mkdir()
    with pytest.raises(DataError, match="did not finish"):
        OfflineSource(tmp_path, mini_profile)


def test_the_token_cache_follows_a_tokenizers_files_not_the_dir_they_lie_in(tmp_path):
    """A prepared target lies under each host's own cache dir: a cache made on one host is found on another (carried
    to the H200), and a tokenizer whose files differ never reads it."""
    import shutil

    from transformers import AutoTokenizer

    path = write_jsonl(tmp_path / "c.jsonl", [{"conversations": messages} for messages in _records(40)])
    chat_tokenizer().save_pretrained(tmp_path / "here")
    shutil.copytree(tmp_path / "here", tmp_path / "there")
    messages = []
    first = conversation_samples(AutoTokenizer.from_pretrained(tmp_path / "here"), path, max_len=24, cache_dir=tmp_path / "cache", log=messages.append)
    assert messages[-1].startswith("conversations: cached the tokenized samples at ")
    moved: list[str] = []
    again = conversation_samples(AutoTokenizer.from_pretrained(tmp_path / "there"), path, max_len=24, cache_dir=tmp_path / "cache", log=moved.append)
    assert len(moved) == 1 and moved[0].startswith(f"conversations: {len(first['train'])}+{len(first['val'])} tokenized samples from the cache")
    assert all(torch.equal(a.input_ids, b.input_ids) for a, b in zip(first["train"], again["train"]))
    vocab = tmp_path / "there" / "tokenizer.json"
    vocab.write_text(vocab.read_text().replace('"thanks"', '"thanx"'))
    changed: list[str] = []
    conversation_samples(AutoTokenizer.from_pretrained(tmp_path / "there"), path, max_len=24, cache_dir=tmp_path / "cache", log=changed.append)
    assert changed[-1].startswith("conversations: cached the tokenized samples at ")  # tokenized anew, its own cache


def test_the_token_cache_follows_what_a_tokenizer_encodes_not_how_its_file_is_written(tmp_path):
    """transformers 5.17 and 5.25 write SmolLM2's tokenizer.json differently (an empty normalizer, another decoder)
    with the same ids: the cache carried from one is read under the other. A normalizer that changes ids is another key."""
    import json

    from transformers import AutoTokenizer

    path = write_jsonl(tmp_path / "c.jsonl", [{"conversations": messages} for messages in _records(40)])
    chat_tokenizer().save_pretrained(tmp_path / "here")
    written = json.loads((tmp_path / "here" / "tokenizer.json").read_text())

    def variant(name: str, **fields) -> Path:
        (tmp_path / name).mkdir()
        for file in (tmp_path / "here").iterdir():
            (tmp_path / name / file.name).write_bytes(file.read_bytes())
        (tmp_path / name / "tokenizer.json").write_text(json.dumps({**written, **fields}, indent=4))
        return tmp_path / name

    def load(folder: Path, log: list[str]):
        return conversation_samples(AutoTokenizer.from_pretrained(folder), path, max_len=24, cache_dir=tmp_path / "cache", log=log.append)

    first: list[str] = []
    load(tmp_path / "here", first)
    assert first[-1].startswith("conversations: cached the tokenized samples at ")
    rewritten = variant("rewritten", normalizer={"type": "Sequence", "normalizers": []}, decoder={"type": "Sequence", "decoders": []})
    same: list[str] = []
    load(rewritten, same)
    assert len(same) == 1 and "tokenized samples from the cache" in same[0]
    lowercasing = variant("lowercasing", normalizer={"type": "Lowercase"})
    other: list[str] = []
    load(lowercasing, other)
    assert other[-1].startswith("conversations: cached the tokenized samples at ")  # tokenized anew, its own cache
