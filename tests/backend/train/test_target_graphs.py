"""The target's pass of a training step: causal without a mask on right-padded batches; CUDA graphs only where they can run."""

import pytest
import torch

from backend.train.data import OnlineSource, Sample, collate, to_device
from backend.train.target import load_target
from backend.train.target_graphs import CAUSAL_ATTENTION, TargetPass, causal_attention, graphs_wanted


@pytest.fixture(scope="module")
def mini_target(mini_profile):
    return load_target(mini_profile)


def samples_of(lengths, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return [Sample(torch.randint(0, 256, (n,), generator=generator), torch.ones(n, dtype=torch.uint8)) for n in lengths]


def test_a_right_padded_batch_gives_each_conversation_its_own_states_and_logits(mini_target):
    """No mask: padding only ever follows a sample's tokens, so causal attention sees what the sample alone sees."""
    samples = samples_of([23, 9, 17, 2])
    source = OnlineSource(mini_target, {"train": samples, "val": samples[:1]})
    batch = source.batch("train", [0, 1, 2, 3], "cpu")
    assert batch.input_ids.shape == (4, 23) and batch.tokens == 23 + 9 + 17 + 2
    masked = mini_target.capture(*[collate(samples, source.pad_id, cap=source.longest)[key] for key in ("input_ids", "attention_mask")])
    for row, sample in enumerate(samples):
        n = len(sample.input_ids)
        alone = mini_target.capture(sample.input_ids[None])
        torch.testing.assert_close(batch.aux_hidden[row, :n], alone.aux_hidden[0], atol=2e-5, rtol=1e-5)
        torch.testing.assert_close(batch.target_logits[row, :n], alone.logits[0], atol=2e-5, rtol=1e-5)
        torch.testing.assert_close(batch.target_logits[row, :n], masked.logits[row, :n], atol=2e-5, rtol=1e-5)  # the masked pass it replaces
        assert batch.loss_mask[row, n:].sum() == 0  # padded positions are never scored


def test_the_pass_attends_through_its_causal_function_and_puts_sdpa_back(mini_target):
    """Under stream capture transformers would build a full mask for "sdpa"; its own registered function builds none."""
    ids = torch.randint(0, 256, (2, 13), generator=torch.Generator().manual_seed(6))
    model = mini_target.model
    assert model.config._attn_implementation == "sdpa"
    with causal_attention(model):
        assert model.config._attn_implementation == CAUSAL_ATTENTION
        inside = mini_target.capture(ids)
    assert model.config._attn_implementation == "sdpa"
    outside = mini_target.capture(ids)
    assert torch.equal(inside.logits, outside.logits) and torch.equal(inside.aux_hidden, outside.aux_hidden)
    with pytest.raises(RuntimeError, match="stop"), causal_attention(model):
        raise RuntimeError("stop")
    assert model.config._attn_implementation == "sdpa"  # put back after a failure too


def test_graphs_run_only_on_a_gpu_holding_the_whole_target(mini_target):
    assert graphs_wanted(mini_target, None, {}) == (False, "the target runs on cpu")
    assert graphs_wanted(mini_target, True, {}) == (False, "the target runs on cpu")
    assert graphs_wanted(mini_target, False, {}) == (False, "turned off")
    assert graphs_wanted(mini_target, None, {"EAGLE3_TARGET_GRAPHS": "0"}) == (False, "turned off")


def test_an_eager_pass_says_so_and_gives_the_targets_own_outputs(mini_target):
    ids = torch.randint(0, 256, (2, 11), generator=torch.Generator().manual_seed(3))
    target_pass = TargetPass(mini_target, enabled=False)
    (aux, logits), want = target_pass(ids), mini_target.capture(ids)
    assert torch.equal(logits, want.logits) and torch.equal(aux, want.aux_hidden)
    assert target_pass.describe() == "eager (not enabled)" and target_pass.graphs == {} and target_pass.replays == 0


def test_a_graph_keeps_its_shapes_aux_states_and_logits(mini_target):
    """What the byte budget counts: SmolLM2's 16 x 1,024 batch in bf16 keeps (1,728 + 49,152) x 2 bytes a position, 1.67 GB."""
    assert TargetPass(mini_target, enabled=False).output_bytes((16, 1024)) == 16 * 1024 * (3 * 32 + 259) * 4  # 3 aux layers of 32, 259 ids, float32


def test_host_tensors_reach_the_cpu_unchanged():
    tensor = torch.arange(6).reshape(2, 3)
    moved = to_device(tensor, "cpu")
    assert torch.equal(moved, tensor) and moved.device.type == "cpu"


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run on the lent H200)")


@needs_cuda
def test_on_a_gpu_graph_replays_give_the_eager_pass_for_every_shape(mini_profile):
    target = load_target(mini_profile, device="cuda", dtype="float32")
    assert graphs_wanted(target, None, {}) == (True, "")
    logged: list[str] = []
    budget = TargetPass(target, enabled=False).output_bytes((3, 24)) + TargetPass(target, enabled=False).output_bytes((2, 16))
    target_pass = TargetPass(target, enabled=True, log=logged.append, max_output_bytes=budget)
    generator = torch.Generator().manual_seed(4)
    for shape in [(3, 24), (3, 24), (2, 16), (3, 24), (1, 8), (2, 16)]:  # (1, 8) would pass the byte budget: eager
        ids = torch.randint(0, 256, shape, generator=generator).cuda()
        aux, logits = target_pass(ids)
        want = target.capture(ids)
        torch.testing.assert_close(aux, want.aux_hidden, rtol=0.0, atol=1e-5)
        torch.testing.assert_close(logits, want.logits, rtol=0.0, atol=1e-5)
    assert sorted(target_pass.graphs) == [(2, 16), (3, 24)] and target_pass.replays == 5
    assert target_pass.off_reason is None and target_pass.describe() == "CUDA graphs (2 shape(s) captured, 5 replays)"
    assert len(logged) == 1 and logged[0].startswith("target pass: CUDA graph of shape (3, 24) matches eager (largest difference ")
    wide = TargetPass(target, enabled=True, log=logged.append)
    ids = torch.randint(0, 256, (4, 12), generator=generator).cuda()
    torch.cuda.set_sync_debug_mode("error")
    try:  # a new shape's capture and check wait for the GPU once, allowed; a replay never waits
        first, again = wide(ids), wide(ids)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert wide.off_reason is None and wide.replays == 2 and first[1] is again[1]
    torch.testing.assert_close(again[1], target.capture(ids).logits, rtol=0.0, atol=1e-5)


@needs_cuda
def test_on_a_gpu_a_training_step_never_waits_for_the_gpu(mini_profile):
    """Each host sync empties the GPU's queue and leaves it idle while the host launches the next kernels: a real
    SmolLM2 step was host-bound (4 x 1,024 took 70 ms, 16 x 1,024 83 ms). After the first steps (compiles, captures)
    none may wait (one batch shape here: a new one also compiles the draft's regions anew); torch's sync debug mode
    raises at any that does."""
    from backend.train.draft import DraftModelConfig
    from backend.train.trainer import DistContext, TrainOptions, Trainer

    trainer = Trainer(TrainOptions(profile=mini_profile, device="cuda", batch_size=3, max_steps=10**6, seed=0))
    trainer.ctx = DistContext(device=torch.device("cuda"))
    target = load_target(mini_profile, device="cuda")
    source = OnlineSource(target, {"train": samples_of([32] * 24), "val": samples_of([12, 30])}, trainer._target_pass(target))
    trainer.attach(trainer.ctx, source, trainer._fresh_draft(source, DraftModelConfig.from_profile(mini_profile)).cuda())
    for step in range(4):
        trainer.train_step(step)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for step in range(4, 10):
            trainer.train_step(step)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert source.target_pass.off_reason is None and source.target_pass.replays >= 6
