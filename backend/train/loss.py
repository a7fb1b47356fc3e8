"""The EAGLE-3 training objective: per-TTT-step soft cross-entropy against the target, accuracies, 0.8^k weighting."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

PLOSS_DECAY = 0.8


@dataclass
class TTTLoss:
    total: torch.Tensor  # scalar tensor with grad: sum_k decay^k * ploss[k]
    plosses: list  # scalar tensors (with grad), one per TTT step
    accs: list  # scalar tensors (no grad), one per TTT step
    counts: list  # number of masked positions per TTT step (int tensors)
    hits: Any = None  # fused_ttt_loss(keep_hits=True): [K, B, S] bool, step k at t hit a scored target (t+1+k)
    scored: Any = None  # with hits: Teacher.scored of the same batch


@dataclass
class Teacher:
    """What the loss needs from the target, computed once per batch and shared by every TTT step."""

    probs: torch.Tensor  # [B, S, Vd] float32 softmax(target_logits[..., t2d])
    index: torch.Tensor  # [B, S] the target's argmax as a draft-vocab index
    valid: torch.Tensor  # [B, S] bool: loss_mask and the target argmax lies in the draft vocab
    scored: Any = None  # [B, S] bool: loss_mask alone (the positions a served draft would be asked to predict)


def make_teacher(target_logits, loss_mask, t2d, draft_ids=None, probs_dtype=None, temperature: float = 1.0) -> Teacher:
    """Target distribution restricted to the draft vocab; positions whose argmax is outside it are masked.

    draft_ids: the target ids of the draft vocab, ascending (d2t + arange(Vd)); given, no device sync is
    needed to find them. probs_dtype: store the probabilities in this dtype (the trainer keeps them in
    bf16 on the GPU: computed once per batch in fp32, then rounded, half the bytes of fp32).
    temperature: the probabilities are softmax(logits / temperature); 1 is the target's own distribution, below 1
    sharper (the argmax, index, and the masks do not depend on it).
    """
    if not temperature > 0:
        raise ValueError(f"teacher temperature must be positive, got {temperature}")
    import torch

    with torch.no_grad():
        t2d = t2d.to(target_logits.device)
        if draft_ids is None:
            draft_ids = torch.nonzero(t2d, as_tuple=False).squeeze(-1)
        restricted = target_logits.index_select(-1, draft_ids.to(target_logits.device))
        in_draft = t2d[target_logits.argmax(-1)]
        valid = loss_mask.to(target_logits.device).bool() & in_draft
        index = restricted.argmax(-1)
        scaled = restricted.float() if temperature == 1.0 else restricted.float() / temperature
        probs = torch.softmax(scaled, dim=-1)
        if probs_dtype is not None:
            probs = probs.to(probs_dtype)
        return Teacher(probs=probs, index=index, valid=valid, scored=loss_mask.to(target_logits.device).bool())


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


# --- the trainer's loss: lm_head + soft cross-entropy of every TTT step, fused and chunked -----------------
#
# ttt_loss above takes each step's logits [N, Vd]; kept for autograd, they cost 7 x (bf16 logits + fp32
# log-softmax) of memory and a dozen passes over [S, Vd] per step. fused_ttt_loss takes the normed states
# of all steps at once ([K, B, S, H], draft.ttt_hidden) and the lm_head weight, and walks the K*B*S rows in
# chunks: logits of one chunk -> loss, accuracy and the gradient of the loss w.r.t. those logits ->
# grad of the states (one matmul) and of the weight (accumulated, one matmul). The gradients are computed
# in the forward pass (the loss is a sum of these rows, so backward only scales them by the incoming
# scalar), so no logits outlive their chunk and none are recomputed. Every row is computed (rows with no
# target get weight 0): no boolean indexing, no device sync.


def _chunk_math(logits, probs, weight, index, need_grad: bool):
    """Per row: soft CE -sum p log softmax(logits), argmax hit, and (weight x) d CE / d logits."""
    import torch

    logp = logits.float()
    lse = torch.logsumexp(logp, dim=-1, keepdim=True)
    logp = logp - lse
    p = probs.float()
    ce = -(p * logp).sum(-1)
    hit = logits.argmax(-1) == index
    if not need_grad:
        return ce, hit, None
    grad = (torch.exp(logp) * p.sum(-1, keepdim=True) - p) * weight[:, None]
    return ce, hit, grad.to(logits.dtype)


def _fused_function():
    import torch

    class FusedHeadSoftCE(torch.autograd.Function):
        @staticmethod
        def forward(ctx, states, head, probs, teacher_rows, row_weight, index, chunk, math):
            need_states, need_head = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
            need_grad = need_states or need_head
            rows = states.shape[0]
            ce = torch.empty(rows, dtype=torch.float32, device=states.device)
            hits = torch.empty(rows, dtype=torch.bool, device=states.device)
            grad_states = torch.empty_like(states) if need_states else None
            grad_head = torch.zeros_like(head) if need_head else None
            for start in range(0, rows, chunk):
                end = min(rows, start + chunk)
                block = states[start:end]
                logits = block @ head.t()
                target = probs.index_select(0, teacher_rows[start:end])
                ce[start:end], hits[start:end], grad = math(logits, target, row_weight[start:end], index[start:end], need_grad)
                if need_states:
                    torch.mm(grad, head, out=grad_states[start:end])
                if need_head:
                    grad_head.addmm_(grad.t(), block)
            loss = (ce * row_weight).sum()
            ctx.save_for_backward(grad_states, grad_head)
            ctx.mark_non_differentiable(ce, hits)
            return loss, ce, hits

        @staticmethod
        def backward(ctx, grad_loss, _grad_ce, _grad_hits):
            grad_states, grad_head = ctx.saved_tensors
            scale = grad_loss.to(torch.float32)
            if grad_states is not None:
                grad_states = grad_states.mul_(scale.to(grad_states.dtype))
            if grad_head is not None:
                grad_head = grad_head.mul_(scale.to(grad_head.dtype))
            return grad_states, grad_head, None, None, None, None, None, None

    return FusedHeadSoftCE


_FUSED: dict[str, Any] = {}
_DECAYS: dict[tuple, Any] = {}


def _decays(steps: int, decay: float, device) -> torch.Tensor:
    """[decay^0 .. decay^(steps-1)] on `device`, made once: a tensor built from host values on a GPU waits for the
    GPU to finish all queued work, which would stall every training step midway."""
    import torch

    key = (steps, decay, str(device))
    if key not in _DECAYS:
        _DECAYS[key] = torch.tensor([decay**k for k in range(steps)], dtype=torch.float32, device=device)
    return _DECAYS[key]


def fused_ttt_loss(
    states, head_weight, teacher: Teacher, decay: float = PLOSS_DECAY, chunk_rows: int | None = None, compiled: bool = False, keep_hits: bool = False
) -> TTTLoss:
    """ttt_loss(lm_head(states[k]) for each k, teacher) without keeping any logits: see the note above.

    states: [K, B, S, H], norm(output state) of TTT step k at position t (draft.ttt_hidden); step k at t is
    scored against the teacher at t+1+k, as in ttt_loss. Steps with no position left (k >= S-1) are not
    scored. chunk_rows: rows per chunk (default B*S, one step). compiled: torch.compile the per-chunk math.
    Returns the same TTTLoss; only `total` carries a gradient. keep_hits: also the per-position hits (TTTLoss.hits).
    """
    import torch

    if "function" not in _FUSED:
        _FUSED["function"] = _fused_function()
    steps, batch, seq, hidden = states.shape
    scored = min(steps, seq - 1)
    if scored <= 0:
        raise ValueError(f"sequence length {seq} leaves no position to score; need at least 2 tokens")
    device = states.device
    positions = torch.arange(seq, device=device)
    offsets = (torch.arange(batch, device=device) * seq)[:, None]
    valid = teacher.valid.to(device)
    rows, masks = [], []
    for k in range(scored):
        shifted = positions + 1 + k
        rows.append((shifted.clamp(max=seq - 1)[None, :] + offsets).reshape(-1))
        masks.append((valid[:, shifted.clamp(max=seq - 1)] & (shifted < seq)[None, :]).reshape(-1))
    teacher_rows = torch.stack(rows)  # [K, B*S] rows of the flattened teacher
    mask = torch.stack(masks)  # [K, B*S]
    counts = mask.sum(-1)
    denom = counts.clamp(min=1).to(torch.float32)
    decays = _decays(scored, decay, device)
    row_weight = (mask.to(torch.float32) * (decays / denom)[:, None]).reshape(-1)
    index = teacher.index.reshape(-1).index_select(0, teacher_rows.reshape(-1))
    probs = teacher.probs.reshape(batch * seq, -1)
    flat = states[:scored].reshape(scored * batch * seq, hidden)
    math = _chunk_math
    if compiled and states.device.type == "cuda":
        from backend.train.attention import compiled as compile_once

        math = compile_once(_chunk_math)
    total, ce, hits = _FUSED["function"].apply(flat, head_weight, probs, teacher_rows.reshape(-1), row_weight, index, chunk_rows or batch * seq, math)
    with torch.no_grad():
        maskf = mask.to(torch.float32)
        plosses = (ce.view(scored, -1) * maskf).sum(-1) / denom
        accs = (hits.view(scored, -1) & mask).sum(-1).to(torch.float32) / denom
        grid = (hits.view(scored, -1) & mask).view(scored, batch, seq) if keep_hits else None
    return TTTLoss(total=total, plosses=list(plosses.unbind()), accs=list(accs.unbind()), counts=list(counts.unbind()), hits=grid)


def rounds_accept_length(histogram: list[int] | None) -> float | None:
    """Tokens per verify round (accepted drafts + the bonus token) of a rounds histogram; None without rounds."""
    if not histogram or sum(histogram) <= 0:
        return None
    return 1 + sum(i * n for i, n in enumerate(histogram)) / sum(histogram)


def chain_round_histogram(hits, scored, num_steps: int) -> list[int]:
    """Chain drafting of num_steps replayed on teacher-forced hits: entry i = rounds that accepted exactly i drafts.

    hits [K, B, S] (TTTLoss.hits: step k at row t predicted the target at t+1+k); scored [B, S] (Teacher.scored).
    A round starts at a row t whose next position is scored (an answer token), accepts the leading run of steps
    that hit, and the next round starts at t + accepted + 1, as a served round does after its bonus token. So
    rounds start after rejections as often as serving makes them, which per-position accuracy (tau-hat) does not
    see: on SmolLM2 the step after a rejected round hit 0.40 of the time against 0.70 after a full accept.
    """
    import torch

    steps = min(num_steps, hits.shape[0])
    lead = hits[:steps].to(torch.long).cumprod(0).sum(0).cpu().tolist() if steps > 0 else None  # [B, S] leading hits
    starts = scored[:, 1:].cpu().tolist()  # row t may start a round when position t+1 is scored
    histogram = [0] * (num_steps + 1)
    for row, allowed in enumerate(starts):
        t = 0
        while t < len(allowed):
            if not allowed[t]:
                t += 1
                continue
            accepted = lead[row][t] if lead is not None else 0
            histogram[accepted] += 1
            t += accepted + 1
    return histogram
