"""SGLang's speculative settings (draft steps, top-k, draft tokens): which it runs, and the rows a verify holds."""

from __future__ import annotations

from dataclasses import dataclass


def verify_width(num_steps: int, topk: int = 1, num_draft_tokens: int | None = None, branches: int = 1) -> int:
    """Tokens one verify step holds: a tree's num_draft_tokens (SGLang's num_steps + 1 where none is given), a chain's
    last emitted token and num_steps proposals per first-step branch."""
    if topk > 1:
        return num_draft_tokens or num_steps + 1
    return 1 + branches * num_steps


@dataclass(frozen=True)
class TreeSetting:
    """SGLang's three speculative settings: draft steps (tree depth), branching per step, tokens verified per round
    (the root included)."""

    num_steps: int
    topk: int
    num_draft_tokens: int

    def __post_init__(self) -> None:
        if self.num_steps < 1 or self.topk < 1:
            raise ValueError(f"setting {self.label}: num_steps and topk must be at least 1")
        if self.topk == 1 and self.num_draft_tokens != self.num_steps + 1:
            raise ValueError(
                f"setting {self.label}: at topk 1 SGLang verifies num_steps + 1 = {self.num_steps + 1} tokens (it adjusts num_draft_tokens to that)"
            )
        if not 2 <= self.num_draft_tokens <= self.candidates + 1:
            raise ValueError(
                f"setting {self.label}: num_draft_tokens must be between 2 and {self.candidates + 1} "
                f"(the root and the {self.candidates} candidates of {self.num_steps} steps at topk {self.topk})"
            )

    @classmethod
    def served(cls, num_steps: int, topk: int = 1, num_draft_tokens: int | None = None) -> TreeSetting:
        """The setting a server runs from its flags: no draft-token count means SGLang's num_steps + 1."""
        return cls(num_steps, topk, num_draft_tokens or num_steps + 1)

    @classmethod
    def parse(cls, text: str) -> TreeSetting:
        """STEPS,TOPK,TOKENS (SpecForge's bench_eagle3 --config-list order, without the batch size), or STEPS,1
        for a chain."""
        parts = text.split(",")
        try:
            values = [int(part) for part in parts]
        except ValueError:
            values = []
        if len(values) == 2 and values[1] == 1:
            values.append(values[0] + 1)
        if len(values) != 3:
            raise ValueError(f"setting {text!r}: expected STEPS,TOPK,TOKENS (e.g. 3,4,8) or STEPS,1 for a chain")
        return cls(*values)

    @property
    def label(self) -> str:
        return f"{self.num_steps},{self.topk},{self.num_draft_tokens}"

    @property
    def candidates(self) -> int:
        """Draft tokens scored per round, before the best num_draft_tokens - 1 are kept."""
        return self.topk + (self.num_steps - 1) * self.topk**2
