"""Prompt sets: the shipped default (prompts.jsonl beside this file) and JSONL files of prompts, chats or texts."""

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
