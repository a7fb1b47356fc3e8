"""SGLang's tree drafting replayed: the tree each setting verifies, and rounds equal to the decoder's at top-k 1."""

import math

import pytest
import torch

from backend.serve.reference.draft_tree import DETACHED, DraftTree, draft_tree, greedy_rows, replay
from backend.serve.reference.spec_decode import NO_EOS, SpecDecoder
from backend.serve.spec_setting import TreeSetting
from backend.train.draft import DraftKVCache, Eagle3Draft
from tests.fixtures.drafts import AUX, VOCAB, draft_config, prompts, random_draft, random_target

pytestmark = pytest.mark.usefixtures("limited_torch_threads")


class ScriptedDraft(Eagle3Draft):
    """The real draft computation, its probabilities replaced by a script: at sequence index i (the token being
    proposed) every lane proposes `table[i]` ({token: probability}), else the true token with certainty."""

    def setup(self, sequence: list[int], table: dict[int, dict[int, float]]):
        self.sequence, self.table = sequence, table
        return self

    def _scripted(self, logits, cache):
        index = cache.length + 1 + len(cache.diag_keys)
        choices = self.table.get(index, {self.sequence[index]: 1.0})
        forced = torch.full_like(logits, -1e4)
        for token, probability in choices.items():
            forced[..., -1, token] = math.log(probability)
        return forced

    def extend(self, hidden, next_tokens, cache):
        out, logits = super().extend(hidden, next_tokens, cache)
        return out, self._scripted(logits, cache)

    def draft_step(self, prev_hidden, token, cache):
        out, logits = super().draft_step(prev_hidden, token, cache)
        return out, self._scripted(logits, cache)


def scripted(target, sequence, table) -> ScriptedDraft:
    torch.manual_seed(1)
    draft = ScriptedDraft(draft_config(draft_vocab_size=VOCAB), init_std=0.3).eval()  # identity d2t
    draft.load_target_embedding(target.get_input_embeddings().weight)
    return draft.setup(sequence, table)


def other(token: int, shift: int = 1) -> int:
    return (token + shift) % VOCAB


def test_the_tree_keeps_the_best_candidates_by_path_probability_and_verification_walks_it():
    """Two steps at top-k 2: level 1 proposes a wrong token (0.6) over the right one (0.3); level 2 the right one
    (0.8) in every lane. Candidates: wrong 0.6, right 0.3, right-under-wrong 0.48, ... right-under-right 0.24."""
    target = random_target()
    sequence = list(range(10, 30))
    p = 5  # the committed rows end at index p - 1: index p is proposed first
    right1, right2 = sequence[p], sequence[p + 1]
    wrong1, spare1, spare2 = other(right1), other(right1, 2), other(right2, 2)
    draft = scripted(target, sequence, {p: {wrong1: 0.6, right1: 0.3, spare1: 0.1}, p + 1: {right2: 0.8, spare2: 0.2}})
    cache = DraftKVCache()
    hidden = torch.randn(1, p - 1, draft.config.hidden_size)
    out, logits = draft.extend(hidden, torch.tensor([sequence[1:p]]), cache)

    def tree(tokens: int) -> DraftTree:
        return draft_tree(draft, out[:, -1:], logits[:, -1], cache, TreeSetting(2, 2, tokens))

    three, four, five = tree(3), tree(4), tree(5)
    assert (three.tokens, three.parents) == ([wrong1, right2], [-1, 0])  # 0.6, 0.48
    assert (four.tokens, four.parents) == ([wrong1, right1, right2], [-1, -1, 0])  # + 0.3
    assert (five.tokens, five.parents) == ([wrong1, right1, right2, right2], [-1, -1, 0, 1])  # + 0.24
    assert five.scores == pytest.approx([0.6, 0.3, 0.48, 0.24])
    continuation = [right1, right2]
    assert [t.accepted(continuation) for t in (three, four, five)] == [0, 1, 2]
    chain = draft_tree(draft, out[:, -1:], logits[:, -1], cache, TreeSetting(2, 1, 3))
    assert (chain.tokens, chain.parents, chain.accepted(continuation)) == ([wrong1, right2], [-1, 0], 0)
    assert cache.diag_keys == [] and cache.length == p - 1  # the beams ran in lanes of their own


def test_beams_keep_the_best_k_children_of_all_beams_and_each_lane_attends_over_its_own_rows():
    """Three steps at top-k 2 with every candidate verified (11 tokens): the level-3 children hang only under the
    two best level-2 nodes, and the lanes' draft rows never reach the committed cache."""
    target = random_target()
    sequence = list(range(40, 60))
    p = 6
    table = {
        p: {sequence[p]: 0.5, other(sequence[p]): 0.4, other(sequence[p], 2): 0.1},
        p + 1: {sequence[p + 1]: 0.7, other(sequence[p + 1]): 0.2, other(sequence[p + 1], 2): 0.1},
        p + 2: {sequence[p + 2]: 0.9, other(sequence[p + 2]): 0.1},
    }
    draft = scripted(target, sequence, table)
    cache = DraftKVCache()
    out, logits = draft.extend(torch.randn(1, p - 1, draft.config.hidden_size), torch.tensor([sequence[1:p]]), cache)
    tree = draft_tree(draft, out[:, -1:], logits[:, -1], cache, TreeSetting(3, 2, 11))
    assert len(tree.tokens) == 10 and DETACHED not in tree.parents
    level2 = [n for n, parent in enumerate(tree.parents) if parent in (0, 1)]
    level3 = [n for n, parent in enumerate(tree.parents) if parent not in (-1, 0, 1)]
    kept = sorted({tree.parents[n] for n in level3})
    best_two = sorted(level2, key=lambda n: -tree.scores[n])[:2]
    assert len(level2) == 4 and len(level3) == 4 and kept == sorted(best_two)
    for node, parent in enumerate(tree.parents):
        if parent >= 0:
            assert tree.scores[node] <= tree.scores[parent]
    assert tree.accepted(sequence[p : p + 3]) == 3
    assert cache.diag_keys == [] and cache.length == p - 1


@pytest.mark.parametrize("num_steps", [1, 3, 5])
def test_at_topk_1_the_replay_has_the_decoders_rounds(num_steps):
    """The same draft, the same target in float64 (teacher-forced and cached features agree to the last bits):
    the replayed chain is SpecDecoder.generate, round for round."""
    target = random_target().double()
    draft = random_draft(target).double()
    decoder = SpecDecoder(target, draft, AUX, num_steps=num_steps, eos_token_id=NO_EOS)
    for prompt in prompts(3, seed=7):
        prompt = prompt.tolist()
        served = decoder.generate(prompt, 40)
        sequence, features = greedy_rows(decoder, prompt, 40 + num_steps - 1)
        replayed = replay(draft, features, sequence, len(prompt), 40, TreeSetting(num_steps, 1, num_steps + 1))
        assert replayed.accepted_per_round == served.accepted_per_round
        assert (replayed.completion_tokens, replayed.verify_ct) == (served.completion_tokens, served.verify_ct)
        assert replayed.output_ids == served.output_ids


def test_a_wider_tree_accepts_what_the_chain_misses_on_the_same_tokens():
    """A draft whose first guess is wrong at some indices (never two within a round) but whose second is right:
    the chain stops there; a top-2 tree verifying every candidate keeps the right path among its beams (its child
    is certain, the wrong one's child too, and 0.45 x 1 beats every other path) and accepts all 3 steps every
    round. Both emit the same tokens."""
    target = random_target()
    decoder = SpecDecoder(target, None, AUX, eos_token_id=NO_EOS)
    prompt = prompts(1, seed=11)[0].tolist()
    sequence, features = greedy_rows(decoder, prompt, 40)
    start = len(prompt)
    misses = {start + i for i in (3, 9, 16, 25)}
    draft = scripted(target, sequence, {i: {other(sequence[i]): 0.55, sequence[i]: 0.45} for i in misses})
    chain = replay(draft, features, sequence, start, 30, TreeSetting(3, 1, 4))
    tree = replay(draft, features, sequence, start, 30, TreeSetting(3, 2, 11))
    assert chain.output_ids == tree.output_ids == sequence[start : start + 30]
    assert chain.completion_tokens == tree.completion_tokens == 30
    assert set(tree.accepted_per_round) == {3} and tree.verify_ct == 8  # 1 + 8 x 4 >= 30
    expected, emitted = [], 1
    while emitted < 30:
        accepted = 0
        while accepted < 3 and start + emitted + accepted not in misses:
            accepted += 1
        expected.append(accepted)
        emitted += accepted + 1
    assert chain.accepted_per_round == expected and min(expected) < 3 and chain.verify_ct > tree.verify_ct


def test_a_sequence_too_short_for_the_last_round_is_refused_before_drafting():
    target = random_target()
    draft = random_draft(target)
    decoder = SpecDecoder(target, draft, AUX, eos_token_id=NO_EOS)
    prompt = prompts(1)[0].tolist()
    sequence, features = greedy_rows(decoder, prompt, 20)
    with pytest.raises(ValueError, match="needs"):
        replay(draft, features, sequence, len(prompt), 20, TreeSetting(3, 1, 4))


@torch.no_grad()
def lane_by_lane(draft, last_out, last_logits, cache, setting: TreeSetting) -> list[tuple[float, int, int]]:
    """Every candidate (score, target token, parent candidate) of SGLang's steps, each beam run alone in a cache of
    its lane (the committed rows and the lane's earlier draft rows), one row at a time."""
    topk = setting.topk
    probs = torch.softmax(last_logits.float(), dim=-1)[0]
    first = probs.topk(topk)
    candidates = [(float(p), int(t), -1) for p, t in zip(first.values, first.indices)]
    beams = [(float(p), int(t), n, last_out) for n, (p, t) in enumerate(zip(first.values, first.indices))]
    lanes = []
    for _ in range(topk):
        lane = DraftKVCache()
        lane.keys, lane.values = cache.keys.clone(), cache.values.clone()
        lanes.append(lane)
    for _ in range(1, setting.num_steps):
        children = []
        for lane, (score, token, node, hidden) in zip(lanes, beams):
            out, logits = draft.draft_step(hidden, draft.draft_to_target_ids(torch.tensor([[token]])), lane)
            child = torch.softmax(logits[0, -1].float(), dim=-1).topk(topk)
            for p, t in zip(child.values, child.indices):
                children.append((score * float(p), int(t), node, out))
        base = len(candidates)
        candidates += [(s, t, parent) for s, t, parent, _ in children]
        best = sorted(range(len(children)), key=lambda i: -children[i][0])[:topk]
        beams = [(children[i][0], children[i][1], base + i, children[i][3]) for i in best]
    return [(s, int(draft.draft_to_target_ids(torch.tensor(t))), parent) for s, t, parent in candidates]


@pytest.mark.parametrize(("steps", "topk", "tokens"), [(2, 3, 7), (3, 4, 8), (4, 2, 9)])
def test_the_batched_beams_are_the_beams_run_one_by_one_in_their_lanes(steps, topk, tokens):
    """A real (random) draft, float64: draft_tree's batched lanes give the candidates a lane-by-lane run gives."""
    target = random_target().double()
    draft = random_draft(target).double()
    cache = DraftKVCache()
    prompt = prompts(1, seed=3)[0]
    hidden = torch.randn(1, len(prompt) - 1, draft.config.hidden_size, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    out, logits = draft.extend(hidden, prompt[1:].view(1, -1), cache)
    setting = TreeSetting(steps, topk, tokens)
    tree = draft_tree(draft, out[:, -1:], logits[:, -1], cache, setting)
    candidates = lane_by_lane(draft, out[:, -1:], logits[:, -1], cache, setting)
    assert len(candidates) == setting.candidates
    chosen = sorted(sorted(range(len(candidates)), key=lambda i: -candidates[i][0])[: tokens - 1])
    node_of = {c: n for n, c in enumerate(chosen)}
    assert tree.tokens == [candidates[c][1] for c in chosen]
    assert tree.parents == [-1 if candidates[c][2] == -1 else node_of.get(candidates[c][2], DETACHED) for c in chosen]
    assert tree.scores == pytest.approx([candidates[c][0] for c in chosen], rel=1e-6)  # float32 probabilities, as SGLang takes them
