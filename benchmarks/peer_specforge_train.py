#!/usr/bin/env python3
"""SpecForge v0.3.0's own EAGLE-3 training of a SmolLM2-135M draft on a `data prepare` dir, for a wall-clock budget, exported for our engine.

This file holds no SpecForge code. It imports a source export of SpecForge v0.3.0 (commit 2768619e, see
benchmarks/bench_specforge_v03.py) and drives its EAGLE-3 training from its own parts:

  * settings:   specforge.config.schema.TrainingConfig() defaults (lr 1e-4, cosine with warmup ratio 0.015,
                clip 0.5, TTT 7, batch size 1, seed 42) and ModelConfig (bf16 on CUDA, the target embedding copied
                into the draft and frozen, the vocab mapping file);
  * draft:      algorithms.model_providers.build_eagle3_draft from a LlamaForCausalLMEagle3 config written from
                profiles/smollm2-135m.toml (draft vocab 32,000, aux layers [1, 14, 26]: bench_specforge_v03's
                draft_config_dict); algorithms.eagle3.model.OnlineEagle3Model around it;
  * teacher:    modeling.target.target_head.TargetHead over the target's lm_head (SmolLM2 ties it to the embedding
                and ships one model.safetensors, which TargetHead.load_weights cannot read: it wants an index.json
                and an lm_head.weight key, so the tied weight is copied into its fc);
  * backend:    training.backend.FSDPTrainingBackend (FSDP1 SHARD_GRAD_OP, bf16, on CUDA; unwrapped on CPU) with
                training.assembly's optimizer factory (BF16Optimizer: fp32 master AdamW + its LR scheduler);
  * step, loop: algorithms.eagle3.providers.build_step (Eagle3TrainStrategy) in training.controller.TrainerCore,
                run by training.controller.TrainerController.fit (its per-step metrics, its checkpoint layout);
  * per sample: algorithms.eagle3.data.normalize_offline_sample (max length, last loss position cleared) and
                algorithms.common.collation.pad_and_concatenate_features;
  * saving:     TrainerController.save_checkpoint, then export.to_sglang.export_to_sglang (SpecForge's exported
                format), then our `eagle3-host convert` (backend.train.convert) into what
                `eagle3-host serve --draft DIR --engine reference` loads.

Where v0.3.0 has no part to use:
  * the target's features. v0.3.0 captures them only through SGLang (offline capture or a capture server); it has
    no Hugging Face target wrapper any more, and SGLang is not on the GPU image. So the HF target runs here, in
    the loop, as SpecForge <= 0.2's HF target did: aux = hidden_states[id + 1] for ids [1, 14, 26] (SGLang's
    convention), target = the final normed hidden state (TargetHead's fc turns it into the teacher logits).
  * the tokens. The conversations are tokenized by our data path (backend.train.data.conversation_samples: the
    tokenizer's own ChatML template, loss mask on the assistant turns, cut at --max-length, default the
    profile's 1,024), so both trainers read the same tokens with the same mask; SpecForge's own preprocessing
    module imports `datasets`, which the GPU image lacks.
  * the vocab mapping. The same top-32,000 loss-masked frequency rule as SpecForge's
    process_token_dict_to_mappings (which lives in that same `datasets` module), computed by
    backend.train.vocab over the same train split: both drafts get the same draft vocabulary.
  * a wall-clock budget. SpecForge schedules over a step count. Unless --total-steps is given, a probe (a
    throw-away copy of the whole setup, --probe-steps steps) measures the step time, and the cosine runs over the
    steps the rest of the budget holds; the probe's time counts against the budget.

Attention: flex_attention on CUDA (SpecForge's default), sdpa on CPU (flex attention has no CPU backward).
Triton: SpecForge's LogSoftmaxLoss is a triton kernel; on CPU it runs under TRITON_INTERPRET=1, in the side venv
of benchmarks/peer_specforge_draft.py (triton over the project venv), which this script builds and re-runs
itself in when triton is missing here.

  GPU:  python3 benchmarks/peer_specforge_train.py --data DATA --target-dir MODEL_DIR --specforge-src SRC \\
            --seconds 900 --device cuda --out OUT
  CPU:  .venv/bin/python benchmarks/peer_specforge_train.py --data DATA --target-dir MODEL_DIR --seconds 20 \\
            --device cpu --out /tmp/sf-peer
Writes OUT/result.json (steps, tokens, GPU-seconds, per-step loss/acc in OUT/metrics.jsonl), OUT/specforge-run
(SpecForge's checkpoint), OUT/specforge-export (its exported draft) and OUT/draft (ours to serve).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.bench_specforge_v03 import V03_COMMIT, BenchError, draft_config_dict, import_specforge, init_process_group  # noqa: E402

SPECFORGE_MODULES = (
    "specforge.config.schema",
    "specforge.algorithms.model_providers",
    "specforge.algorithms.eagle3.model",
    "specforge.algorithms.eagle3.providers",
    "specforge.algorithms.eagle3.data",
    "specforge.algorithms.common.collation",
    "specforge.modeling.auto",
    "specforge.modeling.target.target_head",
    "specforge.training.backend",
    "specforge.training.assembly",
    "specforge.training.controller",
    "specforge.runtime.contracts",
    "specforge.export.to_sglang",
)
SEQUENCE_AXES = {"input_ids": 1, "attention_mask": 1, "loss_mask": 1, "hidden_state": 1, "target": 1}


def log(message: str) -> None:
    print(f"peer_specforge_train: {message}", flush=True)


def default_src() -> Path:
    from backend.train.tiny import cache_root

    cached = cache_root() / "specforge-v0.3.0"
    return cached if cached.is_dir() else ROOT / ".device" / "specforge-v0.3.0"


# --------------------------------------------------------------------------- the target's features (HF, in the loop)


class HFTargetFeatures:
    """The HF target: per sample, SpecForge's offline feature names (aux_hidden_state, hidden_state) for its normalizer."""

    def __init__(self, target_dir: Path, aux_layer_ids: list[int], device, dtype):
        import torch
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=dtype).to(device).eval()
        self.aux_layer_ids = list(aux_layer_ids)
        self.device = device
        self.torch = torch

    def lm_head_weight(self):
        return self.model.get_output_embeddings().weight

    def features(self, input_ids, loss_mask) -> dict:
        torch = self.torch
        with torch.no_grad():
            out = self.model.model(input_ids=input_ids[None].to(self.device), output_hidden_states=True, use_cache=False)
        states = out.hidden_states  # [embeddings, layer 0 output, ...]: SGLang id L captures layer L's output
        return {
            "input_ids": input_ids.to(self.device),
            "loss_mask": loss_mask.to(self.device).long(),
            "aux_hidden_state": torch.cat([states[i + 1] for i in self.aux_layer_ids], dim=-1),
            "hidden_state": out.last_hidden_state,
        }


# --------------------------------------------------------------------------- SpecForge's training, assembled


def build_trainer(sf: dict, args, paths: SimpleNamespace, target: HFTargetFeatures, total_steps: int, run_dir: Path):
    """Draft, train module, teacher head, backend, step and controller, as specforge.training.assembly builds them."""
    import torch

    schema = sf["specforge.config.schema"]
    training = schema.TrainingConfig(attention_backend=args.attention_backend, max_steps=total_steps, total_steps=total_steps, log_interval=1)
    cfg = SimpleNamespace(
        mode="offline",
        training=training,
        model=schema.ModelConfig(target_model_path=str(args.target_dir), vocab_mapping_path=str(paths.vocab_mapping), torch_dtype=args.dtype),
    )
    torch.manual_seed(training.seed)
    draft_config = sf["specforge.modeling.auto"].AutoDraftModelConfig.from_file(str(paths.draft_config))
    draft = sf["specforge.algorithms.model_providers"].build_eagle3_draft(cfg, draft_config)
    model = (
        sf["specforge.algorithms.eagle3.model"]
        .OnlineEagle3Model(
            draft_model=draft,
            length=training.ttt_length,
            attention_backend=training.attention_backend,
            lk_loss_type=training.lk_loss_type,
            kl_scale=training.kl_scale,
            kl_decay=training.kl_decay,
        )
        .to(device=args.torch_device, dtype=getattr(torch, args.dtype))
    )
    head = sf["specforge.modeling.target.target_head"].TargetHead(str(args.target_dir))
    with torch.no_grad():
        head.fc.weight.copy_(target.lm_head_weight())
    head.freeze_weights()
    head = head.eval().to(device=args.torch_device, dtype=getattr(torch, args.dtype))
    backend_mod = sf["specforge.training.backend"]
    parallel = backend_mod.ParallelConfig.from_distributed(tp_size=1, sp_ulysses_size=1, sp_ring_size=1)
    backend = backend_mod.FSDPTrainingBackend(parallel, optimizer_factory=sf["specforge.training.assembly"]._ConfiguredOptimizerFactory(cfg))
    wrapped = backend.prepare_model(model, wrap=args.torch_device.type == "cuda", optimizer_target=model.draft_model)
    eagle3 = sf["specforge.algorithms.eagle3.providers"]
    strategy = eagle3.build_step(wrapped, target_head=head, **eagle3.step_options(cfg))
    controller_mod = sf["specforge.training.controller"]
    core = controller_mod.TrainerCore(strategy, backend, accumulation_steps=training.accumulation_steps)
    controller = controller_mod.TrainerController(
        core,
        run_id="peer-smollm2",
        output_dir=str(run_dir),
        log_interval=1,
        max_steps=total_steps,
        total_steps=total_steps,
        num_epochs=10**6,  # the budget ends the run, not the epoch count
    )
    return SimpleNamespace(training=training, draft=draft, model=model, backend=backend, core=core, controller=controller)


class Batches:
    """TrainBatch after TrainBatch from the tokenized samples (seeded shuffle per epoch) until the clock or the list ends."""

    def __init__(self, sf: dict, samples: list, target: HFTargetFeatures, batch_size: int, max_length: int, seed: int, deadline: float | None):
        self.sf, self.samples, self.target = sf, samples, target
        self.batch_size, self.max_length, self.seed, self.deadline = batch_size, max_length, seed, deadline
        self.tokens = self.loss_tokens = self.batches = 0
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def one(self, indices: list[int]):
        sf = self.sf
        normalize = sf["specforge.algorithms.eagle3.data"].normalize_offline_sample
        features = [normalize(self.target.features(self.samples[i].input_ids, self.samples[i].loss_mask), max_len=self.max_length) for i in indices]
        tensors = sf["specforge.algorithms.common.collation"].pad_and_concatenate_features(
            features, sequence_axes=SEQUENCE_AXES, required_keys=tuple(SEQUENCE_AXES)
        )
        return sf["specforge.runtime.contracts"].TrainBatch(
            sample_ids=[f"s{i}" for i in indices], strategy="eagle3", tensors=tensors, metadata={"target_repr": "hidden_state"}
        )

    def __iter__(self):
        import torch

        order = torch.randperm(len(self.samples), generator=torch.Generator().manual_seed(self.seed + self.epoch)).tolist()
        for start in range(0, len(order) - self.batch_size + 1, self.batch_size):
            if self.deadline is not None and time.perf_counter() >= self.deadline:
                return
            batch = self.one(order[start : start + self.batch_size])
            self.batches += 1
            self.tokens += int(batch.tensors["attention_mask"].sum())
            self.loss_tokens += int(batch.tensors["loss_mask"].sum())
            yield batch


def plain(value):
    """A metric value as JSON: float, list of floats, or None (SpecForge's own _logger does the same)."""
    try:
        return float(value)
    except (TypeError, ValueError):
        try:
            return [float(item) for item in value]
        except (TypeError, ValueError):
            return None


def probe_step_seconds(sf, args, paths, target, samples, run_dir: Path, deadline: float) -> float:
    """Median seconds per optimizer step of a throw-away copy of the whole setup (first step excluded: warm-up).

    Stops early at the deadline (then the schedule holds a single step)."""
    parts = build_trainer(sf, args, paths, target, total_steps=10**6, run_dir=run_dir)
    batches = iter(Batches(sf, samples, target, args.batch_size, args.max_length, args.seed + 1000, None))
    times: list[float] = []
    for _ in range(args.probe_steps):
        if time.perf_counter() >= deadline:
            break
        sync(args.torch_device)
        start = time.perf_counter()
        parts.core.train_step(next(batches))
        sync(args.torch_device)
        times.append(time.perf_counter() - start)
    del parts
    return statistics.median(times[1:] or times)


def sync(device) -> None:
    if device.type == "cuda":
        import torch

        torch.cuda.synchronize(device)


def run(args) -> dict:
    started = time.perf_counter()
    sf = import_specforge(args.specforge_src, SPECFORGE_MODULES)
    import torch

    from backend.profiles import load_profile
    from backend.train.convert import convert_checkpoint
    from backend.train.data import conversation_samples
    from backend.train.target import load_tokenizer
    from backend.train.vocab import build_vocab_mapping, count_tokens, coverage

    profile = load_profile(args.profile)
    args.torch_device = torch.device(args.device)
    if args.torch_device.type == "cuda":
        # set_device wants an index: "cuda" alone was refused on the H200 (torch 2.11), so "cuda" means cuda:0
        args.torch_device = torch.device("cuda", args.torch_device.index or 0)
        torch.cuda.set_device(args.torch_device)
    args.dtype = "bfloat16" if args.torch_device.type == "cuda" else "float32"
    args.attention_backend = args.attention_backend or (
        sf["specforge.config.schema"].TrainingConfig().attention_backend if args.torch_device.type == "cuda" else "sdpa"
    )
    args.max_length = args.max_length or profile.train.seq_len
    defaults = sf["specforge.config.schema"].TrainingConfig()
    args.batch_size = args.batch_size or defaults.batch_size
    args.seed = defaults.seed
    made_group = init_process_group(args.torch_device)
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    for name in ("specforge-run", "specforge-export", "draft"):
        if (out / name).exists():
            raise BenchError(f"{out / name} already exists; pick a new --out (nothing was changed)")

    tokenizer = load_tokenizer(str(args.target_dir))
    splits = conversation_samples(tokenizer, args.data, args.max_length, log=log)
    train, val = splits["train"], splits["val"]
    vocab = profile.target.vocab_size
    counts = count_tokens(((s.input_ids, s.loss_mask) for s in train), vocab)
    d2t, t2d = build_vocab_mapping(counts, profile.draft.draft_vocab_size)
    paths = SimpleNamespace(draft_config=out / "draft_config.json", vocab_mapping=out / "vocab_mapping.pt")
    paths.draft_config.write_text(json.dumps(draft_config_dict(profile), indent=1) + "\n")
    torch.save({"d2t": d2t, "t2d": t2d}, paths.vocab_mapping)
    target = HFTargetFeatures(args.target_dir, list(profile.target.aux_layer_ids), args.torch_device, getattr(torch, args.dtype))
    setup_s = time.perf_counter() - started
    log(
        f"setup {setup_s:.1f} s: {len(train)} train / {len(val)} val conversations, draft vocab covers {100 * coverage(counts, t2d):.1f} % of "
        f"trained tokens; SpecForge {args.attention_backend}, batch {args.batch_size} x <= {args.max_length}, budget {args.seconds:g} s"
    )

    clock = time.perf_counter()
    deadline = clock + args.seconds
    probe_s = None
    if args.total_steps:
        total_steps, schedule = args.total_steps, "--total-steps"
    elif args.probe_steps == 0:
        total_steps, schedule = max(1, len(train) // args.batch_size), "one epoch (SpecForge's num_epochs=1)"
    else:
        probe_s = probe_step_seconds(sf, args, paths, target, train, Path(tempfile.mkdtemp(prefix="sf-probe-")), deadline)
        total_steps, schedule = max(1, int((deadline - time.perf_counter()) / probe_s)), f"probed: {args.probe_steps} steps"
        log(f"probe: {probe_s * 1e3:.1f} ms per step")
    log(f"the {defaults.lr_scheduler} schedule runs over {total_steps} steps ({schedule})")
    parts = build_trainer(sf, args, paths, target, total_steps, out / "specforge-run")
    batches = Batches(sf, train, target, args.batch_size, args.max_length, args.seed, deadline)
    metrics_file = (out / "metrics.jsonl").open("w")
    last: dict = {}

    def logger(metrics, step):
        record = {"step": step, "time": round(time.perf_counter() - clock, 3)}
        record.update({k: v for k, v in ((k, plain(v)) for k, v in metrics.items()) if v is not None})
        metrics_file.write(json.dumps(record) + "\n")
        metrics_file.flush()
        last.clear()
        last.update(record)
        if step == 1 or step % args.print_every == 0:
            accs = " ".join(f"{record[f'acc_{k}']:.3f}" for k in range(parts.training.ttt_length) if f"acc_{k}" in record)
            log(f"step {step}: loss {record.get('loss', float('nan')):.4f}, acc per TTT position {accs}, lr {record.get('lr', 0):.2e}")

    parts.controller.logger = logger
    loop_start = time.perf_counter()
    steps = parts.controller.fit(batches)
    sync(args.torch_device)
    loop_s = time.perf_counter() - loop_start
    train_s = time.perf_counter() - clock
    metrics_file.close()

    val_batches = [batches.one([i]) for i in range(min(len(val), args.val_samples))]
    evaluation = {k: plain(v) for k, v in parts.controller.evaluate(val_batches).items()} if val_batches else {}
    checkpoint = parts.controller.save_checkpoint(steps)
    export_dir = out / "specforge-export"
    sf["specforge.export.to_sglang"].export_to_sglang(checkpoint.checkpoint_uri, str(paths.draft_config), str(export_dir))
    report = convert_checkpoint(export_dir, out / "draft", aux_layer_ids=list(profile.target.aux_layer_ids))
    if made_group:
        import torch.distributed as dist

        dist.destroy_process_group()
    commit_file = args.specforge_src / "SPECFORGE_COMMIT"
    result = {
        "script": "benchmarks/peer_specforge_train.py",
        "specforge_version": "v0.3.0",
        "specforge_commit": commit_file.read_text().strip() if commit_file.is_file() else None,
        "device": torch.cuda.get_device_name(args.torch_device) if args.torch_device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "profile": profile.name,
        "data": str(args.data),
        "train_conversations": len(train),
        "val_conversations": len(val),
        "attention_backend": args.attention_backend,
        "fsdp": args.torch_device.type == "cuda",
        "dtype": args.dtype,
        "batch_size": args.batch_size,
        "max_length": args.max_length,
        "training_config": {k: getattr(parts.training, k) for k in ("learning_rate", "lr_scheduler", "warmup_ratio", "max_grad_norm", "ttt_length", "seed")},
        "schedule_total_steps": total_steps,
        "schedule_from": schedule,
        "probe_step_s": probe_s,
        "budget_s": args.seconds,
        "setup_s": round(setup_s, 2),
        "train_wall_s": round(train_s, 2),
        "fit_wall_s": round(loop_s, 2),
        "gpu_seconds": round(train_s, 2) if args.torch_device.type == "cuda" else 0.0,
        "steps": steps,
        "epochs": round(batches.batches * args.batch_size / max(1, len(train)), 3),
        "tokens": batches.tokens,
        "loss_tokens": batches.loss_tokens,
        "last_step": last,
        "eval": evaluation,
        "eval_samples": len(val_batches),
        "draft_vocab_coverage_train": coverage(counts, t2d),
        "specforge_checkpoint": checkpoint.checkpoint_uri,
        "specforge_export": str(export_dir),
        "draft": str(out / "draft"),
        "convert": report.as_dict(),
        "finite": all(math.isfinite(v) for v in (last.get("loss", float("nan")),)),
    }
    (out / "result.json").write_text(json.dumps(result, indent=1) + "\n")
    log(
        f"RESULT {steps} steps in {train_s:.1f} s ({result['gpu_seconds']} GPU-s), {batches.tokens} tokens ({batches.loss_tokens} in the loss); "
        f"last loss {last.get('loss')}; served draft at {out / 'draft'}"
    )
    return result


# --------------------------------------------------------------------------- entry (and the CPU side venv)


def _has_triton() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def rerun_in_side_venv(argv: list[str], src: Path) -> int:
    """Run this script again in peer_specforge_draft.py's side venv (triton over the project venv, TRITON_INTERPRET=1)."""
    from benchmarks.peer_specforge_draft import cache_root, ensure_venv, inner_env, venv_python

    venv = Path(os.environ.get("PEER_SPECFORGE_VENV") or cache_root() / "peer-specforge")
    ensure_venv(venv, src)
    log(f"triton is missing here: running in the side venv {venv} (TRITON_INTERPRET=1)")
    return subprocess.run([str(venv_python(venv)), str(Path(__file__).resolve()), *argv], cwd=ROOT, env=inner_env(src)).returncode


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, required=True, help="a `data prepare` or `data regenerate` dir (train.jsonl, val.jsonl)")
    parser.add_argument("--target-dir", type=Path, required=True, help="the prepared SmolLM2 HF dir (`eagle3-host target prepare smollm2-135m-instruct`)")
    parser.add_argument("--specforge-src", type=Path, default=None, help="a source export of SpecForge v0.3.0 (default: <cache>/specforge-v0.3.0)")
    parser.add_argument("--seconds", type=float, required=True, help="training wall-clock budget (the probe included, setup excluded)")
    parser.add_argument("--device", default=None, help="cuda, cuda:1 or cpu (default: cuda when present)")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--profile", default="smollm2-135m", help="the draft and target shape (default smollm2-135m)")
    parser.add_argument("--batch-size", type=int, help="default: SpecForge's TrainingConfig().batch_size (1)")
    parser.add_argument("--max-length", type=int, help="tokens per conversation (default: the profile's seq_len, as ours)")
    parser.add_argument("--total-steps", type=int, help="the LR schedule's length (default: the steps the budget holds, probed)")
    parser.add_argument(
        "--probe-steps", type=int, default=None, help="steps of the schedule probe (default 12 on CUDA; 0 on CPU: the schedule spans one epoch)"
    )
    parser.add_argument("--attention-backend", choices=["flex_attention", "sdpa"], help="default: flex_attention on CUDA, sdpa on CPU")
    parser.add_argument("--val-samples", type=int, default=64, help="val conversations for SpecForge's evaluator after training")
    parser.add_argument("--print-every", type=int, default=50)
    args = parser.parse_args(argv)
    args.specforge_src = (args.specforge_src or default_src()).expanduser()
    if args.seconds <= 0:
        parser.error("--seconds must be > 0; nothing was run")
    for flag, least in (("batch_size", 1), ("max_length", 1), ("total_steps", 1), ("probe_steps", 0)):
        if getattr(args, flag) is not None and getattr(args, flag) < least:
            parser.error(f"--{flag.replace('_', '-')} must be >= {least}; nothing was run")
    from backend.train.conversations import PREPARE_META
    from backend.train.regenerate import REGENERATE_META

    if not any((args.data / meta).is_file() for meta in (PREPARE_META, REGENERATE_META)):
        parser.error(f"--data: {args.data} holds neither {PREPARE_META} nor {REGENERATE_META} (not a `data prepare` or `data regenerate` dir); nothing was run")
    if not (args.target_dir / "config.json").is_file():
        parser.error(f"--target-dir: {args.target_dir / 'config.json'} does not exist; nothing was run")
    if not (args.specforge_src / "specforge" / "algorithms" / "eagle3" / "model.py").is_file():
        print(
            f"peer_specforge_train: {args.specforge_src} holds no SpecForge v0.3.0 tree (specforge/algorithms/eagle3/model.py is missing); "
            f"export one with: git -C <SpecForge git dir> archive {V03_COMMIT} specforge configs | tar x -C {args.specforge_src}; nothing was run",
            file=sys.stderr,
        )
        return 2
    if args.device is None:
        import torch

        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.probe_steps is None:
        args.probe_steps = 12 if args.device.startswith("cuda") else 0
    if not _has_triton():
        if not args.device.startswith("cpu"):
            print("peer_specforge_train: SpecForge's loss kernel needs triton, which this Python lacks; nothing was run", file=sys.stderr)
            return 2
        return rerun_in_side_venv(argv, args.specforge_src)
    try:
        run(args)
    except BenchError as exc:
        print(f"peer_specforge_train: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
