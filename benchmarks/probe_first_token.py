"""Where a speculative request's first-token time goes at a prompt width the server has not served yet (CUDA).

The H200 round of 2026-12-02 (evening) logged 50-75 ms to the first token for the first speculative request of each
padded prompt width and 13-20 ms for later ones, although the server had run every width at load
(StaticDecoder.warm_prefill). This probe rebuilds that decoder on a random target of the profile's shape (weights do
not matter for timing) and times, per prompt length, the first emission of speculative and plain requests, each in
a new thread (as the server's request threads are) and in the loading thread, after the engine's own warm-up.

    python benchmarks/probe_first_token.py --first speculative --out spec_first.json   # on a GPU host; ~1 minute
    python benchmarks/probe_first_token.py --first plain --out plain_first.json        # a second process
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

LENGTHS = [13, 19, 49, 82, 235, 375, 1500, 3397]  # ShareGPT and HumanEval prompt lengths of the round, and two long ones


def build(profile_name: str, dtype: str, device):
    """A random target of the profile's shape (bench_regenerate's) and a random draft of the profile's."""
    import torch

    from benchmarks.bench_regenerate import random_target
    from backend.profiles import load_profile
    from backend.train.draft import DraftModelConfig, Eagle3Draft
    from backend.train.vocab import build_vocab_mapping

    profile = load_profile(profile_name)
    model = random_target(profile, str(device), dtype, None).model
    draft = Eagle3Draft(DraftModelConfig.from_profile(profile))
    draft.load_target_embedding(model.get_input_embeddings().weight.float().cpu())
    counts = torch.randint(0, 1000, (profile.target.vocab_size,), generator=torch.Generator().manual_seed(0))
    draft.set_vocab_mapping(*build_vocab_mapping(counts, profile.draft.draft_vocab_size))
    draft = draft.to(device=device, dtype=getattr(torch, dtype)).eval()
    return model, draft, list(profile.target.aux_layer_ids), profile.draft.max_position_embeddings


def first_emission(decoder, prompt, speculative: bool, new_thread: bool) -> float:
    """Seconds from the call to the first emitted token (the engine's Generation.first_emission)."""
    seen: dict[str, float] = {}

    def call() -> None:
        started = time.perf_counter()
        decoder.on_emit = lambda result: seen.setdefault("first", time.perf_counter() - started)
        (decoder.generate if speculative else decoder.plain)(prompt, 8)

    if new_thread:
        thread = threading.Thread(target=call)
        thread.start()
        thread.join()
    else:
        call()
    return seen["first"]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--profile", default="smollm2-135m")
    parser.add_argument("--first", choices=["speculative", "plain"], default="speculative", help="which kind meets each width first")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    import torch

    from backend.serve.reference.engine import streaming_decoder_class
    from backend.serve.reference.static_decode import StaticDecoder

    device = torch.device(args.device)
    model, draft, aux, context = build(args.profile, "bfloat16" if device.type == "cuda" else "float32", device)
    rows = []
    for order in (f"{args.first} first",):  # one order a process: a kernel loaded once stays loaded
        began = time.perf_counter()
        decoder = streaming_decoder_class(StaticDecoder)(model, draft, aux_layer_ids=aux, num_steps=3, max_len=context + 4)
        built = time.perf_counter() - began
        decoder.warm_prefill()  # the engine's _warm: every width, then a short plain and speculative decode
        decoder.plain([0, 1, 2, 3], 3)
        decoder.generate([0, 1, 2, 3], 8)
        warmed = time.perf_counter() - began - built
        kinds = [True, False] if args.first == "speculative" else [False, True]
        for length in LENGTHS:
            prompt = torch.randint(0, 1000, (length,)).tolist()
            for new_thread in (True, False):
                for speculative in kinds:
                    for attempt in (1, 2):
                        seconds = first_emission(decoder, prompt, speculative, new_thread)
                        rows.append(
                            {
                                "order": order,
                                "length": length,
                                "width": decoder._width(length),
                                "thread": "new" if new_thread else "loader",
                                "kind": "speculative" if speculative else "plain",
                                "attempt": attempt,
                                "ms": round(1000 * seconds, 2),
                            }
                        )
                        print(json.dumps(rows[-1]), flush=True)
        print(f"{order}: decoder built in {built:.1f} s, warmed in {warmed:.1f} s", flush=True)
    if args.out:
        name = torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu"
        args.out.write_text(json.dumps({"device": name, "first": args.first, "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
