#!/usr/bin/env python3
"""Checkpoint format of a multi-GPU (torchrun) training run against a single-process run of the same profile.

Trains the profile twice for a few steps: once as one process and once under torchrun with N processes
(GPUs when present, gloo on CPU otherwise); preflights both latest checkpoints against the target's config;
compares key sets, shapes, dtypes and the SGLang-facing config fields. Prints one verdict line per check.

  python benchmarks/multi_gpu_checkpoint.py --profile tiny --nproc 2 --steps 40 [--device cpu] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
for _key, _value in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"), ("NVSHMEM_DISABLE_NVLS", "1")):
    os.environ.setdefault(_key, _value)

SGLANG_CONFIG_FIELDS = (
    "architectures",
    "model_type",
    "hidden_size",
    "num_attention_heads",
    "num_key_value_heads",
    "intermediate_size",
    "num_hidden_layers",
    "vocab_size",
    "draft_vocab_size",
    "target_hidden_size",
    "eagle_config",
    "torch_dtype",
    "tie_word_embeddings",
)


def train(profile: str, out: Path, steps: int, nproc: int, device: str | None) -> float:
    import time

    args = [
        "-m",
        "backend",
        "train",
        "--profile",
        profile,
        "--out",
        str(out),
        "--max-steps",
        str(steps),
        "--save-interval",
        str(steps),
        "--eval-interval",
        str(steps),
    ] + (["--device", device] if device else [])
    if nproc > 1:
        argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", *args]
    else:
        argv = [sys.executable, *args]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    started = time.perf_counter()
    done = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"training with {nproc} process(es) failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    return time.perf_counter() - started


def header(checkpoint: Path) -> dict:
    raw = (checkpoint / "model.safetensors").read_bytes()
    length = int.from_bytes(raw[:8], "little")
    return {k: (v["dtype"], tuple(v["shape"])) for k, v in json.loads(raw[8 : 8 + length]).items() if k != "__metadata__"}


def latest(run: Path) -> Path:
    checkpoints = run / "checkpoints"
    return checkpoints / (checkpoints / "latest").read_text().strip()


def preflight(checkpoint: Path, profile: str) -> dict:
    from backend.profiles import load_profile
    from backend.serve.launch import target_config_for
    from backend.serve.preflight import run_preflight

    return run_preflight(checkpoint, target_config_for(load_profile(profile)), check_sglang=False).to_dict()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", default="tiny")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--device", help="cpu to force gloo on CPU (default: cuda when present)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as scratch:
        single, multi = Path(scratch) / "single", Path(scratch) / "multi"
        seconds = {
            "single": train(args.profile, single, args.steps, 1, args.device),
            f"torchrun_{args.nproc}": train(args.profile, multi, args.steps, args.nproc, args.device),
        }
        one, many = latest(single), latest(multi)
        one_cfg, many_cfg = (json.loads((c / "config.json").read_text()) for c in (one, many))
        checks = {
            "multi_preflight_ok": preflight(many, args.profile)["ok"],
            "single_preflight_ok": preflight(one, args.profile)["ok"],
            "same_keys_shapes_dtypes": header(one) == header(many),
            "same_sglang_config": all(one_cfg.get(k) == many_cfg.get(k) for k in SGLANG_CONFIG_FIELDS),
            "same_files": sorted(p.name for p in one.iterdir()) == sorted(p.name for p in many.iterdir()),
            "one_checkpoint_dir_per_save": len([p for p in (multi / "checkpoints").iterdir() if p.is_dir()]) == 1,
        }
        report = {
            "profile": args.profile,
            "nproc": args.nproc,
            "steps": args.steps,
            "seconds": seconds,
            "checks": checks,
            "single": one.name,
            "multi": many.name,
            "multi_preflight": preflight(many, args.profile),
        }
    for name, ok in checks.items():
        print(f"{'PASS' if ok else 'FAIL'}  {name}")
    print(f"wall seconds: {seconds}")
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
