"""Reference EAGLE-3 speculative decoder (chain drafting, greedy verification, SGLang-style acceptance counts) and plain greedy decoding."""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field

import torch

from backend.train.draft import DraftKVCache, Eagle3Draft

FEEDS = ("aux", "last_hidden")
NO_DRAFT = "this decoder was built without a draft: only plain / plain_generate are available"
NO_EOS = -1  # an end-of-turn id no tokenizer emits: a decoder built with it decodes every token it is asked for


@dataclass
class GenerateResult:
    output_ids: list[int]
    completion_tokens: int  # every emitted token, the prefill token included (SGLang's completion_tokens)
    verify_ct: int  # target verify forwards (SGLang's spec_verify_ct)
    accepted_per_round: list[int] = field(default_factory=list)  # accepted draft tokens per verify, bonus excluded
    feature_width: int = 0
    feature_source: str = ""
    fc_applied: bool = True
    num_steps: int = 0

    @property
    def accept_length(self) -> float:
        """completion_tokens / verify_ct, as EAGLE and SGLang report it (1 + 1/verify_ct when nothing is accepted)."""
        return self.completion_tokens / self.verify_ct if self.verify_ct else 1.0

    @property
    def num_correct_drafts(self) -> int:
        return sum(self.accepted_per_round)

    def as_dict(self) -> dict:
        return {
            "output_ids": self.output_ids,
            "completion_tokens": self.completion_tokens,
            "verify_ct": self.verify_ct,
            "accept_length": self.accept_length,
            "accepted_per_round": self.accepted_per_round,
            "num_correct_drafts": self.num_correct_drafts,
            "num_steps": self.num_steps,
            "feature_width": self.feature_width,
            "feature_source": self.feature_source,
            "fc_applied": self.fc_applied,
        }


class TargetRunner:
    """KV-cached forwards of a transformers causal LM, returning logits and all hidden states."""

    def __init__(self, model):
        self.model = model
        params = inspect.signature(model.forward).parameters
        self.cache_kwarg = "cache" if "cache" in params else "past_key_values"  # transformers >= 5.24 renamed it
        self.num_layers = model.config.num_hidden_layers

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def forward(self, input_ids: torch.Tensor, cache, hidden_states: bool = True):
        out = self.model(input_ids=input_ids, use_cache=True, output_hidden_states=hidden_states, **{self.cache_kwarg: cache})
        new_cache = getattr(out, "cache", None)
        if new_cache is None:
            new_cache = out.past_key_values
        return out.logits, out.hidden_states, new_cache

    @staticmethod
    def drop_last(cache, count: int) -> None:
        """Remove the last `count` positions (transformers 4.x and 5.x both take a negative count)."""
        if count > 0:
            cache.crop(-count)


def eos_ids(model, eos_token_id) -> set[int]:
    value = eos_token_id if eos_token_id is not None else getattr(model.config, "eos_token_id", None)
    if value is None:
        return set()
    return {int(v) for v in value} if isinstance(value, (list, tuple, set)) else {int(value)}


class SpecDecoder:
    """EAGLE-3 chain speculative decoding (topk 1) of `target_model` with `draft`, batch size 1.

    feed="aux": the draft reads the concatenated outputs of `aux_layer_ids` (hf hidden_states[L + 1]).
    feed="last_hidden": reproduces SGLang's silent failure: the target's final normed hidden state goes to
    the draft, and fc is skipped when its width equals the draft hidden size (llama_eagle3.py's check).
    draft=None (with aux_layer_ids given) builds a decoder that only runs plain / plain_generate.
    """

    def __init__(
        self,
        target_model,
        draft: Eagle3Draft | None,
        aux_layer_ids: list[int] | None = None,
        num_steps: int = 5,
        feed: str = "aux",
        eos_token_id: int | list[int] | None = None,
    ):
        if feed not in FEEDS:
            raise ValueError(f"feed {feed!r} is unknown; choose one of {', '.join(FEEDS)}")
        if num_steps < 1:
            raise ValueError(f"num_steps must be >= 1, got {num_steps}")
        self.target = TargetRunner(target_model)
        self.draft = draft
        if aux_layer_ids is None:
            if draft is None:
                raise ValueError("aux_layer_ids is required when no draft is given")
            aux_layer_ids = draft.config.aux_layer_ids
        self.aux_layer_ids = list(aux_layer_ids)
        last = self.target.num_layers - 2  # hidden_states[N] is already final-normed
        bad = [layer for layer in self.aux_layer_ids if not 0 <= layer <= last]
        if bad:
            raise ValueError(f"aux layer ids {bad} are outside 0..{last} for a {self.target.num_layers}-layer target (output-of-layer convention)")
        self.num_steps = num_steps
        self.feed = feed
        self.eos = eos_ids(target_model, eos_token_id)

    # --- features the draft reads --------------------------------------------------------------------

    def features(self, hidden_states) -> torch.Tensor:
        if self.feed == "aux":
            return torch.cat([hidden_states[layer + 1] for layer in self.aux_layer_ids], dim=-1)
        return hidden_states[-1]

    @property
    def feature_source(self) -> str:
        return f"aux_layers {self.aux_layer_ids}" if self.feed == "aux" else "final_hidden"

    @property
    def _required_draft(self) -> Eagle3Draft:
        """The draft the speculative path runs; a decoder built without one refuses it."""
        if self.draft is None:
            raise ValueError(NO_DRAFT)
        return self.draft

    def _draft_input(self, features: torch.Tensor) -> torch.Tensor:
        draft = self._required_draft
        features = features.to(draft.fc.weight.dtype)
        return draft.input_hidden(features, sglang_width_check=self.feed == "last_hidden")

    def _fc_applied(self, width: int) -> bool:
        return self.feed == "aux" or width != self._required_draft.config.hidden_size

    # --- decoding --------------------------------------------------------------------------------------

    def _prompt(self, input_ids) -> torch.Tensor:
        ids = torch.as_tensor(input_ids, dtype=torch.long, device=self.target.device)
        ids = ids.view(1, -1) if ids.dim() == 1 else ids
        if ids.shape[0] != 1 or ids.shape[1] == 0:
            raise ValueError(f"the reference decoder takes one non-empty prompt, got input_ids of shape {tuple(ids.shape)}")
        return ids

    @torch.no_grad()
    def plain(self, input_ids, max_new_tokens: int) -> GenerateResult:
        """Plain KV-cached greedy decoding of the target, one emission per token, under the same stop rules (_done)."""
        ids = self._prompt(input_ids)
        logits, _, cache = self.target.forward(ids, None, hidden_states=False)
        result = GenerateResult(output_ids=[], completion_tokens=0, verify_ct=0)
        while not self._done(result, max_new_tokens):
            token = int(logits[0, -1].argmax())
            self._emit(result, [token], max_new_tokens)
            if self._done(result, max_new_tokens):
                break
            logits, _, cache = self.target.forward(torch.tensor([[token]], device=ids.device), cache, hidden_states=False)
        return result

    def plain_generate(self, input_ids, max_new_tokens: int) -> list[int]:
        """The token ids of plain() (stops at max_new_tokens or eos)."""
        return self.plain(input_ids, max_new_tokens).output_ids

    @torch.no_grad()
    def generate(self, input_ids, max_new_tokens: int) -> GenerateResult:
        """Speculative greedy decoding; the output equals plain_generate token for token."""
        if self.draft is None:
            raise ValueError(NO_DRAFT)
        ids = self._prompt(input_ids)
        logits, hidden_states, cache = self.target.forward(ids, None)
        features = self.features(hidden_states)
        result = self._speculative_result(features)
        if max_new_tokens <= 0:
            return result
        last = logits[0, -1].argmax().view(1)
        self._emit(result, [int(last)])
        draft_cache = DraftKVCache()
        # committed draft positions t pair the target's features at t with token t+1
        pending_hidden = self._draft_input(features)
        pending_tokens = torch.cat([ids[0, 1:], last]).view(1, -1)
        while not self._done(result, max_new_tokens):
            proposals = self._propose(pending_hidden, pending_tokens, draft_cache)
            verify_ids = torch.cat([last, proposals]).view(1, -1)
            logits, hidden_states, cache = self.target.forward(verify_ids, cache)
            greedy = logits[0].argmax(-1)
            accepted = _matching_prefix(proposals, greedy)
            result.verify_ct += 1
            result.accepted_per_round.append(accepted)
            emitted = greedy[: accepted + 1]  # accepted proposals equal greedy there; then the bonus token
            self._emit(result, emitted.tolist(), max_new_tokens)
            self.target.drop_last(cache, self.num_steps - accepted)
            pending_hidden = self._draft_input(self.features(hidden_states)[:, : accepted + 1])
            pending_tokens = emitted.view(1, -1)
            last = emitted[-1:].clone()
        return result

    def _speculative_result(self, features: torch.Tensor) -> GenerateResult:
        """An empty result of a speculative run whose draft reads `features` (their width and source recorded)."""
        return GenerateResult(
            output_ids=[],
            completion_tokens=0,
            verify_ct=0,
            feature_width=features.shape[-1],
            feature_source=self.feature_source,
            fc_applied=self._fc_applied(features.shape[-1]),
            num_steps=self.num_steps,
        )

    def _propose(self, hidden: torch.Tensor, next_tokens: torch.Tensor, cache: DraftKVCache) -> torch.Tensor:
        """Commit the new positions to the draft's KV, then chain `num_steps` greedy draft tokens (target ids)."""
        draft = self._required_draft
        out, logits = draft.extend(hidden, next_tokens, cache)
        out, logits = out[:, -1:], logits[:, -1]
        proposals = []
        for step in range(self.num_steps):
            token = draft.draft_to_target_ids(logits.argmax(-1))
            proposals.append(token)
            if step + 1 < self.num_steps:
                out, logits = draft.draft_step(out, token.view(1, 1), cache)
                logits = logits[:, -1]
        return torch.cat(proposals)

    def _emit(self, result: GenerateResult, tokens: list[int], max_new_tokens: int | None = None) -> None:
        for token in tokens:
            if max_new_tokens is not None and self._done(result, max_new_tokens):
                return
            result.output_ids.append(token)
            result.completion_tokens += 1

    def _done(self, result: GenerateResult, max_new_tokens: int) -> bool:
        if result.completion_tokens >= max_new_tokens:
            return True
        return bool(result.output_ids) and result.output_ids[-1] in self.eos


def _matching_prefix(proposals: torch.Tensor, greedy: torch.Tensor) -> int:
    matches = (proposals == greedy[: proposals.numel()]).long()
    return int(matches.cumprod(0).sum())
