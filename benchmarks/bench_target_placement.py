#!/usr/bin/env python3
"""What a target placed across devices costs: one capture (aux states + teacher logits) of a random Llama with every layer
on the GPU, then with its last K layers in CPU memory (streamed to the GPU each forward) and on disk, through
load_target(placement=...), with the outputs compared against the all-GPU load.

python benchmarks/bench_target_placement.py --out benchmarks/results/h200_target_placement.json   (on one GPU)
python benchmarks/bench_target_placement.py --device cpu --hidden 256 --intermediate 512 --heads 4 --kv-heads 2   (a smoke run)

On the CPU nothing is streamed (CPU-placed layers run where they are): only the disk row differs from the first there.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from backend.profiles import parse_profile
from backend.train.target import TargetPlacement, load_target
from backend.train.tiny import TINY_VOCAB_SIZE, ByteTokenizer


def build_target(directory: Path, args: argparse.Namespace) -> int:
    """A random Llama of the asked shape in bf16 safetensors (byte vocabulary: the layers are what is measured); its bytes per layer."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        vocab_size=TINY_VOCAB_SIZE,
        max_position_embeddings=args.seq,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    with torch.device(args.device):
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(directory)
    ByteTokenizer().save(directory)
    layer = model.model.layers[0]
    return sum(p.numel() * p.element_size() for p in layer.parameters())


def profile_for(directory: Path, args: argparse.Namespace):
    last = args.layers - 2
    raw = {
        "name": "placement-bench",
        "target": {
            "path": str(directory),
            "architecture": "LlamaForCausalLM",
            "hidden_size": args.hidden,
            "num_layers": args.layers,
            "vocab_size": TINY_VOCAB_SIZE,
            "aux_layer_ids": [1, last // 2, last],
            "dtype": "bfloat16",
        },
        "draft": {
            "hidden_size": args.hidden,
            "num_attention_heads": args.heads,
            "num_key_value_heads": args.kv_heads,
            "intermediate_size": 1024,
            "draft_vocab_size": 64,
        },
    }
    return parse_profile(raw, "benchmarks/bench_target_placement.py")


def layer_map(args: argparse.Namespace, where: str) -> dict[str, int | str]:
    home: int | str = 0 if args.device == "cuda" else "cpu"
    device_map: dict[str, int | str] = {"model.embed_tokens": home, "model.rotary_emb": home, "model.norm": home, "lm_head": home}
    first_moved = args.layers - args.moved
    device_map.update({f"model.layers.{i}": where if i >= first_moved else home for i in range(args.layers)})
    return device_map


def synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def time_captures(target, ids: torch.Tensor, repeats: int, device: str) -> tuple[float, object]:
    result = target.capture(ids, with_logits=True)  # warm-up (and the result compared below)
    synchronize(device)
    started = time.perf_counter()
    for _ in range(repeats):
        target.capture(ids, with_logits=True)
    synchronize(device)
    return (time.perf_counter() - started) / repeats, result


def copy_rate(pinned: bool, size: int = 1 << 30) -> float:
    """GB/s of one host-to-GPU copy of `size` bytes (the best of three)."""
    host = torch.empty(size, dtype=torch.uint8, pin_memory=pinned)
    best = float("inf")
    for _ in range(3):
        torch.cuda.synchronize()
        started = time.perf_counter()
        host.to("cuda", non_blocking=pinned)
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - started)
    return size / best / 1e9


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--intermediate", type=int, default=14336)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--moved", type=int, default=4, help="layers placed off the GPU (the last ones)")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="placement-bench-"))
    layer_bytes = build_target(work / "target", args)
    on_gpu = args.device == "cuda"
    profile = profile_for(work / "target", args)
    ids = torch.randint(0, 256, (args.batch, args.seq), generator=torch.Generator().manual_seed(0))
    rows = {}
    reference = None
    for name, placement in (
        (f"all on {args.device}", None),
        (f"last {args.moved} layers in CPU memory", TargetPlacement(layer_map(args, "cpu"))),
        (f"last {args.moved} layers on disk", TargetPlacement(layer_map(args, "disk"), None, str(work / "offload"))),
    ):
        if on_gpu:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        target = load_target(profile, device=args.device, placement=placement)
        seconds, result = time_captures(target, ids, args.repeats, args.device)
        row = {"seconds_per_capture": round(seconds, 4), "placement": target.placement()}
        if on_gpu:
            row["peak_gpu_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
        if reference is None:
            reference = result
        else:
            row["max_abs_diff_aux"] = float((result.aux_hidden.float() - reference.aux_hidden.float()).abs().max())
            row["max_abs_diff_logits"] = float((result.logits.float() - reference.logits.float()).abs().max())
            extra = seconds - rows[f"all on {args.device}"]["seconds_per_capture"]
            row["moved_gb_per_capture"] = round(args.moved * layer_bytes / 1e9, 3)
            row["effective_gb_per_s"] = round(args.moved * layer_bytes / 1e9 / extra, 2) if extra > 0 else None
        rows[name] = row
        print(name, json.dumps(row), flush=True)
        del target, result
    report = {
        "device": torch.cuda.get_device_name(0) if on_gpu else "cpu",
        "torch": torch.__version__,
        "shape": {k: getattr(args, k) for k in ("hidden", "intermediate", "layers", "heads", "kv_heads", "moved", "batch", "seq")},
        "bf16_gb_per_layer": round(layer_bytes / 1e9, 3),
        "host_to_gpu_gb_per_s": {"pinned": round(copy_rate(True), 1), "pageable": round(copy_rate(False), 1)} if on_gpu else None,
        "captures": rows,
    }
    print(json.dumps(report, indent=1))
    if args.out:
        args.out.write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
