"""Prompt sets (the shipped default beside this file, JSONL files of prompts, chats or texts) and what a server admits."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DEFAULT_PROMPTS = Path(__file__).resolve().parent / "prompts.jsonl"


class PromptFileError(ValueError):
    """A prompt file that cannot be read or has no usable prompt."""


@dataclass
class PromptSet:
    prompts: list[str]
    source: str
    sha256: str

    def describe(self) -> dict[str, Any]:
        return {"source": self.source, "count": len(self.prompts), "sha256": self.sha256}


def _prompt_of(record: Any) -> str | None:
    if isinstance(record, str):
        return record
    if not isinstance(record, dict):
        return None
    for key in ("prompt", "text"):
        if isinstance(record.get(key), str):
            return record[key]
    turns = record.get("conversations") or record.get("messages")
    if isinstance(turns, list):  # SpecForge {"role","content"} or ShareGPT {"from","value"}: first user turn
        for turn in turns:
            if isinstance(turn, dict) and (turn.get("role") or turn.get("from")) in ("user", "human"):
                content = turn.get("content", turn.get("value"))
                if isinstance(content, str):
                    return content
    return None


def load_prompts(path: str | Path | None = None, tag: str | None = None, limit: int | None = None) -> PromptSet:
    """JSONL with {"prompt"} / {"text"} / {"conversations"} per line; the shipped default set when path is None."""
    source = Path(path) if path else DEFAULT_PROMPTS
    try:
        lines = source.read_text(encoding="utf-8").split("\n")  # not splitlines(): a prompt may hold U+2028 or U+0085
    except (OSError, UnicodeDecodeError) as exc:
        raise PromptFileError(f"cannot read prompt file {source}: {exc}") from None
    prompts = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise PromptFileError(f"{source}:{number}: not JSON ({exc.msg})") from None
        tags = (record.get("tags") or []) if isinstance(record, dict) else []
        if tag and tag not in tags:
            continue
        prompt = _prompt_of(record)
        if prompt is None:
            raise PromptFileError(f"{source}:{number}: no 'prompt', 'text' or user turn in 'conversations'")
        prompts.append(prompt)
    if limit:
        prompts = prompts[:limit]
    if not prompts:
        raise PromptFileError(f"{source}: no prompts" + (f" tagged {tag!r}" if tag else ""))
    digest = hashlib.sha256(json.dumps(prompts).encode()).hexdigest()
    return PromptSet(prompts, str(source) + (f" [tag {tag}]" if tag else ""), digest)


@dataclass(frozen=True)
class PromptFit:
    """What a server admits: prompt tokens + max_new_tokens <= its context length (SGLang and the reference server
    answer a longer request with HTTP 400)."""

    context_len: int
    max_new_tokens: int

    def admits(self, prompt_tokens: int) -> bool:
        return prompt_tokens + self.max_new_tokens <= self.context_len

    def describe(self, skipped: int) -> str:
        return f"{skipped} longer than the server's {self.context_len}-token context less {self.max_new_tokens} new tokens skipped"


def served_prompt_fit(url: str, max_new_tokens: int) -> PromptFit | None:
    """The fit of a running server from GET /v1/models (`max_model_len`: SGLang's model card and ours); None when it
    does not say, and then prompts are taken as they come."""
    from backend.serve import http  # here: every `eagle3-host` command imports this module, few ask a server

    reply = http.get(f"{url}/v1/models", timeout=30)
    cards = reply.body.get("data") if reply.ok and isinstance(reply.body, dict) else None
    length = cards[0].get("max_model_len") if isinstance(cards, list) and cards and isinstance(cards[0], dict) else None
    return PromptFit(length, max_new_tokens) if isinstance(length, int) and not isinstance(length, bool) and length > 0 else None


def admitted(prompts: PromptSet, count_tokens, fit: PromptFit) -> tuple[PromptSet, int]:
    """(the prompts `fit` admits, counted by `count_tokens` as the server encodes a request's text, how many it did not)."""
    kept = [prompt for prompt in prompts.prompts if fit.admits(count_tokens(prompt))]
    skipped = len(prompts.prompts) - len(kept)
    if not skipped:
        return prompts, 0
    digest = hashlib.sha256(json.dumps(kept).encode()).hexdigest()
    return PromptSet(kept, f"{prompts.source} [{fit.describe(skipped)}]", digest), skipped
