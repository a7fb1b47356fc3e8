#!/usr/bin/env python3
"""Kernel launches of one online training step, phase by phase, and the batch shapes a run's sampler makes.

What a GPU's host has to issue each step, counted on any machine: torch.profiler over one real step of the trainer's
own parts (benchmarks/bench_real_steps.build: the profile's target, a `data prepare` dir's conversations, a fresh draft),
split into the target's pass, the teacher, the TTT unroll, the fused loss, backward and AdamW. "aten ops" counts every
dispatched op; "launching" leaves out views, metadata and allocation ops, which start no kernel on a GPU. On the CPU
the draft's regions run eagerly (on CUDA they are compiled: fewer launches there), the target's pass is eager either way
unless CUDA graphs replay it (backend/train/target_graphs.py). Then --batches N batches of the sampler (with
--group-by-length as the round trains): padded positions, real and scored tokens, and the distinct batch shapes with
their share (each shape is one CUDA graph of the target's pass).

    python benchmarks/step_launches.py --data DIR [--extra DIR] --seq-len 64 --batch-size 16 --batches 300 --out launches.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

NOT_LAUNCHING = {  # ops that start no kernel on a GPU: views, metadata, allocation, and wrappers counted by their parts
    "aten::as_strided", "aten::view", "aten::transpose", "aten::t", "aten::reshape", "aten::_unsafe_view", "aten::slice",
    "aten::narrow", "aten::unsqueeze", "aten::select", "aten::_reshape_alias", "aten::expand", "aten::permute",
    "aten::squeeze", "aten::detach", "aten::alias", "aten::resolve_conj", "aten::resolve_neg", "aten::empty",
    "aten::empty_strided", "aten::empty_like", "aten::result_type", "aten::lift_fresh", "aten::split", "aten::chunk",
    "aten::unbind", "aten::contiguous", "aten::matmul", "aten::linear", "aten::to", "aten::_to_copy",
    "aten::scaled_dot_product_attention", "aten::flatten", "aten::dropout",
}  # fmt: skip


def counted(label: str, work):
    """(work(), {"wall_ms", "aten_ops", "launching"}) under torch.profiler (CPU activity)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        started = time.perf_counter()
        result = work()
        wall = time.perf_counter() - started
    ops = [event for event in prof.key_averages() if event.key.startswith("aten::")]
    return result, {
        "phase": label,
        "wall_ms": round(wall * 1e3, 1),
        "aten_ops": sum(event.count for event in ops),
        "launching": sum(event.count for event in ops if event.key not in NOT_LAUNCHING),
    }


def step_phases(trainer) -> list[dict]:
    from backend.train.loss import fused_ttt_loss, make_teacher

    parts, ttt = trainer.parts, trainer.settings.ttt_length
    rows = []
    batch, row = counted("target pass (collate, target, to device)", lambda: parts.source.batch("train", parts.sampler.next(), trainer.ctx.device))
    rows.append(row)
    teacher, row = counted("teacher", lambda: make_teacher(batch.target_logits, batch.loss_mask, parts.draft.t2d, draft_ids=parts.draft_ids))
    rows.append(row)
    aux = batch.aux_hidden.to(parts.draft.fc.weight.dtype)
    states, row = counted("TTT unroll", lambda: parts.draft.ttt_hidden(aux, batch.input_ids, ttt))
    rows.append(row)
    loss, row = counted("fused lm_head + loss", lambda: fused_ttt_loss(states, parts.draft.lm_head.weight, teacher, compiled=parts.compiled))
    rows.append(row)
    rows.append(counted("backward", lambda: loss.total.backward())[1])
    rows.append(counted("AdamW (with clipping)", lambda: trainer._optimizer_step(trainer.step + 1))[1])
    rows.append(counted("whole step (train_step)", lambda: trainer.train_step(trainer.step + 2))[1])
    return rows


def batch_shapes(source, sampler, batches: int) -> dict:
    from backend.train.data import collate

    positions, real, scored = [], [], []
    shapes: Counter[str] = Counter()
    for _ in range(batches):
        data = collate([source.splits["train"][i] for i in sampler.next()], source.pad_id, cap=source.longest)
        rows, length = data["input_ids"].shape
        positions.append(rows * length)
        real.append(data["tokens"])
        scored.append(int(data["loss_mask"].sum()))
        shapes[f"{rows}x{length}"] += 1
    mean = statistics.fmean
    return {
        "batches": batches,
        "positions_per_batch": round(mean(positions)),
        "real_tokens_per_batch": round(mean(real)),
        "scored_tokens_per_batch": round(mean(scored)),
        "real_share": round(mean(real) / mean(positions), 3),
        "scored_share": round(mean(scored) / mean(positions), 3),
        "shapes": {shape: round(count / batches, 3) for shape, count in shapes.most_common()},
    }


def sampler_shapes(profile, args) -> dict:
    """batch_shapes of the sampler a training run builds (extra conversations, length grouping) at --shape-seq-len."""
    import torch

    from backend.train.data import BatchSampler, OnlineSource
    from backend.train.trainer import DistContext, TrainOptions, Trainer

    if args.shape_seq_len:
        profile = profile.model_copy(update={"train": profile.train.model_copy(update={"seq_len": args.shape_seq_len})})
    options = TrainOptions(profile=profile, conversations=args.data, extra_conversations=tuple(args.extra), device="cpu", seed=0)
    trainer = Trainer(options)
    trainer.ctx = DistContext(device=torch.device("cpu"))
    source = trainer._make_source()
    if not isinstance(source, OnlineSource):
        raise SystemExit("the batch shapes need conversations (an online source)")
    lengths = source.lengths("train") if args.group_by_length else None
    sampler = BatchSampler(source.size("train"), args.batch_size, seed=0, lengths=lengths)
    return {"seq_len": profile.train.seq_len, "group_by_length": args.group_by_length, **batch_shapes(source, sampler, args.batches)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", default="smollm2-135m")
    parser.add_argument("--data", type=Path, required=True, help="a `data prepare` or `data regenerate` dir (or a chat file)")
    parser.add_argument("--extra", type=Path, action="append", default=[], help="more training conversations (train --extra-conversations)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--batch-size", type=int, help="default: the profile's")
    parser.add_argument("--seq-len", type=int, help="the step's sequence cap (default: the profile's); small keeps a CPU step cheap")
    parser.add_argument("--shape-seq-len", type=int, help="the sequence cap of the batch-shape statistics (default: the profile's)")
    parser.add_argument("--batches", type=int, default=0, help="then this many sampler batches' shapes")
    parser.add_argument("--no-group-by-length", dest="group_by_length", action="store_false")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()

    import torch

    from backend.profiles import load_profile
    from benchmarks.bench_real_steps import build

    profile = load_profile(args.profile)
    args.batch_size = args.batch_size or profile.train.batch_size
    args.attn_backend = None
    stepped = profile.model_copy(update={"train": profile.train.model_copy(update={"seq_len": args.seq_len})}) if args.seq_len else profile
    trainer, _source = build(stepped, args)
    trainer.step = 0
    for _ in range(2):  # warm: the first steps allocate, compile (CUDA) and capture
        trainer.train_step(trainer.step)
        trainer.step += 1
    if trainer.ctx.device.type == "cuda":
        torch.cuda.synchronize()
    result: dict = {"profile": profile.name, "device": args.device, "batch_size": args.batch_size, "seq_len": stepped.train.seq_len}
    result["phases"] = step_phases(trainer)
    if args.batches:
        result["batch_shapes"] = sampler_shapes(profile, args)
    print(json.dumps(result, indent=1))
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
