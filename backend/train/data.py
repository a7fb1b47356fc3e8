"""Training data for the draft: target-generated tiny samples, chat conversations, offline shards, and rank-sharded batches."""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from backend.train.target import SHARD_FORMAT, SHARD_META


class DataError(ValueError):
    """Training data that is missing, malformed, or does not fit the profile."""


def check_feature_width(found: int, num_aux: int, target_hidden: int) -> None:
    """The draft's fc takes num_aux concatenated target layers; anything else is refused naming both widths."""
    from backend.train.draft import FeatureWidthError

    expected = num_aux * target_hidden
    if found != expected:
        hint = f" (one layer's hidden state instead of {num_aux} concatenated)" if found == target_hidden else ""
        raise FeatureWidthError(
            f"the training data's aux hidden states are {found} wide{hint}, but the draft's fc expects {expected} "
            f"({num_aux} layers x target hidden {target_hidden}); nothing was trained. Re-extract with all {num_aux} aux layers."
        )


@dataclass
class Sample:
    input_ids: "object"  # [S] int64
    loss_mask: "object"  # [S] uint8: 1 where the draft is trained (generated / assistant tokens)


@dataclass
class TrainBatch:
    input_ids: "object"  # [B, S]
    loss_mask: "object"  # [B, S]
    aux_hidden: "object"  # [B, S, 3*Ht]
    target_logits: "object"  # [B, S, V]


def collate(samples: list[Sample], pad_id: int) -> dict:
    """Right-pad to the longest sample: input_ids (pad_id), loss_mask (0), attention_mask (1 on real tokens)."""
    import torch

    length = max(len(s.input_ids) for s in samples)
    ids = torch.full((len(samples), length), pad_id, dtype=torch.int64)
    loss = torch.zeros((len(samples), length), dtype=torch.uint8)
    attention = torch.zeros((len(samples), length), dtype=torch.int64)
    for row, sample in enumerate(samples):
        n = len(sample.input_ids)
        ids[row, :n] = torch.as_tensor(sample.input_ids, dtype=torch.int64)
        loss[row, :n] = torch.as_tensor(sample.loss_mask, dtype=torch.uint8)
        attention[row, :n] = 1
    return {"input_ids": ids, "loss_mask": loss, "attention_mask": attention}


# ----------------------------------------------------------------------------------------------
# Tiny: prompts are windows of the tiny corpus, continuations are the tiny target's greedy output
# ----------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class TinyDataSettings:
    prompt_len: int = 64
    total_len: int = 128  # prompt + greedy continuation; the loss covers the continuation
    train_samples: int = 640
    val_samples: int = 64
    seed: int = 0
    generate_batch: int = 64


def tiny_data_settings(seq_len: int, train_samples: int | None = None, val_samples: int | None = None, seed: int = 0) -> TinyDataSettings:
    """Samples of seq_len tokens: a prompt of min(64, seq_len/2) corpus bytes, then the target's continuation."""
    defaults = TinyDataSettings()
    train = train_samples or defaults.train_samples
    return TinyDataSettings(prompt_len=min(64, seq_len // 2), total_len=seq_len, train_samples=train,
                            val_samples=val_samples or (defaults.val_samples if train_samples is None else max(1, train // 10)), seed=seed)


def _windows(corpus: bytes, count: int, length: int, rng: random.Random) -> list[bytes]:
    if len(corpus) < length + 1:
        raise DataError(f"corpus of {len(corpus)} bytes is shorter than one {length}-byte prompt")
    return [corpus[start : start + length] for start in (rng.randrange(0, len(corpus) - length) for _ in range(count))]


def _generate_split(target, prompts: list[bytes], settings: TinyDataSettings) -> list[Sample]:
    import torch

    new_tokens = settings.total_len - settings.prompt_len
    samples = []
    for start in range(0, len(prompts), settings.generate_batch):
        chunk = prompts[start : start + settings.generate_batch]
        prompt_ids = torch.tensor([list(p) for p in chunk], dtype=torch.int64)
        generated = target.greedy_generate(prompt_ids, new_tokens).cpu()
        ids = torch.cat([prompt_ids, generated], dim=1)
        mask = torch.cat([torch.zeros_like(prompt_ids), torch.ones_like(generated)], dim=1).to(torch.uint8)
        samples.extend(Sample(ids[row], mask[row]) for row in range(len(chunk)))
    return samples


def tiny_samples(target, settings: TinyDataSettings = TinyDataSettings(), cache_dir: Path | None = None,
                 log: Callable[[str], None] | None = None) -> dict[str, list[Sample]]:
    """Train prompts from the corpus the target memorised, validation prompts from held-out stdlib files.

    The greedy continuations depend only on the target and these settings, so they are cached beside it.
    """
    from backend.train.tiny import cache_root, read_corpus

    key = hashlib.sha256(json.dumps({"target": Path(target.path).name, "settings": dataclasses.asdict(settings)}, sort_keys=True).encode()).hexdigest()[:16]
    cache = (Path(cache_dir) if cache_dir else cache_root()) / f"tiny-data-{key}.safetensors"
    if cache.is_file():
        return _read_tiny_cache(cache)
    if log:
        log(f"generating the tiny draft data: {settings.train_samples}+{settings.val_samples} greedy continuations (cached at {cache})")
    rng = random.Random(settings.seed)
    splits = {
        "train": _generate_split(target, _windows(read_corpus(target.path, "train"), settings.train_samples, settings.prompt_len, rng), settings),
        "val": _generate_split(target, _windows(read_corpus(target.path, "val"), settings.val_samples, settings.prompt_len, rng), settings),
    }
    _write_tiny_cache(cache, splits)
    return splits


def _write_tiny_cache(path: Path, splits: dict[str, list[Sample]]) -> None:
    import torch
    from safetensors.torch import save_file

    tensors = {}
    for name, samples in splits.items():
        tensors[f"{name}.input_ids"] = torch.stack([s.input_ids for s in samples]).contiguous()
        tensors[f"{name}.loss_mask"] = torch.stack([s.loss_mask for s in samples]).contiguous()
    path.parent.mkdir(parents=True, exist_ok=True)
    temp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    save_file(tensors, str(temp))
    os.replace(temp, path)


def _read_tiny_cache(path: Path) -> dict[str, list[Sample]]:
    from safetensors.torch import load_file

    tensors = load_file(str(path))
    return {
        name: [Sample(ids, mask) for ids, mask in zip(tensors[f"{name}.input_ids"], tensors[f"{name}.loss_mask"])]
        for name in ("train", "val")
    }


# ----------------------------------------------------------------------------------------------
# HF targets: conversations JSONL -> chat template tokens, loss on assistant tokens
# ----------------------------------------------------------------------------------------------

def read_conversations(path: str | os.PathLike, limit: int | None = None) -> list[list[dict]]:
    """{"conversations": [{"role": "user"|"assistant"|"system", "content": str}, ...]} per line."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise DataError(f"conversations file {path} does not exist")
    conversations = []
    with open(path, encoding="utf-8") as handle:
        for number, line in enumerate(handle, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise DataError(f"{path}:{number}: not JSON ({exc.msg})") from None
            turns = record.get("conversations") if isinstance(record, dict) else None
            if not isinstance(turns, list) or not turns:
                raise DataError(f"{path}:{number}: expected an object with a non-empty 'conversations' list")
            for turn in turns:
                if not isinstance(turn, dict) or not isinstance(turn.get("role"), str) or not isinstance(turn.get("content"), str):
                    raise DataError(f"{path}:{number}: each turn needs string 'role' and 'content', got {turn!r:.80}")
            conversations.append([{"role": t["role"], "content": t["content"]} for t in turns])
            if limit and len(conversations) >= limit:
                break
    if not conversations:
        raise DataError(f"{path} holds no conversations")
    return conversations


def _template_ids(tokenizer, messages: list[dict], add_generation_prompt: bool) -> list[int]:
    ids = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=add_generation_prompt)
    if isinstance(ids, dict) or hasattr(ids, "keys"):
        ids = ids["input_ids"]
    return list(ids)


def tokenize_conversation(tokenizer, messages: list[dict], max_len: int) -> Sample | None:
    """Chat-template tokens; loss_mask = 1 on each assistant turn's tokens (found by templating prefixes)."""
    import torch

    ids = _template_ids(tokenizer, messages, add_generation_prompt=False)
    mask = [0] * len(ids)
    for index, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        start = len(_template_ids(tokenizer, messages[:index], add_generation_prompt=True)) if index else 0
        end = len(_template_ids(tokenizer, messages[: index + 1], add_generation_prompt=False))
        for position in range(start, min(end, len(ids))):
            mask[position] = 1
    ids, mask = ids[:max_len], mask[:max_len]
    if not any(mask):
        return None
    return Sample(torch.tensor(ids, dtype=torch.int64), torch.tensor(mask, dtype=torch.uint8))


def regenerate_conversation(target, messages: list[dict], max_new_tokens: int) -> list[dict]:
    """Replace each assistant turn with the target's own greedy answer to the (regenerated) history before it."""
    import torch

    tokenizer = target.tokenizer
    result: list[dict] = []
    for message in messages:
        if message["role"] != "assistant":
            result.append(message)
            continue
        prompt = torch.tensor([_template_ids(tokenizer, result, add_generation_prompt=True)], dtype=torch.int64)
        generated = target.greedy_generate(prompt, max_new_tokens, stop_token_id=tokenizer.eos_token_id)[0].tolist()
        if tokenizer.eos_token_id in generated:
            generated = generated[: generated.index(tokenizer.eos_token_id)]
        result.append({"role": "assistant", "content": tokenizer.decode(generated, skip_special_tokens=True)})
    return result


def conversation_samples(tokenizer, path, max_len: int, val_fraction: float = 0.02, seed: int = 0, limit: int | None = None,
                         target=None, regenerate_tokens: int = 0) -> dict[str, list[Sample]]:
    """Tokenized conversations split into train / held-out val (a seeded shuffle; at least one val sample)."""
    conversations = read_conversations(path, limit)
    if regenerate_tokens:
        if target is None:
            raise DataError("regeneration needs the target model")
        conversations = [regenerate_conversation(target, c, regenerate_tokens) for c in conversations]
    samples = [s for s in (tokenize_conversation(tokenizer, c, max_len) for c in conversations) if s is not None]
    if len(samples) < 2:
        raise DataError(f"{path}: only {len(samples)} conversation(s) with assistant tokens; need at least 2 (train + val)")
    order = list(range(len(samples)))
    random.Random(seed).shuffle(order)
    val_count = max(1, int(round(len(samples) * val_fraction)))
    return {"train": [samples[i] for i in order[val_count:]], "val": [samples[i] for i in order[:val_count]]}


# ----------------------------------------------------------------------------------------------
# Sources: what the trainer draws batches from (online target or offline shards)
# ----------------------------------------------------------------------------------------------

class OnlineSource:
    """Samples in memory; the target runs inside the training step to produce aux states and teacher logits."""

    def __init__(self, target, splits: dict[str, list[Sample]]):
        self.target = target
        self.splits = splits
        self.pad_id = getattr(target.tokenizer, "pad_token_id", None) or 0
        self.aux_width = target.aux_width
        self.hidden_size = target.hidden_size
        self.vocab_size = target.vocab_size

    def __len__(self) -> int:
        return len(self.splits["train"])

    def size(self, split: str) -> int:
        return len(self.splits[split])

    def token_batches(self, split: str, indices: list[int]):
        for index in indices:
            sample = self.splits[split][index]
            yield sample.input_ids, sample.loss_mask

    def batch(self, split: str, indices: list[int], device) -> TrainBatch:
        data = collate([self.splits[split][i] for i in indices], self.pad_id)
        result = self.target.capture(data["input_ids"], data["attention_mask"], with_logits=True)
        return TrainBatch(data["input_ids"].to(device), data["loss_mask"].to(device), result.aux_hidden.to(device), result.logits.to(device))

    def embed_weight(self):
        return self.target.embed_weight()

    def describe_target(self) -> dict:
        return self.target.describe()


class OfflineShards:
    """One split of an `extract` output: per-sample tensors in shard-XXXXX.safetensors, opened lazily."""

    def __init__(self, directory: str | os.PathLike, split: str):
        self.directory = Path(directory).expanduser()
        self.meta = read_shard_meta(self.directory)
        if split not in self.meta["splits"]:
            raise DataError(f"{self.directory} has no '{split}' split (it has {sorted(self.meta['splits'])})")
        self.split = split
        self.index: list[tuple[str, str]] = []
        for shard in self.meta["splits"][split]["shards"]:
            if not (self.directory / split / shard["file"]).is_file():
                raise DataError(f"{self.directory}: shard {split}/{shard['file']} listed in {SHARD_META} is missing")
            first = len(self.index)
            self.index.extend([(shard["file"], f"s{first + i}") for i in range(shard["samples"])])
        self._handles: dict[str, object] = {}
        self.teacher_key = "target_logits" if self.meta["store"] == "logits" else "last_hidden_states"

    def __len__(self) -> int:
        return len(self.index)

    def _open(self, file: str):
        from safetensors import safe_open

        handle = self._handles.get(file)
        if handle is None:
            handle = safe_open(str(self.directory / self.split / file), framework="pt")
            self._handles[file] = handle
        return handle

    def get(self, index: int, keys: tuple[str, ...]) -> dict:
        file, prefix = self.index[index]
        handle = self._open(file)
        return {key: handle.get_tensor(f"{prefix}.{key}") for key in keys}


def read_shard_meta(directory: Path) -> dict:
    path = directory / SHARD_META
    if not path.is_file():
        raise DataError(f"{directory} holds no {SHARD_META}: not an `extract` output, or the extraction did not finish")
    meta = json.loads(path.read_text())
    if meta.get("format") != SHARD_FORMAT:
        raise DataError(f"{path}: format {meta.get('format')!r}, expected {SHARD_FORMAT!r}")
    return meta


class OfflineSource:
    """Batches from extracted shards; teacher logits are stored or recomputed with the target's lm_head."""

    def __init__(self, directory: str | os.PathLike, profile, device="cpu"):
        self.directory = Path(directory).expanduser()
        self.splits = {split: OfflineShards(self.directory, split) for split in ("train", "val")}
        self.meta = self.splits["train"].meta
        self.aux_width = int(self.meta["aux_width"])
        self.hidden_size = int(self.meta["hidden_size"])
        self.vocab_size = int(self.meta["vocab_size"])
        self.pad_id = 0
        self._check_profile(profile)
        from safetensors.torch import load_file

        head = load_file(str(self.directory / self.meta["head_file"]))
        self._embed = head["embed_tokens.weight"]
        self._lm_head = head["lm_head.weight"].to(device) if self.meta["store"] == "last_hidden" else None

    def _check_profile(self, profile) -> None:
        expected = profile.target
        check_feature_width(self.first_aux_width(), len(expected.aux_layer_ids), expected.hidden_size)
        if self.hidden_size != expected.hidden_size or self.vocab_size != expected.vocab_size:
            raise DataError(
                f"{self.directory} was extracted from a target with hidden {self.hidden_size}, vocab {self.vocab_size}; "
                f"profile {profile.name!r} says hidden {expected.hidden_size}, vocab {expected.vocab_size}"
            )
        if list(self.meta["aux_layer_ids"]) != list(expected.aux_layer_ids):
            raise DataError(
                f"{self.directory} holds aux layers {self.meta['aux_layer_ids']} but profile {profile.name!r} trains on "
                f"{list(expected.aux_layer_ids)}; extract again with this profile"
            )

    def __len__(self) -> int:
        return len(self.splits["train"])

    def size(self, split: str) -> int:
        return len(self.splits[split])

    def token_batches(self, split: str, indices: list[int]):
        shards = self.splits[split]
        for index in indices:
            data = shards.get(index, ("input_ids", "loss_mask"))
            yield data["input_ids"], data["loss_mask"]

    def first_aux_width(self) -> int:
        """Width of the stored aux features as found in the first sample (not as the metadata claims)."""
        return int(self.splits["train"].get(0, ("aux_hidden_states",))["aux_hidden_states"].shape[-1])

    def load(self, split: str, indices: list[int]) -> dict:
        """Host side of a batch: read and right-pad the samples (pinned when CUDA is present). Safe in a worker thread."""
        import torch

        shards = self.splits[split]
        rows = [shards.get(i, ("input_ids", "loss_mask", "aux_hidden_states", shards.teacher_key)) for i in indices]
        length = max(row["input_ids"].shape[0] for row in rows)
        pin = torch.cuda.is_available()

        def stack(key, fill=0):
            first = rows[0][key]
            out = torch.full((len(rows), length, *first.shape[1:]), fill, dtype=first.dtype)
            for r, row in enumerate(rows):
                out[r, : row[key].shape[0]] = row[key]
            return out.pin_memory() if pin else out

        keys = {"input_ids": self.pad_id, "loss_mask": 0, "aux_hidden_states": 0, shards.teacher_key: 0}
        return {key: stack(key, fill) for key, fill in keys.items()} | {"teacher_key": shards.teacher_key}

    def to_batch(self, loaded: dict, device) -> TrainBatch:
        """Device side: copy, and turn a stored last hidden state into teacher logits with the target's lm_head."""
        import torch

        move = {key: value.to(device, non_blocking=True) for key, value in loaded.items() if key != "teacher_key"}
        teacher = move[loaded["teacher_key"]]
        if self._lm_head is not None:
            with torch.no_grad():
                teacher = torch.nn.functional.linear(teacher.to(self._lm_head.dtype), self._lm_head)
        return TrainBatch(move["input_ids"], move["loss_mask"], move["aux_hidden_states"], teacher)

    def batch(self, split: str, indices: list[int], device) -> TrainBatch:
        return self.to_batch(self.load(split, indices), device)

    def embed_weight(self):
        return self._embed

    def describe_target(self) -> dict:
        return dict(self.meta["target"])


# ----------------------------------------------------------------------------------------------
# Batching: seeded per-epoch shuffles, each rank takes its slice of every global batch
# ----------------------------------------------------------------------------------------------

class BatchSampler:
    """Endless index batches: epoch e uses a permutation seeded by (seed, e); resumable from (epoch, cursor)."""

    def __init__(self, num_samples: int, batch_size: int, seed: int = 0, rank: int = 0, world_size: int = 1):
        global_batch = batch_size * world_size
        if num_samples < global_batch:
            raise DataError(f"{num_samples} training samples cannot fill one global batch of {batch_size} x {world_size} ranks")
        self.num_samples, self.batch_size, self.seed = num_samples, batch_size, seed
        self.rank, self.world_size = rank, world_size
        self.batches_per_epoch = num_samples // global_batch
        self.epoch, self.cursor = 0, 0
        self._order = self._permutation(0)

    def _permutation(self, epoch: int) -> list[int]:
        order = list(range(self.num_samples))
        random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
        return order

    def next(self) -> list[int]:
        if self.cursor >= self.batches_per_epoch:
            self.epoch += 1
            self.cursor = 0
            self._order = self._permutation(self.epoch)
        start = (self.cursor * self.world_size + self.rank) * self.batch_size
        self.cursor += 1
        return self._order[start : start + self.batch_size]

    @property
    def epoch_progress(self) -> float:
        return self.epoch + self.cursor / self.batches_per_epoch

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "cursor": self.cursor, "seed": self.seed, "num_samples": self.num_samples}

    def load_state_dict(self, state: dict) -> None:
        if state.get("num_samples") != self.num_samples:
            # Different data than the checkpoint saw: keep going from its epoch, at a fresh shuffle.
            self.epoch, self.cursor = int(state.get("epoch", 0)), 0
        else:
            self.epoch, self.cursor = int(state["epoch"]), int(state["cursor"])
        self._order = self._permutation(self.epoch)


def eval_batches(num_samples: int, batch_size: int, rank: int = 0, world_size: int = 1, limit: int | None = None) -> list[list[int]]:
    """This rank's share of the validation split, in order (all of it, or the first `limit` samples)."""
    count = min(num_samples, limit) if limit else num_samples
    mine = list(range(rank, count, world_size))
    return [mine[i : i + batch_size] for i in range(0, len(mine), batch_size)]
