"""The EAGLE-3 training objective: per-TTT-step soft cross-entropy against the target, accuracies, 0.8^k weighting."""
from __future__ import annotations

from dataclasses import dataclass

PLOSS_DECAY = 0.8


@dataclass
class TTTLoss:
    total: "object"  # scalar tensor with grad: sum_k decay^k * ploss[k]
    plosses: list  # scalar tensors (with grad), one per TTT step
    accs: list  # scalar tensors (no grad), one per TTT step
    counts: list  # number of masked positions per TTT step (int tensors)


@dataclass
class Teacher:
    """What the loss needs from the target, computed once per batch and shared by every TTT step."""

    probs: "object"  # [B, S, Vd] float32 softmax(target_logits[..., t2d])
    index: "object"  # [B, S] the target's argmax as a draft-vocab index
    valid: "object"  # [B, S] bool: loss_mask and the target argmax lies in the draft vocab


def make_teacher(target_logits, loss_mask, t2d) -> Teacher:
    """Target distribution restricted to the draft vocab; positions whose argmax is outside it are masked."""
    import torch

    with torch.no_grad():
        t2d = t2d.to(target_logits.device)
        draft_ids = torch.nonzero(t2d, as_tuple=False).squeeze(-1)
        restricted = target_logits.index_select(-1, draft_ids).float()
        in_draft = t2d[target_logits.argmax(-1)]
        valid = loss_mask.to(target_logits.device).bool() & in_draft
        return Teacher(probs=torch.softmax(restricted, dim=-1), index=restricted.argmax(-1), valid=valid)


def step_masks(teacher: Teacher, ttt_length: int) -> list:
    """Per TTT step k, the [B, S] positions t whose target position t+1+k is scored (for ttt_forward's loss_positions)."""
    import torch

    seq_len = teacher.valid.shape[1]
    masks = []
    for k in range(ttt_length):
        mask = torch.zeros_like(teacher.valid)
        if seq_len - 1 - k > 0:
            mask[:, : seq_len - 1 - k] = teacher.valid[:, 1 + k :]
        masks.append(mask)
    return masks


def ttt_loss(step_logits: list, teacher: Teacher, decay: float = PLOSS_DECAY) -> TTTLoss:
    """Step k's logits at position t are scored against the target at position t+1+k (see draft.ttt_forward).

    Each entry of step_logits is either [B, S, Vd] (every position) or [N_k, Vd]: only the positions of
    step_masks(teacher)[k], in row-major order, as ttt_forward returns them when given loss_positions.
    """
    import torch

    seq_len = teacher.valid.shape[1]
    plosses, accs, counts = [], [], []
    total = None
    for k, logits in enumerate(step_logits):
        span = seq_len - 1 - k
        if span <= 0:
            break
        mask = teacher.valid[:, 1 + k :]
        if logits.dim() == 2:
            probs, index, draft = teacher.probs[:, 1 + k :][mask], teacher.index[:, 1 + k :][mask], logits
            weights = None
        else:
            probs, index, draft = teacher.probs[:, 1 + k :], teacher.index[:, 1 + k :], logits[:, :span]
            weights = mask
        logp = torch.log_softmax(draft.float(), dim=-1)
        per_position = -(probs * logp).sum(-1)
        count = mask.sum()
        denom = count.clamp(min=1)
        # With no scored position the sum is a zero that still reaches every parameter (DDP needs the grads).
        ploss = (per_position if weights is None else per_position * weights).sum() / denom
        with torch.no_grad():
            hits = draft.argmax(-1) == index
            acc = (hits if weights is None else hits & weights).sum() / denom
        plosses.append(ploss)
        accs.append(acc)
        counts.append(count)
        total = ploss * (decay**k) if total is None else total + ploss * (decay**k)
    if total is None:
        raise ValueError(f"sequence length {seq_len} leaves no position to score; need at least 2 tokens")
    return TTTLoss(total=total, plosses=plosses, accs=accs, counts=counts)


def eagle3_loss(step_logits: list, target_logits, loss_mask, t2d, decay: float = PLOSS_DECAY) -> TTTLoss:
    """total = sum_k decay^k * ploss_k, ploss_k = masked mean of -sum_v p_target(v) log p_draft(v)."""
    return ttt_loss(step_logits, make_teacher(target_logits, loss_mask, t2d), decay)
