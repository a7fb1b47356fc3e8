"""Draft vocabulary mapping (d2t offsets, t2d mask) from the token frequencies of the training data."""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterable

if TYPE_CHECKING:
    import torch


def count_tokens(batches: Iterable[tuple[torch.Tensor, torch.Tensor]], vocab_size: int):
    """Counts of target token ids at positions where loss_mask == 1, as an int64 tensor [vocab_size].

    `batches` yields (input_ids, loss_mask) tensors of equal shape.
    """
    import torch

    counts = torch.zeros(vocab_size, dtype=torch.int64)
    for input_ids, loss_mask in batches:
        ids = input_ids.reshape(-1)[loss_mask.reshape(-1).bool()].to(torch.int64).cpu()
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab_size):
            raise ValueError(f"token id out of range 0..{vocab_size - 1} in the training data (min {int(ids.min())}, max {int(ids.max())})")
        counts += torch.bincount(ids, minlength=vocab_size)
    return counts


def build_vocab_mapping(counts, draft_vocab_size: int):
    """(d2t, t2d) as SpecForge/EAGLE build them (reference 2.5).

    Take the draft_vocab_size most frequent ids (ids never seen count as zero-frequency padding; ties go to
    the lower id so every rank and rerun agrees), sort them ascending, then d2t[i] = used[i] - i (an int64
    offset: SGLang adds arange(Vd)) and t2d[j] = j is in the draft vocab.
    """
    import torch

    vocab_size = counts.numel()
    if draft_vocab_size > vocab_size:
        raise ValueError(f"draft vocab size {draft_vocab_size} exceeds the target vocab size {vocab_size}")
    ids = torch.arange(vocab_size)
    # Stable sort on -count keeps ascending ids among equal counts.
    order = torch.sort(-counts.to(torch.int64), stable=True).indices
    used = torch.sort(ids[order[:draft_vocab_size]]).values
    d2t = (used - torch.arange(draft_vocab_size)).to(torch.int64)
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[used] = True
    return d2t, t2d


def draft_to_target_ids(d2t):
    """Absolute target ids of the draft vocab (what SGLang calls hot_token_id)."""
    import torch

    return d2t + torch.arange(d2t.numel(), device=d2t.device)


def coverage(counts, t2d) -> float:
    """Share of counted (loss-masked) tokens that fall inside the draft vocab."""
    total = int(counts.sum())
    return float(counts[t2d.to(counts.device)].sum()) / total if total else 0.0
