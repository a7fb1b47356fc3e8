"""SGLang's EAGLE tree on the static decoder: the plain tokens, and the trees and rounds draft_tree.replay predicts."""

import math

import pytest
import torch

from backend.serve.reference import draft_tree as replay_module
from backend.serve.reference.draft_tree import DETACHED, greedy_rows, replay
from backend.serve.spec_setting import TreeSetting
from backend.serve.reference.spec_decode import NO_EOS, SpecDecoder
from backend.serve.reference.static_decode import StaticDecoder
from backend.serve.reference.static_tree import ROOT, accepted_path, ancestor_bits, candidate_depths, choose_nodes
from tests.fixtures.drafts import AUX, VOCAB, PositionReadingDraft, identity_vocab_draft, prompts, random_draft, random_target

pytestmark = pytest.mark.usefixtures("limited_torch_threads")


class PositionScript(PositionReadingDraft):
    """Probabilities from a script (PositionReadingDraft): `table[i]` ({token: probability}) at sequence index i,
    else the true token with certainty."""

    def setup(self, sequence: list[int], table: dict[int, dict[int, float]]):
        self.table = table
        return self.read(sequence)

    def choices(self, index: int, true: int) -> dict[int, float]:
        return {token: math.log(p) for token, p in self.table.get(index, {true: 1.0}).items()}


def scripted_draft(target) -> PositionScript:
    return identity_vocab_draft(PositionScript, target)


def recorded_trees(decoder: StaticDecoder) -> list[tuple[list[int], list[int]]]:
    """The (tokens, parents) of every tree the decoder verifies, read before each verify."""
    trees, verify = [], decoder._verify_tree

    def recording(start, bucket):
        trees.append((decoder.verify_tokens[0, 1:].tolist(), decoder.node_parents.tolist()))
        verify(start, bucket)

    decoder._verify_tree = recording
    return trees


def replayed(monkeypatch, draft, sequence, features, prompt_len, new_tokens, setting):
    """draft_tree.replay's rounds and the (tokens, parents) of each tree it drafted."""
    trees, build = [], replay_module.draft_tree

    def recording(*args):
        tree = build(*args)
        trees.append((tree.tokens, tree.parents))
        return tree

    monkeypatch.setattr(replay_module, "draft_tree", recording)
    result = replay(draft, features, sequence, prompt_len, new_tokens, setting)
    monkeypatch.setattr(replay_module, "draft_tree", build)
    return result, trees


def test_each_node_sees_itself_and_its_ancestors():
    # root -> 0, 1; 0 -> 2, 3; 2 -> 4; 1 -> 5; 6 detached
    parents = torch.tensor([ROOT, ROOT, 0, 0, 2, 1, DETACHED])
    bits = ancestor_bits(parents, num_steps=3).tolist()
    expected = [{0}, {1}, {0, 2}, {0, 3}, {0, 2, 4}, {1, 5}, {6}]
    assert [{m for m in range(7) if b >> m & 1} for b in bits] == expected


def test_the_accepted_path_follows_the_greedy_ids_from_the_root():
    parents = torch.tensor([ROOT, ROOT, 0, 0, 2, 1, DETACHED])
    depths = torch.tensor([1, 1, 2, 2, 3, 2, 2])
    proposals = torch.tensor([10, 11, 20, 21, 30, 22, 22])
    # verify rows: root, nodes 0..6; the target's greedy id at each row
    greedy = torch.tensor([11, 0, 22, 0, 0, 0, 33, 0])  # root says 11 (node 1), node 1 says 22 (node 5)
    accepted, rows = accepted_path(proposals, greedy, parents, depths, num_steps=3)
    assert accepted.tolist() == [2] and rows.tolist() == [2, 6, 0]  # rows of nodes 1 and 5 (the detached 22 never)
    greedy = torch.tensor([10, 20, 0, 30, 0, 99, 0, 0])  # 10 (node 0), 20 (node 2), 30 (node 4)
    accepted, rows = accepted_path(proposals, greedy, parents, depths, num_steps=3)
    assert accepted.tolist() == [3] and rows.tolist() == [1, 3, 5]
    accepted, rows = accepted_path(proposals, torch.full((8,), 7), parents, depths, num_steps=3)
    assert accepted.tolist() == [0] and rows.tolist() == [0, 0, 0]


def test_a_chosen_node_whose_parent_lost_a_tie_is_detached():
    scores = torch.tensor([0.5, 0.5, 0.5, 0.1])  # the child (2) ties its parent (1) and another root child (0)
    parents = torch.tensor([ROOT, ROOT, 1, 0])
    chosen, node_parents = choose_nodes(scores, parents, 2)
    assert len(chosen) == 2 and sorted(chosen.tolist()) == chosen.tolist()
    for candidate, parent in zip(chosen.tolist(), node_parents.tolist()):
        expected_parent = parents[candidate].item()
        assert parent == (ROOT if expected_parent == ROOT else (chosen.tolist().index(expected_parent) if expected_parent in chosen.tolist() else DETACHED))
    assert candidate_depths(3, 2).tolist() == [1, 1] + [2] * 4 + [3] * 4


SETTINGS = [(3, 4, 8), (2, 3, 7), (4, 2, 9), (3, 8, 32)]


@pytest.mark.parametrize(("steps", "topk", "tokens"), SETTINGS)
def test_a_real_drafts_trees_and_rounds_are_the_replays(monkeypatch, steps, topk, tokens):
    """A random draft, float64: every round's tree (tokens and parents) is draft_tree's from the same commit, the
    rounds are the replay's, and the output is plain greedy decoding's."""
    target = random_target().double()
    draft = random_draft(target).double()
    static = StaticDecoder(target, draft, AUX, num_steps=steps, max_len=256, topk=topk, num_draft_tokens=tokens, eos_token_id=NO_EOS)
    assert static.width == tokens
    plain = SpecDecoder(target, None, AUX, eos_token_id=NO_EOS)
    setting = TreeSetting(steps, topk, tokens)
    for prompt in prompts(2, seed=4):
        prompt = prompt.tolist()
        trees = recorded_trees(static)
        result = static.generate(prompt, 24)
        sequence, features = greedy_rows(plain, prompt, 24 + steps)
        expected, expected_trees = replayed(monkeypatch, draft, sequence, features, len(prompt), 24, setting)
        assert result.output_ids == sequence[len(prompt) : len(prompt) + 24]
        assert result.accepted_per_round == expected.accepted_per_round and result.verify_ct == expected.verify_ct
        assert trees == expected_trees and len(trees) == result.verify_ct
        del static._verify_tree


MISSES = (3, 9, 16, 25)  # output indices where the draft's first guess is wrong (never two within a round)


def tree_rescues(setting: TreeSetting, new_tokens: int = 30, fewer: bool = True, **options) -> None:
    """A scripted draft wrong first (0.55) and right second (0.45) at MISSES: the tree decodes the plain tokens, in
    the rounds the replay predicts and (fewer) in fewer than the chain's; accepted nodes off the first path move their
    K/V. A tree of 3 nodes is the chain under the wrong guess (0.55 three times beats 0.45): as many rounds."""
    target = random_target()
    draft = scripted_draft(target)
    plain = SpecDecoder(target, None, AUX, eos_token_id=NO_EOS)
    prompt = prompts(1, seed=11)[0].tolist()
    sequence, features = greedy_rows(plain, prompt, new_tokens + 8)
    start = len(prompt)
    draft.setup(sequence, {start + i: {(sequence[start + i] + 1) % VOCAB: 0.55, sequence[start + i]: 0.45} for i in MISSES if i < new_tokens})
    static = StaticDecoder(
        target, draft, AUX, num_steps=setting.num_steps, topk=setting.topk, num_draft_tokens=setting.num_draft_tokens, eos_token_id=NO_EOS, **options
    )
    chain = StaticDecoder(target, draft, AUX, num_steps=setting.num_steps, eos_token_id=NO_EOS, max_len=options.get("max_len"))
    result = static.generate(prompt, new_tokens)
    assert result.output_ids == sequence[start : start + new_tokens]
    expected = replay(draft, features, sequence, start, new_tokens, setting)
    assert result.accepted_per_round == expected.accepted_per_round
    rounds = chain.generate(prompt, new_tokens).verify_ct
    assert result.verify_ct < rounds if fewer else result.verify_ct == rounds


@pytest.mark.parametrize(("steps", "topk", "tokens"), [(3, 2, 4), (3, 2, 6), (3, 4, 8), (5, 2, 8)])
def test_a_tree_keeps_the_right_second_guess_and_gives_the_plain_tokens(steps, topk, tokens):
    tree_rescues(TreeSetting(steps, topk, tokens), fewer=tokens > 4, max_len=512)


@pytest.mark.slow
@pytest.mark.parametrize("linear", ["triton-all", "triton-rows"])
def test_a_tree_through_the_triton_kernels_gives_the_plain_tokens(linear, triton_interpreter):
    """The tree's ancestor masks through the Triton attention, its rows through the Triton linear (the row loop, or
    a row grid), in Triton's interpreter (seconds a round there: 12 tokens)."""
    tree_rescues(TreeSetting(3, 2, 6), new_tokens=12, attention="triton", linear=linear, max_len=256)


@pytest.mark.slow
def test_a_compiled_tree_gives_the_plain_tokens():
    """The tree's steps through torch.compile (top-k beams, the selection, the masks and the path on the device), as
    the GPU captures them."""
    tree_rescues(TreeSetting(3, 2, 6), attention="math", compile=True, max_len=256)


@pytest.mark.parametrize(
    ("options", "says"),
    [
        ({"topk": 2, "branches": 2}, "do not combine"),
        ({"topk": 8, "num_steps": 3, "num_draft_tokens": 66}, "at most 64 draft tokens"),
        ({"topk": 1, "num_steps": 3, "num_draft_tokens": 6}, "SGLang verifies num_steps"),
        ({"topk": 2, "num_steps": 3, "num_draft_tokens": 12}, "between 2 and 11"),
    ],
)
def test_a_tree_the_decoder_cannot_run_is_refused(options, says):
    target = random_target()
    options.setdefault("num_steps", 3)
    with pytest.raises(ValueError, match=says):
        StaticDecoder(target, random_draft(target), AUX, max_len=64, **options)
