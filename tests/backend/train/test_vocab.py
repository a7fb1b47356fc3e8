"""d2t/t2d as SpecForge builds them (reference sglang-eagle3.md 2.5): counts on loss-masked tokens, offsets, mask."""

import pytest
import torch

from backend.train.vocab import build_vocab_mapping, count_tokens, coverage, draft_to_target_ids


def test_counts_only_loss_masked_positions():
    ids = torch.tensor([[5, 5, 7, 9], [9, 9, 9, 2]])
    mask = torch.tensor([[0, 1, 1, 0], [1, 1, 0, 1]])
    counts = count_tokens([(ids, mask)], vocab_size=10)
    assert counts.tolist() == [0, 0, 1, 0, 0, 1, 0, 1, 0, 2]


def test_out_of_range_token_is_refused():
    with pytest.raises(ValueError, match="out of range"):
        count_tokens([(torch.tensor([3, 12]), torch.tensor([1, 1]))], vocab_size=10)


def test_most_frequent_ids_sorted_ascending_with_offsets():
    counts = torch.tensor([0, 50, 3, 0, 40, 10, 0, 7])
    d2t, t2d = build_vocab_mapping(counts, draft_vocab_size=4)
    used = [1, 4, 5, 7]  # the 4 most frequent, ascending
    assert d2t.dtype == torch.int64 and t2d.dtype == torch.bool
    assert d2t.tolist() == [u - i for i, u in enumerate(used)]  # offsets, not absolute ids
    assert t2d.tolist() == [i in used for i in range(8)]
    # SGLang: hot_token_id = d2t + arange(Vd) recovers the target ids
    assert draft_to_target_ids(d2t).tolist() == used


def test_pads_with_zero_frequency_ids_when_data_has_too_few_tokens():
    counts = torch.tensor([0, 9, 0, 0, 4, 0])
    d2t, t2d = build_vocab_mapping(counts, draft_vocab_size=4)
    # 2 seen ids + the lowest unseen ids (0, 2) as zero-frequency padding
    assert draft_to_target_ids(d2t).tolist() == [0, 1, 2, 4]
    assert int(t2d.sum()) == 4


def test_ties_are_broken_by_lower_id_so_every_rank_agrees():
    counts = torch.tensor([5, 5, 5, 5, 1])
    d2t, _ = build_vocab_mapping(counts, draft_vocab_size=2)
    assert draft_to_target_ids(d2t).tolist() == [0, 1]


def test_random_counts_give_the_same_mapping_as_a_plain_python_ranking():
    counts = torch.randint(0, 30, (259,), generator=torch.Generator().manual_seed(3))
    d2t, t2d = build_vocab_mapping(counts, 192)
    values = counts.tolist()
    used = sorted(sorted(range(259), key=lambda i: (-values[i], i))[:192])
    assert draft_to_target_ids(d2t).tolist() == used
    assert t2d.tolist() == [i in set(used) for i in range(259)]


def test_mapping_is_accepted_by_the_draft_and_coverage_is_reported():
    counts = torch.zeros(259, dtype=torch.int64)
    counts[:100] = 10
    counts[200] = 1000
    d2t, t2d = build_vocab_mapping(counts, 192)
    assert coverage(counts, t2d) == 1.0
    assert bool(t2d[200])
    _, small = build_vocab_mapping(torch.tensor([1, 1, 0, 0]), 1)
    assert coverage(torch.tensor([1, 1, 0, 0]), small) == 0.5


def test_draft_vocab_larger_than_target_vocab_is_refused():
    with pytest.raises(ValueError, match="exceeds"):
        build_vocab_mapping(torch.ones(10, dtype=torch.int64), 11)
