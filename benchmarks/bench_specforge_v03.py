#!/usr/bin/env python3
"""SpecForge v0.3.0's own EAGLE-3 training step (its algorithms/eagle3 model, strategy, FSDP backend, trainer core) at our bench shapes.

This file holds no SpecForge code. It imports an export of SpecForge at the v0.3.0 release (commit 2768619e, the
"update news about specforge v0.3.0" commit; the repository has no tag, and version.txt still says 0.2.0), and puts
the offline EAGLE-3 step together from SpecForge's own parts, the way specforge/training (assembly.py,
trainer.py) and specforge/algorithms (model_providers.py, eagle3/providers.py) do it for an offline run:

  * settings:      specforge.config.schema.TrainingConfig() defaults (lr 1e-4 cosine, warmup 0.015, clip 0.5,
                   TTT 7, flex_attention, FSDP SHARD_GRAD_OP, no LK loss, no compact teacher) and a ModelConfig
                   (bf16, vocab mapping file, no warm start);
  * draft:         specforge.algorithms.model_providers.build_eagle3_draft(cfg, AutoDraftModelConfig.from_file(...))
                   (AutoDraftModel.from_config, vocab mapping, frozen embedding, bf16 on the local device);
  * train module:  specforge.algorithms.eagle3.model.OnlineEagle3Model(draft, length, attention_backend, lk_loss_type,
                   kl_scale, kl_decay), as build_eagle3_model builds it;
  * teacher head:  specforge.modeling.target.target_head.TargetHead, frozen bf16 (build_eagle3_model loads it with
                   from_pretrained; here its random weights are made in memory, the rest is the same);
  * backend:       specforge.training.backend.FSDPTrainingBackend(ParallelConfig.from_distributed(...),
                   optimizer_factory=specforge.training.assembly._ConfiguredOptimizerFactory(cfg)), i.e. FSDP1 with
                   bf16 MixedPrecision around the module and BF16Optimizer (fp32 master AdamW) over the draft;
  * step:          specforge.algorithms.eagle3.providers.build_step (Eagle3TrainStrategy: TargetHead.preprocess +
                   lm_head, OnlineEagle3Model, sum 0.8^i ploss_i) driven by specforge.training.controller.TrainerCore,
                   whose train_step does forward, backward, optimizer step and its per-step metric reduction.

The draft config is written from this repository's profile (profiles/<shape>.toml), so SpecForge trains exactly
the shape that benchmarks/bench_trainer.py trains. The synthetic offline sample is built as
shared/tools/specforge_bench.py builds it for SpecForge 20e2e3f0 (batch 1, 95 % of teacher argmax tokens in the
draft vocab). Timing, matmul ceiling and the analytic FLOP count are bench_trainer.py's, so the JSON compares
directly with it (pass it to bench_trainer.py with --specforge-json).

Nothing SpecForge imports on this path is stubbed: v0.3.0 imports yunchang, sglang and liger lazily, off the
offline flex/sdpa path. What it needs at import time beyond torch/transformers is triton (its LogSoftmaxLoss
kernel; on the GPU image) and, for the settings objects, pydantic (carried as wheels in .device/whl).

  GPU:  python3 benchmarks/bench_specforge_v03.py --shape llama --json $OUT/sf03_llama.json
        python3 benchmarks/bench_specforge_v03.py --shape kimi --json $OUT/sf03_kimi.json
  CPU:  TRITON_INTERPRET=1 python benchmarks/bench_specforge_v03.py --small --device cpu --json /tmp/sf03_small.json
        (needs triton importable; TRITON_INTERPRET runs SpecForge's triton loss kernel on the CPU)
"""

from __future__ import annotations

import argparse
import json
import math
import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_SRC = ROOT / ".device" / "specforge-v0.3.0"
V03_COMMIT = "2768619ee19c8265d161e1f8c1aa4fb09ef238c7"
# What this bench imports from SpecForge; each must exist in the tree given with --specforge-src.
SPECFORGE_MODULES = (
    "specforge.config.schema",
    "specforge.algorithms.model_providers",
    "specforge.algorithms.eagle3.model",
    "specforge.algorithms.eagle3.providers",
    "specforge.modeling.auto",
    "specforge.modeling.target.target_head",
    "specforge.training.backend",
    "specforge.training.assembly",
    "specforge.training.controller",
    "specforge.runtime.contracts",
)


class BenchError(RuntimeError):
    """The SpecForge tree or this machine cannot run the bench; the message says what is missing."""


def log(*parts) -> None:
    print(*parts, flush=True)


def import_specforge(src: Path, names: tuple[str, ...] = SPECFORGE_MODULES) -> dict:
    """Import SpecForge modules (this bench's by default) from `src`; a missing tree or package is a BenchError naming
    it, and so is a module that came from anywhere else."""
    import importlib

    if not (src / "specforge" / "algorithms" / "eagle3" / "model.py").is_file():
        raise BenchError(
            f"{src} holds no SpecForge v0.3.0 tree (specforge/algorithms/eagle3/model.py is missing); "
            f"export it with: git -C <SpecForge git dir> archive {V03_COMMIT} specforge configs | tar x -C {src}; nothing was run"
        )
    sys.path.insert(0, str(src.resolve()))
    modules = {}
    for name in names:
        try:
            modules[name] = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            raise BenchError(
                f"importing {name} from {src} needs the package {exc.name!r}, which this Python lacks "
                f"(carry it as a wheel, or run where it is installed); nothing was run"
            ) from exc
    loaded = {m.__file__ for m in modules.values()}
    outside = sorted(f for f in loaded if f and not Path(f).resolve().is_relative_to(src.resolve()))
    if outside:
        raise BenchError(f"specforge was imported from outside {src}: {outside}")
    return modules


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def init_process_group(device) -> bool:
    """A one-process group (FSDP and BF16Optimizer's grad-norm reduction use it), unless torchrun made one."""
    import torch.distributed as dist

    if dist.is_initialized():
        return False
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    dist.init_process_group(
        backend="nccl" if device.type == "cuda" else "gloo", rank=int(os.environ.get("RANK", "0")), world_size=int(os.environ.get("WORLD_SIZE", "1"))
    )
    return True


def draft_config_dict(profile) -> dict:
    """A LlamaForCausalLMEagle3 config.json for SpecForge with the draft and target shape of our profile."""
    target, draft = profile.target, profile.draft
    return {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_act": "silu",
        "hidden_size": draft.hidden_size,
        "intermediate_size": draft.intermediate_size,
        "num_attention_heads": draft.num_attention_heads,
        "num_key_value_heads": draft.num_key_value_heads,
        "head_dim": draft.head_dim or draft.hidden_size // draft.num_attention_heads,
        "num_hidden_layers": 1,
        "vocab_size": target.vocab_size,
        "draft_vocab_size": draft.draft_vocab_size,
        "target_hidden_size": target.hidden_size,
        "rms_norm_eps": draft.rms_norm_eps,
        "rope_theta": draft.rope_theta,
        "max_position_embeddings": max(draft.max_position_embeddings, profile.train.seq_len),
        "pad_token_id": 0,
        "tie_word_embeddings": False,
        "initializer_range": 0.02,
        "use_cache": True,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(target.aux_layer_ids), "use_aux_hidden_state": True},
    }


def synthetic_sample(torch, head_weight, selected, seq: int, aux_width: int, device, dtype):
    """SpecForge's offline batch tensors: ids, masks, 3 aux layers, and a last hidden state whose teacher argmax is known.

    As shared/tools/specforge_bench.py builds it: 95 % of the target tokens lie in the draft vocab, and the last
    hidden state of a position points along its token's lm_head row (plus unit noise).
    """
    vocab, hidden = head_weight.shape
    generator = torch.Generator().manual_seed(1)
    in_draft = torch.rand(seq, generator=generator) < 0.95
    tokens = torch.where(
        in_draft, selected[torch.randint(0, selected.numel(), (seq,), generator=generator)], torch.randint(0, vocab, (seq,), generator=generator)
    )
    rows = head_weight[tokens.to(head_weight.device)].float()
    noise = torch.randn(seq, hidden, generator=generator).to(rows.device)
    last = 15.0 * rows / rows.square().sum(-1, keepdim=True) + noise
    return {
        "input_ids": torch.randint(0, vocab, (1, seq), generator=generator).to(device),
        "attention_mask": torch.ones(1, seq, dtype=torch.long, device=device),
        "loss_mask": torch.ones(1, seq, dtype=torch.long, device=device),
        "hidden_state": torch.randn(1, seq, aux_width, generator=generator).to(device, dtype),
        "target": last.to(device, dtype)[None],
    }


def run(args) -> dict:
    if args.device == "cpu":
        os.environ["SPECFORGE_DEVICE"] = "cpu"  # SpecForge's get_local_device() puts the draft where we run
    sf = import_specforge(args.specforge_src)
    import torch

    sys.path.insert(0, str(ROOT))
    from benchmarks.bench_trainer import SHAPES, analytic_flops, matmul_rate, profile_for

    if args.code_root:  # read profiles/ and backend.profiles from this tree (as bench_trainer.py --code-root)
        sys.path.insert(0, str(args.code_root.resolve()))

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    dtype_name = "bfloat16" if device.type == "cuda" else "float32"
    dtype = getattr(torch, dtype_name)
    made_group = init_process_group(device)
    profile = profile_for(SimpleNamespace(small=args.small, shape=args.shape))
    seq = args.seq or profile.train.seq_len
    rate = matmul_rate(device, args.matmul_size or (8192 if device.type == "cuda" else 1024), dtype)
    log(f"torch {torch.__version__}, {torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}: {dtype_name} matmul {rate / 1e12:.1f} TFLOP/s")

    schema = sf["specforge.config.schema"]
    # flex attention has no backward on CPU: the CPU smoke test uses SpecForge's sdpa backend
    backend_name = args.backend or (schema.TrainingConfig().attention_backend if device.type == "cuda" else "sdpa")
    training = schema.TrainingConfig(max_steps=100_000, attention_backend=backend_name)
    tmp = Path(tempfile.mkdtemp(prefix="sf03_"))
    config_path = tmp / "draft_config.json"
    config_path.write_text(json.dumps(draft_config_dict(profile), indent=1))
    draft_config = sf["specforge.modeling.auto"].AutoDraftModelConfig.from_file(str(config_path))
    hidden, vocab, draft_vocab = draft_config.hidden_size, draft_config.vocab_size, draft_config.draft_vocab_size

    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(1)
    selected = torch.sort(torch.randperm(vocab, generator=generator)[:draft_vocab]).values  # a random draft vocab
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[selected] = True
    torch.save({"t2d": t2d, "d2t": selected - torch.arange(draft_vocab)}, tmp / "vocab_mapping.pt")
    # TargetHead reads hidden_size and vocab_size from the target's config.json.
    (tmp / "config.json").write_text(
        json.dumps(
            {
                "model_type": "llama",
                "architectures": ["LlamaForCausalLM"],
                "hidden_size": hidden,
                "vocab_size": vocab,
                "intermediate_size": draft_config.intermediate_size,
                "num_attention_heads": draft_config.num_attention_heads,
                "num_key_value_heads": draft_config.num_key_value_heads,
                "num_hidden_layers": 2,
            }
        )
    )
    cfg = SimpleNamespace(
        training=training,
        model=schema.ModelConfig(
            target_model_path=str(tmp), vocab_mapping_path=str(tmp / "vocab_mapping.pt"), load_target_embedding=False, torch_dtype=dtype_name
        ),
    )

    providers = sf["specforge.algorithms.model_providers"]
    draft = providers.build_eagle3_draft(cfg, draft_config)
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
        .to(device=device, dtype=dtype)
    )
    target_head = sf["specforge.modeling.target.target_head"].TargetHead(str(tmp))
    target_head.freeze_weights()
    target_head = target_head.eval().to(device=device, dtype=dtype)

    backend_mod = sf["specforge.training.backend"]
    parallel = backend_mod.ParallelConfig.from_distributed(tp_size=1, sp_ulysses_size=1, sp_ring_size=1)
    optimizer_factory = sf["specforge.training.assembly"]._ConfiguredOptimizerFactory(cfg)
    backend = backend_mod.FSDPTrainingBackend(parallel, optimizer_factory=optimizer_factory)
    wrap = device.type == "cuda" if args.wrap is None else bool(args.wrap)
    wrapped = backend.prepare_model(model, wrap=wrap, optimizer_target=model.draft_model)
    eagle3 = sf["specforge.algorithms.eagle3.providers"]
    strategy = eagle3.build_step(wrapped, target_head=target_head, **eagle3.step_options(cfg))
    core = sf["specforge.training.controller"].TrainerCore(strategy, backend, accumulation_steps=training.accumulation_steps)
    model.train()

    aux_width = len(profile.target.aux_layer_ids) * profile.target.hidden_size
    tensors = synthetic_sample(torch, target_head.fc.weight, selected, seq, aux_width, device, dtype)
    batch = sf["specforge.runtime.contracts"].TrainBatch(
        sample_ids=["synthetic-0"], strategy="eagle3", tensors=tensors, metadata={"target_repr": "hidden_state"}
    )

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    losses, times, warm = [], [], []
    result = None
    for step in range(args.warmup + args.steps):
        sync()
        start = time.perf_counter()
        result = core.train_step(batch)
        sync()
        elapsed = time.perf_counter() - start
        (warm if step < args.warmup else times).append(elapsed)
        losses.append(float(result.loss))
        if step < args.warmup:
            log(f"warm-up step {step}: {elapsed * 1e3:.1f} ms, loss {losses[-1]:.4f}, grad norm {result.grad_norm:.4f}")
    step_s = statistics.median(times)
    flops = analytic_flops(
        hidden,
        draft_config.intermediate_size,
        draft_config.num_attention_heads,
        draft_config.num_key_value_heads,
        draft_config.head_dim,
        vocab,
        draft_vocab,
        seq,
        training.ttt_length,
    )
    commit_file = args.specforge_src / "SPECFORGE_COMMIT"
    out = {
        "bench": "benchmarks/bench_specforge_v03.py",
        "specforge_version": "v0.3.0",
        "specforge_commit": commit_file.read_text().strip() if commit_file.is_file() else None,
        "shape": "small" if args.small else f"{SHAPES[args.shape]} draft",
        "shape_name": "small" if args.small else args.shape,
        "draft_config": draft_config_dict(profile),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "backend": training.attention_backend,
        "fsdp": wrap,
        "fsdp_sharding": parallel.sharding_strategy,
        "wrapper": backend._wrapper_kind,
        "training_config": {
            k: getattr(training, k)
            for k in ("learning_rate", "lr_scheduler", "warmup_ratio", "max_grad_norm", "ttt_length", "lk_loss_type", "compact_teacher", "accumulation_steps")
        },
        "dtype": dtype_name,
        "batch": 1,
        "seq": seq,
        "ttt_length": training.ttt_length,
        "warmup_steps": args.warmup,
        "timed_steps": len(times),
        "warmup_ms": [t * 1e3 for t in warm],
        "step_ms": [t * 1e3 for t in times],
        "median_step_ms": step_s * 1e3,
        "min_step_ms": min(times) * 1e3,
        "max_step_ms": max(times) * 1e3,
        "tokens_per_s": seq / step_s,
        "peak_mem_allocated_gib": torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None,
        "peak_mem_reserved_gib": torch.cuda.max_memory_reserved(device) / 2**30 if device.type == "cuda" else None,
        "matmul_8192_bf16_tflops": rate / 1e12,
        "matmul_tflops": rate / 1e12,
        "flops_analytic": flops,
        "achieved_tflops": flops["train_step_total"] / step_s / 1e12,
        "mfu_vs_measured_matmul": flops["train_step_total"] / step_s / rate,
        "losses": losses,
        "acc_last_step": {k: v for k, v in (result.metrics if result else {}).items() if k.startswith("acc")},
        "finite": all(math.isfinite(v) for v in losses),
        "draft_trainable_params": sum(p.numel() for p in draft.parameters() if p.requires_grad),
    }
    log(
        f"RESULT specforge v0.3.0 {out['backend']} {out['wrapper']}: median step {out['median_step_ms']:.1f} ms, "
        f"{out['tokens_per_s']:.0f} tok/s, peak alloc {out['peak_mem_allocated_gib'] or 0:.2f} GiB, "
        f"FLOPs/step {flops['train_step_total'] / 1e12:.2f} T, MFU {100 * out['mfu_vs_measured_matmul']:.1f}% of measured matmul; "
        f"losses {losses[0]:.4f} -> {losses[-1]:.4f}"
    )
    if made_group:
        import torch.distributed as dist

        dist.destroy_process_group()
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=["llama", "kimi"], default="llama", help="the profile's draft shape (as bench_trainer.py)")
    parser.add_argument("--small", action="store_true", help="bench_trainer.py's small shape (CPU smoke test)")
    parser.add_argument("--specforge-src", type=Path, default=DEFAULT_SRC, help="an export of SpecForge v0.3.0 (specforge/ and configs/)")
    parser.add_argument("--backend", choices=["flex_attention", "sdpa"], help="attention backend (default: SpecForge's, flex_attention; sdpa on CPU)")
    parser.add_argument(
        "--wrap",
        type=int,
        choices=[0, 1],
        help="1: FSDP as SpecForge's backend wraps it (default on CUDA); 0: unwrapped (default on CPU: FSDP needs an accelerator)",
    )
    parser.add_argument("--device", help="cuda (default when present) or cpu")
    parser.add_argument("--seq", type=int, help="sequence length (default: the profile's)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--matmul-size", type=int, help="square matmul for the peak rate (default 8192 on CUDA)")
    parser.add_argument("--json", type=Path, help="write the result here")
    parser.add_argument("--code-root", type=Path, help="import backend.profiles (the shapes) from this tree instead")
    args = parser.parse_args(argv)
    try:
        out = run(args)
    except BenchError as exc:
        print(f"bench_specforge_v03: {exc}", file=sys.stderr)
        return 2
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out, indent=1) + "\n")
        log(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
