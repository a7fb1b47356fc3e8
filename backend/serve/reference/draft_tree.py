"""SGLang's EAGLE tree drafting (steps x top-k, the best draft tokens by score), replayed on a known greedy output.

Which `--speculative-num-steps / --speculative-eagle-topk / --speculative-num-draft-tokens` suit a draft is a question
about its accept length at each setting, and greedy verification makes that a pure function of the draft and the
target's greedy output: every setting commits the same tokens, only the rounds differ. So one plain decode of a prompt
and one teacher-forced target pass over it give the draft's inputs for every round of every setting (the target's
features of the committed rows), and each setting's rounds are replayed with the draft alone.

The tree is built as SGLang's EAGLE worker builds it (sglang/srt/speculative/eagle_utils.py `select_top_k_tokens`,
`organize_draft_results`, read in its source; none of it copied): step 0 takes the draft's top-k tokens at the last
committed row, scored by their probability; each further step runs the draft once over the k beams, expands each beam
by its top-k children (score: the parent's score times the child's probability) and keeps the best k of the k x k as
the next beams; when num_steps levels exist, the num_draft_tokens - 1 best candidates of all levels (k + (steps - 1) x
k^2 of them) are verified with the last emitted token as the root. SGLang keeps one KV lane per beam slot: beam j of a
step attends over the committed rows and lane j's earlier draft rows, whichever beam its parent was; so does this.
Greedy verification walks from the root to the child holding the target's next greedy token, as deep as it goes.
At top-k 1 the tree is the chain SpecDecoder drafts, and the replay's rounds are SpecDecoder.generate's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from backend.serve.reference.spec_decode import GenerateResult, SpecDecoder
from backend.serve.reference.static_tree import DETACHED, ROOT, grow_tree
from backend.serve.spec_setting import TreeSetting
from backend.train.draft import DraftKVCache, Eagle3Draft

__all__ = ["DETACHED", "ROOT", "DraftTree", "draft_tree", "greedy_rows", "replay"]


@dataclass
class DraftTree:
    """A round's verified draft tokens in SGLang's order (level by level, as the candidates were made)."""

    tokens: list[int]  # target token ids
    parents: list[int]  # each node's parent node index, ROOT or DETACHED
    scores: list[float]  # the product of the draft's probabilities along the node's path

    def accepted(self, continuation: Sequence[int]) -> int:
        """The nodes greedy verification accepts against the target's greedy continuation after the root."""
        node, depth = ROOT, 0
        while depth < len(continuation):
            child = next((c for c, p in enumerate(self.parents) if p == node and self.tokens[c] == continuation[depth]), None)
            if child is None:
                break
            node, depth = child, depth + 1
        return depth


@torch.no_grad()
def draft_tree(draft: Eagle3Draft, last_out: torch.Tensor, last_logits: torch.Tensor, cache: DraftKVCache, setting: TreeSetting) -> DraftTree:
    """The tree of one round, after `draft.extend` committed the new rows into `cache`: last_out [1, 1, H] and
    last_logits [1, Vd] are its last row's output state and logits. `cache` is left as extend left it (the beams
    run in lanes of their own)."""
    topk = setting.topk
    lanes = _lanes(cache, topk)

    def chained(_index: int, draft_ids: torch.Tensor, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out, logits = draft.draft_step(hidden, draft.draft_to_target_ids(draft_ids).view(topk, 1), lanes)
        return out, logits[:, -1]

    hidden = last_out.expand(topk, -1, -1)  # the beams along the batch
    _, ids, parents, scores = grow_tree(last_logits[0], hidden, chained, setting.num_steps, topk, setting.num_draft_tokens - 1, beam_axis=0)
    return DraftTree(tokens=draft.draft_to_target_ids(ids).tolist(), parents=parents.tolist(), scores=scores.tolist())


def _lanes(cache: DraftKVCache, lanes: int) -> DraftKVCache:
    """A round's cache for `lanes` beams: the committed K/V shared (expanded, not copied), no draft rows yet."""
    if cache.keys is None or cache.values is None:
        raise RuntimeError("draft_tree before extend: the draft cache holds no committed positions; nothing was drafted")
    beams = DraftKVCache()
    beams.keys = cache.keys.expand(lanes, -1, -1, -1)
    beams.values = cache.values.expand(lanes, -1, -1, -1)
    return beams


@torch.no_grad()
def replay(draft: Eagle3Draft, features: torch.Tensor, sequence: Sequence[int], prompt_len: int, max_new_tokens: int, setting: TreeSetting) -> GenerateResult:
    """The rounds SGLang would run at `setting` to emit `max_new_tokens` tokens of `sequence` after its first
    `prompt_len` (the target's greedy output, ignoring end of turn, with at least num_steps - 1 tokens more than it
    emits: a round may verify past the last one). features [1, len(sequence), F]: the target's features of every row
    (one teacher-forced pass). Counts as SpecDecoder.generate counts (the prefill token included)."""
    sequence = list(sequence)
    needed = prompt_len + max_new_tokens + setting.num_steps - 1
    if len(sequence) < needed or features.shape[1] < needed:
        raise ValueError(
            f"replay of {max_new_tokens} tokens at {setting.num_steps} steps needs {needed} rows of sequence and features, "
            f"got {len(sequence)} and {features.shape[1]}"
        )
    device = draft.fc.weight.device
    hidden = draft.input_hidden(features.to(device=device, dtype=draft.fc.weight.dtype))
    ids = torch.as_tensor(sequence, dtype=torch.long, device=device).view(1, -1)
    result = GenerateResult(output_ids=[], completion_tokens=min(1, max_new_tokens), verify_ct=0, num_steps=setting.num_steps)
    cache, start, end = DraftKVCache(), 0, prompt_len  # the rows [start, end) join the draft's cache next
    while result.completion_tokens < max_new_tokens:
        out, logits = draft.extend(hidden[:, start:end], ids[:, start + 1 : end + 1], cache)
        tree = draft_tree(draft, out[:, -1:], logits[:, -1], cache, setting)
        emitted = prompt_len + result.completion_tokens
        accepted = tree.accepted(sequence[emitted : emitted + setting.num_steps])
        result.verify_ct += 1
        result.accepted_per_round.append(accepted)
        result.completion_tokens = min(max_new_tokens, result.completion_tokens + accepted + 1)
        start, end = end, end + accepted + 1
    result.output_ids = list(sequence[prompt_len : prompt_len + result.completion_tokens])
    return result


@torch.no_grad()
def greedy_rows(decoder: SpecDecoder, prompt: Sequence[int], tokens: int) -> tuple[list[int], torch.Tensor]:
    """prompt + the target's next `tokens` greedy tokens (plain decoding under the decoder's stop rules: build it
    with an end-of-turn id no token has to get them all), and the target's features of every row, from one pass."""
    output = decoder.plain(list(prompt), tokens).output_ids
    sequence = list(prompt) + output
    _, hidden_states, _ = decoder.target.forward(torch.tensor([sequence], device=decoder.target.device), None)
    return sequence, decoder.features(hidden_states)
