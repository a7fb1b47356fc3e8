"""Regeneration (`eagle3-host data regenerate`, backend/train/data_cli.py): the target's own answers to a `data prepare` dir's conversations, batched, greedy or
sampled, resumable after a kill, written as reusable JSONL with a side file naming the target, template and settings."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Callable, Iterable, Iterator

from backend.train.chat_templates import template_ids
from backend.train.conversations import PREPARE_META, SPLIT_FILES, DataError, content_digest, iter_conversations
from backend.durable import fsync_path
from backend.train.fsutil import PRIVATE_DIR, PRIVATE_FILE, file_sha256
from backend.repetition import repeated_positions
from backend.train.target import load_tokenizer
from backend.train.tokenizer_identity import tokenizer_behaviour
from backend.durable import write_atomic

REGENERATE_META = "regenerate.json"  # written first (settings) and again last (complete: true); a complete dir trains
REGENERATE_FORMAT = "eagle3-console-regenerated-chat/1"
SKIPPED_FILE = "skipped.jsonl"  # conversations that produced no answer (the first prompt was too long), so a resume skips them
LOCK_FILE = ".regenerate.lock"
SPLITS = ("train", "val")
CACHE_KINDS = ("dynamic", "static")  # how `generate` keeps the KV cache (RegenerateSettings.cache)
# Files whose bytes identify a target besides its weights (hashed whole); weights are hashed by size, head and tail.
_TOKENIZER_IDENTITY_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")  # hashed by behaviour now
_IDENTITY_FILES = ("config.json", "generation_config.json", *_TOKENIZER_IDENTITY_FILES, "model.safetensors.index.json")
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
_SAMPLE_BYTES = 1 << 20
_VERSION_STAMPS = ("transformers_version",)  # written by whichever library version saved the dir: not the model

Log = Callable[[str], None]


def _stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------------------------
# The target's identity, and the check that reading a regenerated file makes
# ----------------------------------------------------------------------------------------------


def target_fingerprints(path: str | os.PathLike) -> tuple[str, ...]:
    """The fingerprint of a target directory, then the earlier forms a regeneration may have recorded (2: before
    2026-12-05, 1: before 2026-12-04): hashes that tell one target from another without reading every weight byte.

    Config and generation config are hashed whole, without the `transformers_version` a library writes into them
    (form 1 kept it); each weight file by its name, size and its first and last MiB (a safetensors file opens with the
    name, shape and offset of every tensor); the tokenizer by what it does (tokenizer_behaviour: what it encodes with,
    its special tokens and their ids, its chat template), read by loading it, not by its files' bytes, which another
    transformers writes otherwise (SmolLM2's prepared on the H200's 5.17 and on 5.25: another tokenizer.json and
    tokenizer_config.json, the same tokenizer; forms 1 and 2 hashed the files, so those were "another target" to each
    other). A directory whose tokenizer does not load has its tokenizer files hashed instead. A copy elsewhere, or one
    written by another transformers, has the same fingerprint; retrained or other weights, another tokenizer, eos or
    template, or another config value give another.
    """
    directory = Path(path).expanduser()
    if not directory.is_dir():
        raise DataError(f"target {directory} is not a model directory")
    behaviour = _tokenizer_behaviour(directory)
    forms = [hashlib.sha256(f"eagle3-target-fingerprint/{form}\n".encode()) for form in (3, 2, 1)]
    current, files, legacy = forms
    for entry in sorted(directory.iterdir()):
        if entry.name in _IDENTITY_FILES and entry.is_file():
            legacy.update(f"{entry.name}\n".encode() + bytes.fromhex(file_sha256(entry)))
            named = f"{entry.name}\n".encode() + _identity_file_digest(entry)
            files.update(named)
            if behaviour is None or entry.name not in _TOKENIZER_IDENTITY_FILES:
                current.update(named)
        elif entry.suffix in _WEIGHT_SUFFIXES and entry.is_file():
            size = entry.stat().st_size
            with open(entry, "rb") as handle:
                head = handle.read(_SAMPLE_BYTES)
                handle.seek(max(0, size - _SAMPLE_BYTES))
                tail = handle.read(_SAMPLE_BYTES)
            for digest in forms:
                digest.update(f"{entry.name} {size}\n".encode() + head + tail)
    if behaviour is not None:
        current.update(f"tokenizer {behaviour}\n".encode())
    return tuple(digest.hexdigest() for digest in forms)


def _tokenizer_behaviour(directory: Path) -> str | None:
    """tokenizer_behaviour of the directory's tokenizer; None where none loads (weights alone, remote code)."""
    try:
        tokenizer = load_tokenizer(str(directory))
    except Exception:  # noqa: BLE001 - transformers raises OSError, ValueError, KeyError... for a dir it cannot read
        return None
    return tokenizer_behaviour(tokenizer)


def _identity_file_digest(path: Path) -> bytes:
    """sha256 of an identity file; a JSON object without the saving library's version stamp, keys sorted."""
    raw = path.read_bytes()
    if path.suffix == ".json":
        try:
            loaded = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError):
            loaded = None
        if isinstance(loaded, dict):
            raw = json.dumps({k: v for k, v in loaded.items() if k not in _VERSION_STAMPS}, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(raw).digest()


def target_fingerprint(path: str | os.PathLike) -> str:
    """The fingerprint a regeneration records (target_fingerprints)."""
    return target_fingerprints(path)[0]


def recorded_fingerprints(recorded: dict) -> set[str]:
    """A regeneration's recorded target fingerprints: every form it recorded ("fingerprint_forms", since 2026-12-05),
    and "fingerprint" (the one form records before then hold)."""
    forms = {recorded.get("fingerprint"), *(recorded.get("fingerprint_forms") or [])}
    return {form for form in forms if isinstance(form, str)}


def same_target(recorded: dict, forms: Iterable[str]) -> bool:
    """Whether a recorded target (its "fingerprint" and "fingerprint_forms") is the target whose fingerprint forms
    (target_fingerprints) are `forms`: any form recorded equals the same form computed now. Recording every form lets
    a host whose form 3 came out otherwise (another tokenizers library reading the same files) still match on the
    file-hash form 2."""
    return not recorded_fingerprints(recorded).isdisjoint(forms)


def regenerated_meta_for(path: str | os.PathLike) -> tuple[dict, Path] | None:
    """(regenerate.json, its dir) when `path` is a regenerated dir or one of its split files; None for other data.
    A regeneration that has not finished is refused: it holds only part of the conversations."""
    path = Path(path).expanduser()
    directory = path if path.is_dir() else path.parent
    meta_path = directory / REGENERATE_META
    if not meta_path.is_file():
        return None
    if not path.is_dir() and path.name not in (SPLIT_FILES[s] for s in SPLITS):
        return None
    try:
        meta = json.loads(meta_path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise DataError(f"{meta_path}: unreadable ({exc}); regenerate again") from None
    if meta.get("format") != REGENERATE_FORMAT:
        raise DataError(f"{meta_path}: format {meta.get('format')!r}, expected {REGENERATE_FORMAT!r}")
    if not meta.get("complete") and not meta.get("finalized"):
        raise DataError(
            f"{directory} is a regeneration that has not finished ({meta.get('counts', {}).get('done', 0)} conversations so far); "
            "run the same `data regenerate` command again to resume it (nothing was trained)"
        )
    return meta, directory


def check_regenerated_target(path: str | os.PathLike, target_path: str, profile_target: str | None = None) -> dict | None:
    """Refuse regenerated data written by another target than `target_path` (a DataError: exit 2, one line).
    Returns the regeneration's metadata (None for data that was not regenerated)."""
    found = regenerated_meta_for(path)
    if found is None:
        return None
    meta, directory = found
    recorded = meta["target"]
    forms = target_fingerprints(target_path)
    if not same_target(recorded, forms):
        shown = f"{profile_target} ({target_path})" if profile_target and profile_target != target_path else target_path
        raise DataError(
            f"{directory} was regenerated by the target {recorded['path']} ({recorded['resolved_path']}, fingerprint {recorded['fingerprint'][:12]}), "
            f"not by this run's target {shown} (fingerprint {forms[0][:12]}); its answers would teach another model's "
            f"distribution. Regenerate with this target or train with that one (nothing was trained)"
        )
    return meta


# ----------------------------------------------------------------------------------------------
# Durable line output: one fsync'd write per finished conversation; a torn last line is cut off on resume
# ----------------------------------------------------------------------------------------------


def read_done_lines(path: Path) -> list[dict]:
    """The complete records of an append-only JSONL file. A last line cut by a kill (no newline, or not JSON) is
    truncated away, so that conversation is done again; a bad line in the middle is refused (the file is not ours)."""
    if not path.exists():
        return []
    data = path.read_bytes()
    records: list[dict] = []
    good_end = start = 0
    while start < len(data):
        newline = data.find(b"\n", start)
        line = data[start:] if newline < 0 else data[start:newline]
        try:
            record = json.loads(line) if newline >= 0 else None
        except json.JSONDecodeError:
            record = None
        if record is None:
            if newline >= 0 and data[newline + 1 :].strip():
                raise DataError(f"{path}: line {len(records) + 1} is not JSON and is not the last line; this file is not a regeneration's output")
            break
        records.append(record)
        good_end = start = newline + 1
    if good_end < len(data):
        with open(path, "r+b") as handle:
            handle.truncate(good_end)
            handle.flush()
            os.fsync(handle.fileno())
    return records


class LineAppender:
    """Append-only JSONL: each record is one write() of a whole line, then fsync, before the next is started."""

    def __init__(self, path: Path):
        self.path = path
        existed = path.exists()
        self.fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0), PRIVATE_FILE)
        if not existed:
            fsync_path(path.parent)

    def append(self, record: dict) -> None:
        view = memoryview((json.dumps(record, ensure_ascii=False) + "\n").encode())
        while view:
            view = view[os.write(self.fd, view) :]
        os.fsync(self.fd)

    def close(self) -> None:
        os.close(self.fd)


# ----------------------------------------------------------------------------------------------
# Batched generation: left-padded prompts, one KV cache, per-row stop, rows leave the batch when they stop
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Sampling:
    max_new_tokens: int = 256
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    seed: int = 0

    def check(self) -> None:
        if self.max_new_tokens <= 0:
            raise DataError(f"--max-new-tokens {self.max_new_tokens}: expected a positive count. Nothing was written.")
        if self.temperature < 0 or not 0 < self.top_p <= 1:
            raise DataError(f"--temperature {self.temperature} / --top-p {self.top_p}: expected temperature >= 0 and 0 < top-p <= 1. Nothing was written.")


SAMPLER = "uniform-table/1"  # how a sampled answer turns its row's draws into tokens: recorded, a resume compares it


def answer_draws(rngs: list[random.Random], sampling: Sampling) -> list[list[float]] | None:
    """Each row's uniforms for one answer, max_new_tokens of them drawn from the row's own generator before the answer
    starts (None when greedy): a row's tokens depend on its conversation's seed alone, never on the batch."""
    if sampling.temperature <= 0:
        return None
    return [[rng.random() for _ in range(sampling.max_new_tokens)] for rng in rngs]


class SeededSampler:
    """A logits processor that turns greedy decoding into sampling: row r's token at new position t is the inverse CDF
    of softmax(logits / temperature), cut to the top-p mass, at draws[r][t]; every other token is masked, so the
    greedy pick is the sample. It runs inside transformers' `generate`, so sampled answers use the same batched
    (and static, compiled) cache as greedy ones, with no host sync per token."""

    def __init__(self, draws, prompt_width: int, sampling: Sampling):
        self.draws, self.prompt_width, self.sampling = draws, prompt_width, sampling

    def __call__(self, input_ids, scores):
        import torch

        step = input_ids.shape[1] - self.prompt_width
        probs = torch.softmax(scores.float() / self.sampling.temperature, dim=-1)
        order = None
        if self.sampling.top_p < 1:
            probs, order = probs.sort(dim=-1, descending=True)
            before = probs.cumsum(-1) - probs
            probs = probs.masked_fill(before >= self.sampling.top_p, 0.0)  # the smallest prefix holding top-p (the first always stays)
        cumulative = probs.cumsum(-1)
        draw = self.draws[: scores.shape[0], step : step + 1].to(cumulative.dtype) * cumulative[:, -1:]
        chosen = torch.searchsorted(cumulative, draw).clamp(max=scores.shape[-1] - 1)
        tokens = chosen if order is None else order.gather(1, chosen)
        return torch.full_like(scores, float("-inf")).scatter_(1, tokens, 0.0)


def generate_batch(
    target, prompts: list[list[int]], rngs: list[random.Random], sampling: Sampling, stop_ids: set[int], static: StaticBatches | None = None
) -> list[tuple[list[int], str]]:
    """(answer ids without the stop token, "eos" | "length") for each prompt, generated together with one KV cache
    through transformers' own `generate` (on the H200 it decoded 1.6-3.7x the tokens a second of a hand-written
    loop at batch 256-2048: benchmarks/bench_regenerate.py), from `static`'s preallocated cache when given.

    Prompts are left-padded and masked; positions count real tokens only, so a row sees what it would alone. A
    sampled row draws from its own generator (SeededSampler), so its tokens never depend on the batch either.
    """
    import torch
    from transformers import GenerationConfig, LogitsProcessorList

    pad_id = _pad_id(target)
    rows, cache = (static.fill(prompts, pad_id), {target._cache_kwarg: static.cache(target.model)}) if static else (prompts, {})
    ids, mask = _padded(rows, pad_id, target.device, static.prompt_width if static else None)
    processors = LogitsProcessorList()
    draws = answer_draws(rngs, sampling)
    if draws is not None:
        table = torch.tensor(draws + [[0.5] * sampling.max_new_tokens] * (len(rows) - len(prompts)), dtype=torch.float64, device=target.device)
        processors.append(SeededSampler(table, ids.shape[1], sampling))
    # a generation config of our own: no sampling, penalties or length rules from the model's generation_config.json
    config = GenerationConfig(
        max_new_tokens=sampling.max_new_tokens, do_sample=False, eos_token_id=sorted(stop_ids) or None, pad_token_id=pad_id, use_cache=True
    )
    with torch.no_grad():
        output = target.model.generate(input_ids=ids, attention_mask=mask, generation_config=config, logits_processor=processors, **cache)
    answers = []
    for row in output[: len(prompts), ids.shape[1] :].tolist():
        stop = next((i for i, token in enumerate(row) if token in stop_ids), None)
        answers.append((row, "length") if stop is None else (row[:stop], "eos"))
    return answers


class StaticBatches:
    """One preallocated KV cache (transformers' StaticCache) shared by every batch of a regeneration, greedy or sampled.

    Every batch is filled to `rows` (one-token filler rows, their answers dropped) and every prompt left-padded to
    `prompt_width`, so each `generate` call has the same shapes and the same cache: on CUDA transformers compiles a
    static cache's decode step (torch.compile, CUDA graphs) once and replays it for every step of every batch,
    where the dynamic cache's eager step re-launches ~30 layers of kernels and grows the cache by copying it.
    """

    def __init__(self, rows: int, prompt_width: int, max_new_tokens: int):
        if rows <= 0 or prompt_width <= 0 or max_new_tokens <= 0:
            raise DataError(
                f"a static cache needs positive rows, prompt width and new tokens (got {rows}, {prompt_width}, {max_new_tokens}). Nothing was written."
            )
        self.rows, self.prompt_width, self.max_new_tokens = rows, prompt_width, max_new_tokens
        self._cache = None

    def cache(self, model):
        """The cache for the next call: made on the first, emptied in place (same tensors, same compiled graph) after."""
        if self._cache is None:
            from transformers import StaticCache

            self._cache = StaticCache(config=model.config, max_cache_len=self.prompt_width + self.max_new_tokens)
        else:
            self._cache.reset()
        return self._cache

    def fill(self, prompts: list[list[int]], pad_id: int) -> list[list[int]]:
        """The prompts and as many one-token filler rows as make `rows`; a prompt wider than the cache is refused."""
        if len(prompts) > self.rows:
            raise ValueError(f"{len(prompts)} prompts for a static cache of {self.rows} rows")
        if any(len(p) > self.prompt_width for p in prompts):
            raise ValueError(f"a prompt of {max(map(len, prompts))} tokens for a static cache {self.prompt_width} tokens wide")
        return prompts + [[pad_id]] * (self.rows - len(prompts))


def _padded(prompts: list[list[int]], pad_id: int, device, width: int | None = None) -> tuple[Any, Any]:
    import torch

    width = width or max(len(p) for p in prompts)
    ids = torch.tensor([[pad_id] * (width - len(p)) + list(p) for p in prompts], dtype=torch.int64, device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], dtype=torch.int64, device=device)
    return ids, mask


def _pad_id(target) -> int:
    pad_id = getattr(target.tokenizer, "pad_token_id", None)
    return 0 if pad_id is None else int(pad_id)


def stop_token_ids(target) -> set[int]:
    """The tokenizer's eos and the generation config's (one id or a list)."""
    ids: set[int] = set()
    for value in (getattr(target.tokenizer, "eos_token_id", None), getattr(getattr(target.model, "generation_config", None), "eos_token_id", None)):
        for item in value if isinstance(value, (list, tuple)) else [value]:
            if isinstance(item, int):
                ids.add(item)
    if not ids:
        raise DataError(f"the tokenizer of {target.path} names no eos token; regeneration cannot tell where an answer ends")
    return ids


# ----------------------------------------------------------------------------------------------
# Conversations: each assistant turn is replaced by the target's answer to the regenerated history before it
# ----------------------------------------------------------------------------------------------


def conversation_seed(seed: int, messages: list[dict]) -> int:
    """The sampling seed of one conversation: fixed by its content and --seed, whatever batch it lands in."""
    return int.from_bytes(hashlib.sha256(seed.to_bytes(8, "big", signed=True) + content_digest(messages)).digest()[:8], "big")


@dataclass
class Job:
    """One conversation being regenerated: the source turns still to walk, and what has been produced so far."""

    key: str  # "train:17": split and index (0-based) of the conversation in the source file; what a resume skips
    id: str | None
    source: list[dict]
    rng: random.Random
    messages: list[dict] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    finish: list[str] = field(default_factory=list)
    position: int = 0
    cut: str | None = None  # why the conversation ends early

    def next_prompt(self, render: Callable[[list[dict]], list[int]], max_prompt_tokens: int, max_answers: int | None = None) -> list[int] | None:
        """The ids of the history before the next answer (through the chat template, generation prompt added);
        None when no answer is left, when max_answers are answered (the later turns are left out), or when the prompt
        is longer than max_prompt_tokens (the conversation ends there)."""
        if max_answers is not None and len(self.tokens) >= max_answers:
            return None
        while self.position < len(self.source) and self.source[self.position]["role"] != "assistant":
            self.messages.append(self.source[self.position])
            self.position += 1
        if self.position >= len(self.source):
            return None
        prompt = render(self.messages)
        if len(prompt) > max_prompt_tokens:
            self.cut = f"prompt of {len(prompt)} tokens > --max-prompt-tokens {max_prompt_tokens}"
            return None
        return prompt

    def answers_to_come(self, max_answers: int | None) -> int:
        """The answers still to generate if no prompt gets too long: the work a progress line's time left counts."""
        planned = sum(1 for turn in self.source[self.position :] if turn["role"] == "assistant")
        return planned if max_answers is None else max(0, min(planned, max_answers - len(self.tokens)))

    def answer(self, text: str, count: int, finish: str) -> None:
        self.messages.append({"role": "assistant", "content": text})
        self.tokens.append(count)
        self.finish.append(finish)
        self.position += 1

    def record(self) -> dict:
        """The output line: a role/content conversation (what every reader takes) and how each answer ended."""
        while self.messages and self.messages[-1]["role"] != "assistant":  # a cut conversation ends on its last answer
            self.messages.pop()
        row: dict[str, Any] = {"key": self.key}
        if self.id is not None:
            row["id"] = self.id
        return row | {"conversations": self.messages, "answer_tokens": self.tokens, "finish": self.finish} | ({"cut": self.cut} if self.cut else {})


def source_jobs(source: Path, limits: dict[str, int | None], seed: int) -> Iterator[Job]:
    """Every conversation of the prepare dir's splits, in file order, the (small) val split first so that a run cut
    by --max-seconds still has a validation split; keyed by split and line."""
    for split in sorted(SPLITS, key=lambda name: name != "val"):
        limit = limits.get(split)
        if limit == 0:
            continue
        for index, conversation in enumerate(iter_conversations(source / SPLIT_FILES[split], limit=limit)):
            yield Job(f"{split}:{index}", conversation.id, conversation.messages, random.Random(conversation_seed(seed, conversation.messages)))


# ----------------------------------------------------------------------------------------------
# Batches of similar prompt lengths
# ----------------------------------------------------------------------------------------------


class LengthGroupedQueue:
    """Prompts waiting for an answer, handed out in batches of neighbouring lengths.

    A left-padded batch costs every row its longest prompt, in the prefill and in every decode step's attention
    and KV cache; ShareGPT's first prompts run from a few tokens to the 384 cut, so a batch in arrival order pays
    ~384 for most rows. Up to `window` batches of prompts are held, ordered by (val before train, length), and a
    batch is the run of neighbours ending at the longest-waiting prompt (val's, while any waits): the shortest
    padding that still serves that prompt now, so none waits behind more than the window, and val goes first.
    """

    def __init__(self, batch_size: int, window: int):
        self.batch_size, self.capacity = batch_size, batch_size * max(1, window)
        self.items: list[tuple[Job, list[int]]] = []  # in arrival order: items[0] has waited longest

    def __len__(self) -> int:
        return len(self.items)

    def room(self) -> int:
        return self.capacity - len(self.items)

    def add(self, job: Job, prompt: list[int]) -> None:
        self.items.append((job, prompt))

    def next_batch(self) -> list[tuple[Job, list[int]]]:
        is_val = [job.key.startswith("val:") for job, _ in self.items]
        order = sorted(range(len(self.items)), key=lambda i: (not is_val[i], len(self.items[i][1]), i))
        oldest = is_val.index(True) if any(is_val) else 0
        end = max(order.index(oldest) + 1, min(self.batch_size, len(order)))
        chosen = set(order[max(0, end - self.batch_size) : end])
        batch = [item for i, item in enumerate(self.items) if i in chosen]
        self.items = [item for i, item in enumerate(self.items) if i not in chosen]
        return batch

    def drain(self) -> list[tuple[Job, list[int]]]:
        batch, self.items = self.items, []
        return batch


def padded_prompt_tokens(prompts: list[list[int]]) -> int:
    """What a left-padded batch of `prompts` holds: every row as long as the longest."""
    return len(prompts) * max((len(p) for p in prompts), default=0)


# ----------------------------------------------------------------------------------------------
# The run: settings checked against an earlier run's, done keys skipped, finished conversations appended
# ----------------------------------------------------------------------------------------------


@dataclass
class RegenerateSettings:
    source: Path
    out: Path
    sampling: Sampling
    batch_size: int = 16
    max_prompt_tokens: int = 2048
    limit: int | None = None
    val_limit: int | None = None
    progress_seconds: float = 10.0
    max_seconds: float | None = None  # no new answer is started after this; what is done is finalized (a run control, not identity)
    max_answers: int | None = None  # answer at most the first N assistant turns of each conversation
    window: int = 4  # batches of prompts held to group by length (LengthGroupedQueue); 1: arrival order only
    reuse: Path | None = None  # an earlier regeneration whose finished conversations are taken where the source content is the same
    reuse_source: Path | None = None  # the prepare dir `reuse` regenerated, when it is not where its regenerate.json says
    cache: str = "dynamic"  # "static": one preallocated cache for every batch (StaticBatches); how, not what (not identity)

    def static_batches(self) -> StaticBatches | None:
        if self.cache not in CACHE_KINDS:
            raise DataError(f"--cache {self.cache}: expected one of {', '.join(CACHE_KINDS)}. Nothing was written.")
        if self.cache != "static":
            return None
        return StaticBatches(self.batch_size, self.max_prompt_tokens, self.sampling.max_new_tokens)


def split_digests(source: Path) -> dict[str, str]:
    """sha256 of a prepare dir's train and val files: what a regeneration's split:line keys point into (OSError if one is missing)."""
    return {split: file_sha256(source / SPLIT_FILES[split]) for split in SPLITS}


def source_identity(source: Path) -> dict:
    """The prepare dir as written in regenerate.json. A resume compares only its splits' contents: the same prepared
    data rebuilt elsewhere (its prepare.json records when and in how many seconds) resumes the same regeneration."""
    if not (source / PREPARE_META).is_file():
        raise DataError(f"--input {source} is not a `data prepare` output (no {PREPARE_META}); run `eagle3-host data prepare` first. Nothing was written.")
    return {
        "dir": str(source.resolve()),
        "prepare_sha256": file_sha256(source / PREPARE_META),
        "splits": split_digests(source),
    }


def _target_identity(target, dtype: str) -> dict:
    """The target as a regeneration records it: where it was, every fingerprint form (the current one also alone, as
    records before 2026-12-05 hold it) and the dtype it answered in."""
    forms = target_fingerprints(target.path)
    return {"path": target.profile.target.path, "resolved_path": str(target.path), "fingerprint": forms[0], "fingerprint_forms": list(forms), "dtype": dtype}


def _identity(settings: RegenerateSettings, target, template_name: str, template: str, dtype: str) -> dict:
    """What the output depends on: an existing output dir is resumed only when all of it is the same."""
    return {
        "format": REGENERATE_FORMAT,
        "target": _target_identity(target, dtype),
        "template": {"name": template_name, "sha256": hashlib.sha256(template.encode()).hexdigest()},
        "settings": {
            "max_new_tokens": settings.sampling.max_new_tokens,
            "temperature": settings.sampling.temperature,
            "top_p": settings.sampling.top_p,
            "seed": settings.sampling.seed,
            **({"sampler": SAMPLER} if settings.sampling.temperature > 0 else {}),  # greedy runs made before it resume
            "max_prompt_tokens": settings.max_prompt_tokens,
            "limit": settings.limit,
            "val_limit": settings.val_limit,
            **({"max_answers": settings.max_answers} if settings.max_answers is not None else {}),  # absent: runs made before it resume
        },
        "source": source_identity(settings.source),
    }


def _same_run(old: dict, new: dict) -> list[str]:
    wrong = _other_target(old.get("target") or {}, new["target"])
    wrong += [f"{name}: was {old.get(name)!r}, now {new[name]!r}" for name in ("template", "settings") if old.get(name) != new[name]]
    old_splits, new_splits = (old.get("source") or {}).get("splits"), new["source"]["splits"]
    if old_splits != new_splits:  # a resume skips keys (split:line), so the split files must hold the same lines
        wrong.append(f"source splits: was {old_splits!r}, now {new_splits!r}")
    return wrong


def _other_target(recorded: dict, target: dict) -> list[str]:
    """What tells a recorded target from this run's: its weights (any fingerprint form recorded against the same form
    now) and dtype; not where it lies (a copy on another host, another cache dir)."""
    wrong = (
        []
        if same_target(recorded, target["fingerprint_forms"])
        else [f"target fingerprint: was {recorded.get('fingerprint')!r} ({recorded.get('resolved_path')}), now {target['fingerprint']!r}"]
    )
    if recorded.get("dtype") != target["dtype"]:
        wrong.append(f"target dtype: was {recorded.get('dtype')!r}, now {target['dtype']!r}")
    return wrong


REUSE_SETTINGS = ("max_new_tokens", "temperature", "top_p", "seed", "sampler", "max_prompt_tokens", "max_answers")  # what an answer depends on


def reusable_answers(reuse: Path, reuse_source: Path | None, identity: dict) -> dict[bytes, dict]:
    """An earlier regeneration's finished conversations keyed by their source content: the output line, or
    {"skipped": reason}. Refused (DataError, nothing written) unless its target weights, dtype, template and answer
    settings are this run's; its limits and splits may differ (a grown or re-split prepare dir). Conversations cut by
    its --max-seconds are left out (they may lack answers)."""
    reuse = reuse.expanduser()
    found = regenerated_meta_for(reuse)
    if found is None:
        raise DataError(f"--reuse {reuse} is not a `data regenerate` output (no {REGENERATE_META}). Nothing was written.")
    meta = found[0]
    wrong = _other_target(meta["target"], identity["target"])
    if meta.get("template", {}).get("sha256") != identity["template"]["sha256"]:
        wrong.append(f"template: was {meta.get('template', {}).get('name')!r}, now {identity['template']['name']!r}")
    wrong += [
        f"{key}: was {meta['settings'].get(key)!r}, now {identity['settings'].get(key)!r}"
        for key in REUSE_SETTINGS
        if meta["settings"].get(key) != identity["settings"].get(key)
    ]
    if wrong:
        raise DataError(f"--reuse {reuse} was regenerated differently ({'; '.join(wrong)[:400]}); its answers would not be this run's. Nothing was written.")
    source = (reuse_source or Path(meta["source"]["dir"])).expanduser()
    recorded = meta["source"]["splits"]
    try:
        found_digests = split_digests(source)
    except OSError:
        found_digests = None
    if found_digests != recorded:
        raise DataError(
            f"--reuse {reuse}: the prepare dir it regenerated ({source}) is missing or changed; pass --reuse-source with a copy whose "
            f"train/val splits have sha256 {recorded}. Nothing was written."
        )
    digests = {split: [content_digest(c.messages) for c in iter_conversations(source / SPLIT_FILES[split])] for split in SPLITS}
    answers: dict[bytes, dict] = {}
    for name in (*SPLITS, "skipped"):
        for row in _finished_lines(reuse / (SKIPPED_FILE if name == "skipped" else SPLIT_FILES[name])):
            split, index = row["key"].split(":")
            if "--max-seconds" in str(row.get("cut", "")):
                continue
            answers[digests[split][int(index)]] = {"skipped": row["reason"]} if name == "skipped" else row
    return answers


def _write_meta(out: Path, meta: dict) -> None:

    write_atomic(out / REGENERATE_META, json.dumps(meta, indent=1) + "\n", mode=PRIVATE_FILE)


def _open_out(out: Path, identity: dict) -> dict:
    """The output dir's metadata: a new one for a new or empty dir, the earlier run's when it matches, else refused."""
    if out.exists() and not out.is_dir():
        raise DataError(f"--out {out} is a file; data regenerate writes into a directory. Nothing was written.")
    meta_path = out / REGENERATE_META
    if meta_path.is_file():
        old = json.loads(meta_path.read_text())
        wrong = _same_run(old, identity)
        if wrong:
            raise DataError(f"--out {out} holds a regeneration with other inputs ({'; '.join(wrong)[:400]}); choose a new --out. Nothing was changed.")
        old["target"] = identity["target"]  # the same weights, recorded as this run finds them (its path, the current fingerprint)
        return old
    if out.is_dir() and any(p.name != LOCK_FILE for p in out.iterdir()):
        raise DataError(f"--out {out} holds other files and no {REGENERATE_META}; choose a new or empty directory. Nothing was written.")
    out.mkdir(mode=PRIVATE_DIR, parents=True, exist_ok=True)
    meta = identity | {"complete": False, "counts": {}, "runs": [], "created": time.time()}
    _write_meta(out, meta)
    return meta


class _OutLock:
    """One regeneration per output dir: an flock the kernel drops when its holder dies."""

    def __init__(self, out: Path):
        self.path = out / LOCK_FILE
        self.handle: IO[str] | None = None

    def __enter__(self) -> _OutLock:
        import fcntl

        self.path.parent.mkdir(mode=PRIVATE_DIR, parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0), PRIVATE_FILE)
        handle = os.fdopen(fd, "r+")
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.seek(0)
            holder = handle.read().strip() or "?"
            handle.close()
            raise DataError(f"another `data regenerate` (pid {holder}) is writing {self.path.parent}; wait for it or stop it. Nothing was changed.") from None
        handle.seek(0)
        handle.truncate()
        handle.write(str(os.getpid()))
        handle.flush()
        self.handle = handle
        return self

    def __exit__(self, *_exc) -> None:
        if self.handle is not None:
            self.handle.close()


def _finalize(out: Path, source: Path, meta: dict, order: list[str], complete: bool = True) -> None:
    """Rewrite each split in source order (so equal settings give equal files, however the work was batched or
    interrupted), copy the eval prompts, and mark the dir finalized, and complete when no conversation is pending (last).
    A finalized, incomplete dir (cut by --max-seconds) is readable data; the same command resumes and re-finalizes it."""

    position = {key: i for i, key in enumerate(order)}
    counts: dict[str, int] = {}
    for split in SPLITS:
        path = out / SPLIT_FILES[split]
        records = sorted(read_done_lines(path), key=lambda r: position[r["key"]])
        write_atomic(path, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records), mode=PRIVATE_FILE)
        counts[split] = len(records)
    eval_file = source / SPLIT_FILES["eval"]
    if eval_file.is_file():
        write_atomic(out / SPLIT_FILES["eval"], eval_file.read_bytes(), mode=PRIVATE_FILE)
    meta["counts"] |= counts | {"skipped": len(read_done_lines(out / SKIPPED_FILE))}
    meta["complete"] = complete
    meta["finalized"] = True
    meta["splits"] = {split: {"file": SPLIT_FILES[split], "count": counts[split], "sha256": file_sha256(out / SPLIT_FILES[split])} for split in SPLITS}
    _write_meta(out, meta)


def _finished_lines(path: Path) -> list[dict]:
    """A finalized regeneration's lines, read only (read_done_lines would truncate a cut last line: not ours to change)."""
    if not path.is_file():
        return []
    rows = []
    # split at "\n" only: str.splitlines() also breaks at U+2028 and U+0085, which json.dumps(ensure_ascii=False) leaves raw
    for number, line in enumerate(path.read_text(encoding="utf-8").split("\n"), 1):
        if not line:
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            raise DataError(f"--reuse: {path} line {number} is not JSON; not a regeneration's output. Nothing was written.") from None
    return rows


def _take_reused(pending: list[Job], answers: dict[bytes, dict], writers: dict[str, LineAppender]) -> tuple[list[Job], int]:
    """Write the reused conversations under this run's keys (each line appended whole: a kill here resumes);
    returns the jobs still to generate and how many were reused."""
    left, reused = [], 0
    for job in pending:
        found = answers.get(content_digest(job.source))
        if found is None:
            left.append(job)
            continue
        if "skipped" in found:
            writers["skipped"].append({"key": job.key, "reason": found["skipped"]})
        else:
            row = {"key": job.key} | ({"id": job.id} if job.id is not None else {})
            writers[job.key.split(":")[0]].append(row | {k: v for k, v in found.items() if k not in ("key", "id")})
        reused += 1
    return left, reused


def _progress(done: int, total: int, resumed: int, started: float, tokens: int, answers: tuple[int, int] = (0, 0), width: int = 20) -> str:
    """e.g. "regenerate [########------------] 80/200 conversations 40% (30 from an earlier run)  25,092 tokens, 612 tok/s  41 s, ~62 s left".

    The time left is counted in answers (answers=(generated, still to come) this run), not in finished conversations: a
    batch finishes its conversations together and a 2-answer one needs two batches (an H200 resume of 1,258
    conversations said "~26135 s left" after its first batch, with 1 finished, and ended 13 s later)."""
    elapsed = time.monotonic() - started
    fraction = done / max(1, total)
    filled = int(round(fraction * width))
    generated, to_come = answers
    left = f", ~{elapsed / generated * to_come:.0f} s left" if generated > 0 and to_come > 0 and done < total else ""
    earlier = f" ({resumed} from an earlier run)" if resumed else ""
    rate = f"  {tokens:,} tokens, {tokens / elapsed:.0f} tok/s" if elapsed > 0 and tokens else ""
    return f"regenerate [{'#' * filled}{'-' * (width - filled)}] {done}/{total} conversations {100 * fraction:3.0f}%{earlier}{rate}  {elapsed:.0f} s{left}"


def fit_prompts_to_positions(settings: RegenerateSettings, target, explicit: bool, log: Log = _stderr) -> RegenerateSettings:
    """A prompt budget whose answers stay within the target's positions (prompt + new tokens <= max_position_embeddings):
    past them an answer is the model's extrapolation, not its answer, and transformers only warns. The default (the
    profile's seq_len) is lowered to fit and says so; a --max-prompt-tokens that does not fit is refused."""
    positions = getattr(target.model.config, "max_position_embeddings", None)
    if not isinstance(positions, int) or settings.max_prompt_tokens + settings.sampling.max_new_tokens <= positions:
        return settings
    room = positions - settings.sampling.max_new_tokens
    asked = f"--max-prompt-tokens {settings.max_prompt_tokens}" if explicit else f"the profile's seq_len {settings.max_prompt_tokens}"
    if explicit or room < 1:
        fix = f"pass --max-prompt-tokens {room} or less" if room >= 1 else "pass a --max-new-tokens below it"
        raise DataError(
            f"{asked} + --max-new-tokens {settings.sampling.max_new_tokens} exceeds the target's {positions} positions "
            f"(max_position_embeddings): answers past them are not the model's own; {fix}. Nothing was written."
        )
    log(f"regenerate: prompts of at most {room} tokens ({asked} + {settings.sampling.max_new_tokens} new tokens would pass the target's {positions} positions)")
    return dataclasses.replace(settings, max_prompt_tokens=room)


def regenerate(target, settings: RegenerateSettings, template_name: str, template: str, dtype: str, device: str, log: Log = _stderr) -> dict:
    """Regenerate every conversation of settings.source into settings.out; returns the final regenerate.json."""
    settings.sampling.check()
    if settings.batch_size <= 0 or settings.max_prompt_tokens <= 0:
        raise DataError("--batch-size and --max-prompt-tokens must be positive. Nothing was written.")
    static = settings.static_batches()
    settings = dataclasses.replace(settings, source=settings.source.expanduser(), out=settings.out.expanduser())
    source, out = settings.source, settings.out
    identity = _identity(settings, target, template_name, template, dtype)
    stop_ids = stop_token_ids(target)
    tokenizer = target.tokenizer
    reused_answers = reusable_answers(settings.reuse, settings.reuse_source, identity) if settings.reuse else {}
    with _OutLock(out):
        meta = _open_out(out, identity)
        done = {r["key"] for split in SPLITS for r in read_done_lines(out / SPLIT_FILES[split])} | {r["key"] for r in read_done_lines(out / SKIPPED_FILE)}
        jobs = list(source_jobs(source, {"train": settings.limit, "val": settings.val_limit}, settings.sampling.seed))
        order = [job.key for job in jobs]
        pending = [job for job in jobs if job.key not in done]
        resumed = len(jobs) - len(pending)
        if meta.get("complete") and not pending:
            log(f"regenerate: {out} is complete ({len(jobs)} conversations); nothing to do")
            return meta
        log(
            f"regenerate: {len(pending)} of {len(jobs)} conversations to do{f' ({resumed} done by an earlier run)' if resumed else ''}; "
            f"batch {settings.batch_size}{', one static cache' if static else ''}, {'greedy' if settings.sampling.temperature <= 0 else f'temperature {settings.sampling.temperature}, top-p {settings.sampling.top_p}'}, "
            f"at most {settings.sampling.max_new_tokens} new tokens per answer, on {device}"
        )
        if meta.get("finalized"):  # appending again: readers refuse the dir until it is finalized anew (a kill leaves it refused)
            meta.update(finalized=False, complete=False)
            _write_meta(out, meta)
        writers = {split: LineAppender(out / SPLIT_FILES[split]) for split in SPLITS} | {"skipped": LineAppender(out / SKIPPED_FILE)}
        if reused_answers:
            pending, reused = _take_reused(pending, reused_answers, writers)
            resumed += reused
            meta["reused"] = int(meta.get("reused", 0)) + reused
            log(f"regenerate: {reused} of them answered by --reuse {settings.reuse} (the same source conversation, target and settings); {len(pending)} left")
        started, last_report, generated = time.monotonic(), 0.0, 0
        answered, to_come = 0, sum(job.answers_to_come(settings.max_answers) for job in pending)  # this run's answers: the time left
        prompt_tokens = padded_tokens = 0  # the prompts' own tokens, and what their left-padded batches held
        repeated = 0  # answer tokens that repeat an earlier 8-gram of their answer: the target's loops
        finished = resumed

        def render(messages: list[dict]) -> list[int]:
            return template_ids(tokenizer, messages, True, template)

        def finish(job: Job) -> None:
            nonlocal finished, last_report, to_come
            to_come -= job.answers_to_come(settings.max_answers)  # a cut conversation's later answers never come (else 0 are left)
            if job.tokens:
                writers[job.key.split(":")[0]].append(job.record())
            else:
                writers["skipped"].append({"key": job.key, "reason": job.cut or "no answer"})
            finished += 1
            now = time.monotonic()
            if now - last_report >= settings.progress_seconds or finished == len(jobs):
                last_report = now
                log(_progress(finished, len(jobs), resumed, started, generated, answers=(answered, to_come)))

        try:
            queue = iter(pending)
            waiting = LengthGroupedQueue(settings.batch_size, settings.window)
            deadline = None if settings.max_seconds is None else started + settings.max_seconds
            while True:
                if deadline is not None and time.monotonic() >= deadline:
                    for cut, _prompt in waiting.drain():  # one with an answer ends there; one without is left for a resume
                        if cut.tokens:
                            cut.cut = f"--max-seconds {settings.max_seconds:g} reached"
                            finish(cut)
                    break
                while waiting.room() > 0:
                    job = next(queue, None)
                    if job is None:
                        break
                    prompt = job.next_prompt(render, settings.max_prompt_tokens, settings.max_answers)
                    if prompt is None:
                        finish(job)
                    else:
                        waiting.add(job, prompt)
                if not len(waiting):
                    break
                active = waiting.next_batch()
                prompt_tokens += sum(len(p) for _, p in active)
                padded_tokens += static.rows * static.prompt_width if static else padded_prompt_tokens([p for _, p in active])
                results = generate_batch(target, [p for _, p in active], [j.rng for j, _ in active], settings.sampling, stop_ids, static)
                generated += sum(len(ids) + (why == "eos") for ids, why in results)  # before any row finishes: progress counts the batch
                repeated += sum(sum(repeated_positions(ids)) for ids, _why in results)
                answered, to_come = answered + len(active), to_come - len(active)
                for (job, _prompt), (ids, why) in zip(active, results):
                    job.answer(tokenizer.decode(ids, skip_special_tokens=True), len(ids), why)
                    prompt = job.next_prompt(render, settings.max_prompt_tokens, settings.max_answers)
                    if prompt is None:
                        finish(job)
                    else:
                        waiting.add(job, prompt)
        finally:
            for writer in writers.values():
                writer.close()
            meta["runs"] = list(meta.get("runs", [])) + [
                {
                    "device": device,
                    "batch_size": settings.batch_size,
                    "cache": settings.cache,
                    "conversations": finished - resumed,
                    "tokens": generated,
                    "repeated_tokens": repeated,
                    "prompt_tokens": prompt_tokens,
                    "padded_prompt_tokens": padded_tokens,
                    "seconds": round(time.monotonic() - started, 3),
                    "ended": time.time(),
                }
            ]
            meta["counts"] = {"done": finished, "total": len(jobs)}
            _write_meta(out, meta)
        left = len(jobs) - finished
        _finalize(out, source, meta, order, complete=left == 0)
        log(
            f"regenerate: wrote {out}: train {meta['counts']['train']}, val {meta['counts']['val']}, skipped {meta['counts']['skipped']} "
            f"({generated} tokens in {time.monotonic() - started:.1f} s"
            + (f"; prompts filled {prompt_tokens / padded_tokens:.0%} of their padded batches" if padded_tokens else "")
            + (f"; {repeated / generated:.0%} of the answer tokens repeat an earlier 8-gram of their answer (loops)" if generated else "")
            + ")"
            + (f"; --max-seconds {settings.max_seconds:g} reached with {left} conversations not started: the same command does them" if left else "")
        )
        return meta
