#!/usr/bin/env python3
"""Step time of online training on real conversations against fixed-length samples of the same tokens per step.

Both rows run the trainer's own step (Trainer.train_step: the target inside the step, TTT unroll, loss, backward,
AdamW) in one process on one device, with the same target, profile, batch size, attention backend and draft init:

  * real:  the `data prepare` dir's conversations, tokenized through the chat template (the tokenization cache),
           batched as training batches them (right-padded to the bucket ladder of backend.train.data.bucket_length);
  * fixed: the same token stream cut into windows of one length L (L = the mean real tokens per sample of the real
           row), so every batch holds the same real tokens per step as the real row's mean but one shape.

On CUDA the target's pass runs from CUDA graphs (backend.train.target_graphs) in both rows, and a third row repeats
the real steps with it eager (ratio_target_eager_over_graphs_mean_step; --no-target-eager-row skips it). Then three
more real steps run under torch.cuda.set_sync_debug_mode("error"): host_syncs says "none" or where the host first
waited for the GPU (a wait empties the GPU's queue: the step becomes host time plus GPU time).

Reported per row: mean / median step (after --warmup steps), real tokens per step, padded positions per step, and
the number of graph (re)compiles during the timed steps (torch._dynamo's frame counter); then the ratio
real / fixed (issue goal: <= 1.3) and the distinct batch lengths seen; --torch-profile-steps N profiles N more real
steps (bench_trainer.profile_steps: kernel time by group, the GPU's idle share). --out writes the JSON.

  H200:  python benchmarks/bench_real_steps.py --data DIR --device cuda --attn-backend flex --steps 300 --out r.json
  CPU:   python benchmarks/bench_real_steps.py --data DIR --device cpu --batch-size 1 --steps 3 --warmup 1 \
             --seq-len 128
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def compile_count() -> int:
    try:
        from torch._dynamo.utils import counters
    except ImportError:
        return 0
    return int(sum(counters["frames"].values())) if "frames" in counters else 0


def fixed_length_splits(splits: dict, length: int) -> dict:
    """The train split's token stream (ids and loss masks, conversation after conversation) cut into `length` windows."""
    import torch

    from backend.train.data import Sample

    ids = torch.cat([s.input_ids for s in splits["train"]])
    mask = torch.cat([torch.as_tensor(s.loss_mask) for s in splits["train"]])
    count = ids.numel() // length
    train = [Sample(ids[i * length : (i + 1) * length].clone(), mask[i * length : (i + 1) * length].clone()) for i in range(count)]
    return {"train": train, "val": splits["val"][:8]}


def timed_steps(trainer, steps: int, warmup: int, device) -> dict:
    import torch

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()

    source = trainer.parts.source
    original = source.batch
    seen: dict[str, list[int]] = {"lengths": [], "tokens": [], "positions": []}

    def recording_batch(split, indices, dev):
        batch = original(split, indices, dev)
        seen["lengths"].append(int(batch.input_ids.shape[1]))
        seen["tokens"].append(int(batch.tokens or batch.input_ids.numel()))
        seen["positions"].append(int(batch.input_ids.numel()))
        return batch

    source.batch = recording_batch
    times = []
    compiles_before = 0
    for step in range(1, warmup + steps + 1):
        if step == warmup + 1:
            compiles_before = compile_count()
        sync()
        start = time.perf_counter()
        result, _grad_norm, _lr = trainer.train_step(step)
        float(result.total)
        sync()
        if step > warmup:
            times.append(time.perf_counter() - start)
    source.batch = original
    timed = slice(warmup, None)
    return {
        "steps": steps,
        "mean_step_s": statistics.fmean(times),
        "median_step_s": statistics.median(times),
        "p90_step_s": sorted(times)[int(0.9 * (len(times) - 1))],
        "real_tokens_per_step": statistics.fmean(seen["tokens"][timed]),
        "positions_per_step": statistics.fmean(seen["positions"][timed]),
        "distinct_lengths": sorted(set(seen["lengths"])),
        "compiles_during_timed_steps": compile_count() - compiles_before,
    }


def host_syncs(trainer, first_step: int, steps: int, device) -> str:
    """Run `steps` more steps under torch's sync debug mode: "none", or where the first host sync happened (CUDA only)."""
    import traceback

    import torch

    if device.type != "cuda":
        return "not checked (CPU)"
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for step in range(first_step, first_step + steps):
            trainer.train_step(step)
    except RuntimeError as exc:
        frames = [f"{frame.filename.rsplit('/', 2)[-1]}:{frame.lineno} {frame.name}" for frame in traceback.extract_tb(exc.__traceback__)[-4:]]
        return f"{str(exc).splitlines()[0]} at " + " <- ".join(reversed(frames))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return "none"


def build(profile, args, splits=None, target_graphs: bool | None = None):
    """A Trainer attached to a fresh draft on the real conversations (or on `splits` with the same target)."""
    import torch

    from backend.train.data import OnlineSource
    from backend.train.draft import DraftModelConfig
    from backend.train.trainer import DistContext, TrainOptions, Trainer

    options = TrainOptions(
        profile=profile,
        conversations=args.data,
        device=args.device,
        batch_size=args.batch_size,
        attn_backend=args.attn_backend,
        max_steps=10**6,
        seed=0,
        target_graphs=target_graphs,
    )
    trainer = Trainer(options)
    trainer.ctx = DistContext(device=torch.device(args.device))
    source = trainer._make_source() if splits is None else OnlineSource(args.target, splits, trainer._target_pass(args.target))
    torch.manual_seed(0)
    draft = trainer._fresh_draft(source, DraftModelConfig.from_profile(profile)).to(trainer.ctx.device)
    trainer.attach(trainer.ctx, source, draft)
    return trainer, source


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", default="smollm2-135m")
    parser.add_argument("--data", type=Path, required=True, help="a `data prepare` dir (or any chat file the trainer reads)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--batch-size", type=int, help="default: the profile's train.batch_size")
    parser.add_argument("--attn-backend", choices=["eager", "sdpa", "flex"])
    parser.add_argument("--seq-len", type=int, help="override the profile's train.seq_len")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--warmup", type=int, default=40, help="untimed steps first (compiles of the common lengths)")
    parser.add_argument(
        "--torch-profile-steps", type=int, default=0, help="then N more real steps under torch.profiler: kernels by group, the GPU's idle share"
    )
    parser.add_argument(
        "--no-target-eager-row", dest="target_eager_row", action="store_false", help="skip the real row with the target's pass eager (CUDA graphs off)"
    )
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()

    from backend.profiles import load_profile

    profile = load_profile(args.profile)
    args.batch_size = args.batch_size or profile.train.batch_size
    if args.seq_len:
        profile = profile.model_copy(update={"train": profile.train.model_copy(update={"seq_len": args.seq_len})})
    setup_start = time.perf_counter()
    real_trainer, real_source = build(profile, args)
    setup_s = time.perf_counter() - setup_start
    args.target = real_source.target
    real = timed_steps(real_trainer, args.steps, args.warmup, real_trainer.ctx.device)
    real["host_syncs"] = host_syncs(real_trainer, args.warmup + args.steps + 1, 3, real_trainer.ctx.device)
    real["target_pass"] = real_source.target_pass.describe()
    if args.torch_profile_steps > 0:  # where a real step's time goes: launch-bound (GPU idle) or kernel-bound
        from benchmarks.bench_trainer import profile_steps

        real["torch_profile"] = profile_steps(real_trainer, args.warmup + args.steps + 4, real_trainer.ctx.device, args.torch_profile_steps)
    length = max(2, round(real["real_tokens_per_step"] / args.batch_size))
    del real_trainer
    eager = None
    if args.target_eager_row and real_source.target_pass.enabled:  # the same real steps with the target's pass eager
        eager_trainer, eager_source = build(profile, args, real_source.splits, target_graphs=False)
        eager = timed_steps(eager_trainer, args.steps, args.warmup, eager_trainer.ctx.device)
        eager["target_pass"] = eager_source.target_pass.describe()
        del eager_trainer
    fixed_trainer, _ = build(profile, args, fixed_length_splits(real_source.splits, length))
    fixed = timed_steps(fixed_trainer, args.steps, args.warmup, fixed_trainer.ctx.device)
    result = {
        "profile": profile.name,
        "device": args.device,
        "batch_size": args.batch_size,
        "attn_backend": real_trainer_backend(args),
        "setup_s_before_step_1": round(setup_s, 2),
        "real": real,
        "fixed": {**fixed, "length": length},
        "ratio_real_over_fixed_mean_step": real["mean_step_s"] / fixed["mean_step_s"],
        "ratio_per_real_token": (real["mean_step_s"] / real["real_tokens_per_step"]) / (fixed["mean_step_s"] / fixed["real_tokens_per_step"]),
    }
    if eager is not None:
        result["real_target_eager"] = eager
        result["ratio_target_eager_over_graphs_mean_step"] = eager["mean_step_s"] / real["mean_step_s"]
    print(json.dumps(result, indent=1))
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


def real_trainer_backend(args) -> str:
    from backend.train.attention import default_backend

    return args.attn_backend or default_backend(args.device)


if __name__ == "__main__":
    raise SystemExit(main())
