"""The EAGLE-3 objective: soft CE against softmax(target[..., t2d]) at t+1+k, masks, accuracies, 0.8^k weights."""

import math

import pytest
import torch

from backend.train.loss import chain_round_histogram, eagle3_loss, make_teacher, step_masks, ttt_loss

V, VD, B, S = 12, 6, 2, 9


def setup_case(seed=0):
    generator = torch.Generator().manual_seed(seed)
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[[0, 2, 3, 5, 8, 11]] = True
    target_logits = torch.randn(B, S, V, generator=generator) * 3
    loss_mask = torch.ones(B, S, dtype=torch.uint8)
    loss_mask[0, :3] = 0
    return target_logits, loss_mask, t2d


def reference(step_logits, target_logits, loss_mask, t2d):
    """A direct per-position loop over the definition."""
    draft_ids = torch.nonzero(t2d).flatten().tolist()
    plosses, accs = [], []
    for k, logits in enumerate(step_logits):
        total, hits, count = 0.0, 0, 0
        for b in range(B):
            for t in range(S - 1 - k):
                p = t + 1 + k
                if not loss_mask[b, p] or int(target_logits[b, p].argmax()) not in draft_ids:
                    continue
                target = torch.softmax(target_logits[b, p, draft_ids], -1)
                logp = torch.log_softmax(logits[b, t], -1)
                total += float(-(target * logp).sum())
                hits += int(logits[b, t].argmax() == target.argmax())
                count += 1
        plosses.append(total / max(count, 1))
        accs.append(hits / max(count, 1))
    return plosses, accs


def test_matches_the_definition_position_by_position():
    target_logits, loss_mask, t2d = setup_case()
    step_logits = [torch.randn(B, S, VD, generator=torch.Generator().manual_seed(10 + k)) for k in range(3)]
    result = eagle3_loss(step_logits, target_logits, loss_mask, t2d)
    plosses, accs = reference(step_logits, target_logits, loss_mask, t2d)
    assert [float(p) for p in result.plosses] == pytest.approx(plosses, rel=1e-5)
    assert [float(a) for a in result.accs] == pytest.approx(accs)
    assert float(result.total) == pytest.approx(sum(0.8**k * p for k, p in enumerate(plosses)), rel=1e-5)


def test_positions_whose_target_argmax_is_outside_the_draft_vocab_are_masked():
    target_logits, loss_mask, t2d = setup_case()
    target_logits[:, :, 1] = 100.0  # id 1 is not in the draft vocab: every position's argmax falls outside
    target_logits[1, 4, 1] = -100.0
    target_logits[1, 4, 3] = 100.0  # ... except position 4 of row 1
    teacher = make_teacher(target_logits, loss_mask, t2d)
    assert teacher.valid.sum() == 1 and bool(teacher.valid[1, 4])
    step0 = torch.zeros(B, S, VD)
    step0[1, 3, 2] = 5.0  # position 3 predicts position 4; draft index 2 is target id 3
    result = ttt_loss([step0], teacher)
    assert int(result.counts[0]) == 1 and float(result.accs[0]) == 1.0


def test_a_draft_equal_to_the_target_scores_the_target_entropy_and_full_accuracy():
    target_logits, loss_mask, t2d = setup_case()
    restricted = target_logits[..., t2d]
    step_logits = [torch.cat([restricted[:, 1 + k :], torch.zeros(B, 1 + k, VD)], dim=1) for k in range(4)]
    result = eagle3_loss(step_logits, target_logits, loss_mask, t2d)
    for k in range(4):
        assert float(result.accs[k]) == 1.0
        probs = torch.softmax(restricted[:, 1 + k :], -1)
        valid = make_teacher(target_logits, loss_mask, t2d).valid[:, 1 + k :]
        entropy = (-(probs * probs.log()).sum(-1) * valid).sum() / valid.sum()
        assert float(result.plosses[k]) == pytest.approx(float(entropy), rel=1e-5)


def test_selected_positions_give_the_same_loss_and_gradient_as_full_logits():
    target_logits, loss_mask, t2d = setup_case()
    teacher = make_teacher(target_logits, loss_mask, t2d)
    full = [torch.randn(B, S, VD, generator=torch.Generator().manual_seed(k), requires_grad=True) for k in range(7)]
    masks = step_masks(teacher, 7)
    selected = [f[m] for f, m in zip(full, masks)]
    a, b = ttt_loss(full, teacher), ttt_loss(selected, teacher)
    assert a.total.item() == pytest.approx(b.total.item(), rel=1e-6)
    assert [float(x) for x in a.accs] == [float(x) for x in b.accs]
    grads_a = torch.autograd.grad(a.total, full)
    grads_b = torch.autograd.grad(b.total, full)
    for ga, gb in zip(grads_a, grads_b):
        assert torch.allclose(ga, gb, atol=1e-7)


def test_steps_past_the_sequence_end_score_nothing_but_keep_the_graph():
    target_logits, loss_mask, t2d = setup_case()
    teacher = make_teacher(target_logits, loss_mask, t2d)
    masks = step_masks(teacher, S + 2)
    assert not masks[S - 1].any()  # t+1+k >= S for every t
    weight = torch.ones(VD, requires_grad=True)
    logits = [torch.randn(int(m.sum()), VD) * weight for m in masks[: S - 1]] + [torch.zeros(0, VD) * weight]
    result = ttt_loss(logits, teacher)
    assert len(result.plosses) == S - 1  # a step with no position left at all is not scored
    result.total.backward()
    assert weight.grad is not None and torch.isfinite(weight.grad).all()


def test_decay_weights_are_point_eight_to_the_k():
    target_logits, loss_mask, t2d = setup_case()
    teacher = make_teacher(target_logits, loss_mask, t2d)
    logits = torch.randn(B, S, VD)
    result = ttt_loss([logits] * 3, teacher)
    expected = sum(float(p) * 0.8**k for k, p in enumerate(result.plosses))
    assert math.isclose(float(result.total), expected, rel_tol=1e-6)


# --- the trainer's fused lm_head + loss ------------------------------------------------------------------


def fused_case(seed=0, steps=3, hidden=8):

    target_logits, loss_mask, t2d = setup_case(seed)
    generator = torch.Generator().manual_seed(seed + 100)
    states = torch.randn(steps, B, S, hidden, generator=generator, requires_grad=True)
    head = (torch.randn(VD, hidden, generator=generator) * 0.7).requires_grad_(True)
    return target_logits, loss_mask, t2d, states, head


@pytest.mark.parametrize("chunk_rows", [None, 5, 1000])
def test_fused_loss_matches_ttt_loss_values_and_gradients(chunk_rows):
    """fused_ttt_loss(states, lm_head) == ttt_loss(lm_head(states)): loss, plosses, accs, counts, and both gradients (fp32, rel 1e-5)."""
    from backend.train.loss import fused_ttt_loss

    target_logits, loss_mask, t2d, states, head = fused_case(steps=4)
    teacher = make_teacher(target_logits, loss_mask, t2d)
    reference = ttt_loss([s @ head.t() for s in states], teacher)
    reference.total.backward()
    ref_states, ref_head = states.grad.clone(), head.grad.clone()
    states.grad = head.grad = None
    fused = fused_ttt_loss(states, head, teacher, chunk_rows=chunk_rows)
    fused.total.backward()
    assert float(fused.total) == pytest.approx(float(reference.total), rel=1e-5)
    assert [float(p) for p in fused.plosses] == pytest.approx([float(p) for p in reference.plosses], rel=1e-5)
    assert [float(a) for a in fused.accs] == [float(a) for a in reference.accs]
    assert [int(c) for c in fused.counts] == [int(c) for c in reference.counts]
    assert torch.allclose(states.grad, ref_states, rtol=1e-5, atol=1e-7)
    assert torch.allclose(head.grad, ref_head, rtol=1e-5, atol=1e-7)


def test_fused_loss_scales_its_precomputed_gradient_by_the_upstream_gradient():
    from backend.train.loss import fused_ttt_loss

    target_logits, loss_mask, t2d, states, head = fused_case()
    teacher = make_teacher(target_logits, loss_mask, t2d)
    (fused_ttt_loss(states, head, teacher).total * 3.0).backward()
    tripled = states.grad.clone()
    states.grad = head.grad = None
    fused_ttt_loss(states, head, teacher).total.backward()
    assert torch.allclose(tripled, 3.0 * states.grad, rtol=1e-6)


def test_fused_loss_skips_steps_past_the_sequence_end_and_runs_without_grad():
    from backend.train.loss import fused_ttt_loss

    target_logits, loss_mask, t2d, states, head = fused_case(steps=S + 2)
    teacher = make_teacher(target_logits, loss_mask, t2d)
    result = fused_ttt_loss(states, head, teacher)
    assert len(result.plosses) == S - 1
    with torch.no_grad():
        again = fused_ttt_loss(states, head, teacher)
    assert float(again.total) == pytest.approx(float(result.total), rel=1e-6) and not again.total.requires_grad


def test_bf16_teacher_probabilities_stay_within_rounding_of_fp32():
    target_logits, loss_mask, t2d = setup_case()
    fp32 = make_teacher(target_logits, loss_mask, t2d)
    bf16 = make_teacher(target_logits, loss_mask, t2d, draft_ids=torch.nonzero(t2d).flatten(), probs_dtype=torch.bfloat16)
    assert bf16.probs.dtype == torch.bfloat16 and torch.equal(bf16.valid, fp32.valid) and torch.equal(bf16.index, fp32.index)
    assert (bf16.probs.float() - fp32.probs).abs().max() <= 2**-8 * fp32.probs.max()


def test_a_sharper_teacher_is_the_tempered_softmax_with_the_same_argmax_and_masks():
    """--teacher-temperature: probabilities softmax(restricted logits / T); the argmax, the masks and so the accuracies
    do not move; below 1 the argmax gets more of the mass, and a small T is nearly the one-hot argmax."""
    target_logits, loss_mask, t2d = setup_case()
    draft_ids = torch.nonzero(t2d).flatten()
    plain = make_teacher(target_logits, loss_mask, t2d)
    assert torch.equal(make_teacher(target_logits, loss_mask, t2d, temperature=1.0).probs, plain.probs)
    sharp = make_teacher(target_logits, loss_mask, t2d, temperature=0.5)
    assert torch.allclose(sharp.probs, torch.softmax(target_logits[..., draft_ids] / 0.5, -1), rtol=1e-6, atol=1e-7)
    assert torch.equal(sharp.index, plain.index) and torch.equal(sharp.valid, plain.valid) and torch.equal(sharp.scored, plain.scored)
    top = sharp.probs.gather(-1, sharp.index[..., None]) > plain.probs.gather(-1, plain.index[..., None])
    assert bool(top.all())
    near_hard = make_teacher(target_logits, loss_mask, t2d, temperature=0.01)
    assert float(near_hard.probs.gather(-1, near_hard.index[..., None]).min()) > 0.99
    step_logits = [torch.randn(B, S, VD, generator=torch.Generator().manual_seed(10 + k)) for k in range(2)]
    tempered = ttt_loss(step_logits, sharp)
    assert [float(a) for a in tempered.accs] == [float(a) for a in ttt_loss(step_logits, plain).accs]
    assert float(tempered.plosses[0]) == pytest.approx(reference(step_logits, target_logits / 0.5, loss_mask, t2d)[0][0], rel=1e-5)
    for bad in (0.0, -1.0, float("nan")):
        with pytest.raises(ValueError, match="teacher temperature must be positive"):
            make_teacher(target_logits, loss_mask, t2d, temperature=bad)


def test_chain_rounds_replay_serving_on_teacher_forced_hits():
    """Rounds start where an answer token follows, take the leading run of hits, and jump past the bonus token."""
    hits = torch.zeros(3, 1, 12, dtype=torch.bool)
    hits[:, 0, 1] = True  # a round at row 1 accepts all 3 drafts -> the next starts at row 5
    hits[0, 0, 5] = True  # row 5: step 0 hits, step 1 misses -> accepts 1, next at row 7
    hits[1, 0, 5] = False
    hits[:2, 0, 7] = True  # row 7: accepts 2 (step 2 misses) -> next at row 10
    hits[0, 0, 2] = hits[0, 0, 3] = True  # rows 2-4 are skipped by the full accept: they never start a round
    scored = torch.zeros(1, 12, dtype=torch.bool)
    scored[0, 2:] = True  # row t may start when position t+1 is scored: rows 1..10
    # rounds: row 1 (3), row 5 (1), row 7 (2), row 10 (0: nothing hits there)
    assert chain_round_histogram(hits, scored, 3) == [1, 1, 1, 1]
    # one step: rows 1 (1) -> 3 (1) -> 5 (1) -> 7 (1) -> 9 (0) -> 10 (0)
    assert chain_round_histogram(hits, scored, 1) == [2, 4]
    scored[0, 6:9] = False  # rows 5..7 may not start a round (prompt there): row 1 (3) -> 5 skipped to 8 (0) -> 9 (0) -> 10 (0)
    assert chain_round_histogram(hits, scored, 3) == [3, 0, 0, 1]


def test_fused_loss_keeps_the_per_position_hits_it_counted():
    from backend.train.loss import fused_ttt_loss

    torch.manual_seed(3)
    batch, seq, hidden, vocab, steps = 2, 9, 8, 5, 3
    states = torch.randn(steps, batch, seq, hidden)
    head = torch.randn(vocab, hidden)
    target_logits = torch.randn(batch, seq, vocab)
    loss_mask = torch.ones(batch, seq, dtype=torch.bool)
    loss_mask[0, :3] = False
    teacher = make_teacher(target_logits, loss_mask, torch.ones(vocab, dtype=torch.bool))
    result = fused_ttt_loss(states, head, teacher, keep_hits=True)
    assert result.hits.shape == (steps, batch, seq) and torch.equal(teacher.scored, loss_mask)
    for k in range(steps):
        assert result.hits[k].sum() == round(float(result.accs[k]) * int(result.counts[k]))
        assert not result.hits[k, :, seq - 1 - k :].any()  # no target past the end
    assert fused_ttt_loss(states, head, teacher).hits is None
