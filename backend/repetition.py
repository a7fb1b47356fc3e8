"""Loops in generated text: which tokens or words repeat an earlier n-gram of their own answer."""

from __future__ import annotations

from typing import Any, Sequence

REPEAT_NGRAM = 8  # an item repeats when the 8 ending at it occurred earlier in the same answer


def repeated_positions(items: Sequence[Any], n: int = REPEAT_NGRAM) -> list[bool]:
    """Per item (token or word): whether the n-gram ending at it occurred earlier in the answer. A loop or a copied
    passage is what any draft predicts; a small target decoded greedily falls into loops in long answers (SmolLM2-135M:
    92 % of the tokens from 256 on, docs/real-model.md), and accept length then measures the loops."""
    seen: set[tuple[Any, ...]] = set()
    repeated = []
    for i in range(len(items)):
        gram = tuple(items[i - n + 1 : i + 1]) if i >= n - 1 else None
        repeated.append(gram is not None and gram in seen)
        if gram is not None:
            seen.add(gram)
    return repeated
