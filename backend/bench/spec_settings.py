"""`eagle3-host spec-settings`: a draft's accept length at SGLang's speculative settings over eval sets, with no server.

Greedy verification commits the target's greedy tokens at every setting, so each prompt is decoded once (plain,
ignore-eos) and every setting's rounds are replayed with the draft alone on those tokens
(backend/serve/reference/draft_tree.py: SGLang's tree of top-k beams, the best num_draft_tokens - 1 candidates
verified). What it answers: which `--speculative-num-steps / --speculative-eagle-topk / --speculative-num-draft-tokens`
to launch SGLang with for this draft, as accept length per setting; the speed each costs is the engine's (a wider
verify, more draft rows), which SGLang's own bench_speculative.py measures on the GPU.
"""

from __future__ import annotations

import random
import sys
import time
from pathlib import Path
from typing import Any, Callable

from backend.serve.acceptance import bootstrap_interval, mean_of_request_means, paired_pooled_difference, pooled_accept_length
from backend.serve.reference.draft_tree import greedy_rows, replay
from backend.serve.spec_setting import TreeSetting
from backend.serve.reference.spec_decode import NO_EOS

# The chain the project's profiles serve first (the baseline every other row is compared with), deeper chains, trees
# verifying as many tokens as the chain (3,2,4 and 3,4,4: the same verify width), and SGLang's documented example
# (3,4,16; `docs/advanced_features/speculative_decoding.md`).
DEFAULT_SETTINGS = ("3,1,4", "5,1,6", "7,1,8", "3,2,4", "3,4,4", "3,2,6", "3,4,8", "5,4,8", "3,4,16", "5,4,16")


class SettingsError(ValueError):
    """A --settings value SGLang would not run, or one given twice."""


def parse_settings(values: list[str]) -> list[TreeSetting]:
    settings = []
    for text in (text for value in values for text in value.split()):
        try:
            settings.append(TreeSetting.parse(text))
        except ValueError as error:
            raise SettingsError(str(error)) from None
    labels = [s.label for s in settings]
    repeated = sorted({label for label in labels if labels.count(label) > 1})
    if repeated:
        raise SettingsError(f"--settings repeats {', '.join(repeated)}")
    if not settings:
        raise SettingsError("--settings names no setting")
    return settings


def measure_set(decoder, draft, prompts: list[list[int]], max_new_tokens: int, settings: list[TreeSetting], log: Callable[[str], None]) -> dict[str, Any]:
    """Every setting's rounds on each prompt's greedy answer; per setting the pooled accept length with its bootstrap
    95 % interval over prompts, the mean of request means, and the difference from the first setting with a paired
    interval (the same prompts: their spread cancels)."""
    deepest = max(s.num_steps for s in settings)
    started = time.perf_counter()
    runs: dict[str, list[tuple[int, int]]] = {s.label: [] for s in settings}
    for index, ids in enumerate(prompts, 1):
        sequence, features = greedy_rows(decoder, ids, max_new_tokens + deepest - 1)
        for setting in settings:
            result = replay(draft, features, sequence, len(ids), max_new_tokens, setting)
            runs[setting.label].append((result.completion_tokens, result.verify_ct))
        if index % 10 == 0 or index == len(prompts):
            elapsed = time.perf_counter() - started
            left = elapsed / index * (len(prompts) - index)
            log(
                f"{index}/{len(prompts)} prompts, {elapsed:.0f} s (~{left:.0f} s left): "
                + ", ".join(f"{k} {pooled_accept_length(v):.2f}" for k, v in runs.items())
            )
    rng = random.Random(0)
    base_label = settings[0].label
    base = runs[base_label]
    rows = {}
    for setting in settings:
        pairs = runs[setting.label]
        rows[setting.label] = {
            "num_steps": setting.num_steps,
            "topk": setting.topk,
            "num_draft_tokens": setting.num_draft_tokens,
            "pooled": pooled_accept_length(pairs),
            "pooled_95": bootstrap_interval(pairs, pooled_accept_length, rng),
            "mean_of_request_means": mean_of_request_means(pairs),
            "minus_baseline": pooled_accept_length(pairs) - pooled_accept_length(base),
            "minus_baseline_95": bootstrap_interval(list(zip(base, pairs)), paired_pooled_difference, rng),
            "per_request": [round(t / v, 4) for t, v in pairs if v],
        }
    return {"prompts": len(prompts), "baseline": base_label, "seconds": round(time.perf_counter() - started, 1), "settings": rows}


def table(document: dict[str, Any]) -> str:
    lines = []
    for name, row in document["sets"].items():
        lines.append(f"{name}: {row['prompts']} prompts x {document['max_new_tokens']} tokens, greedy; accept length at each setting (steps,topk,tokens)")
        lines.append(f"  {'setting':>9}  {'pooled (95 %)':<21}  {'mean of means':>13}  {'vs ' + row['baseline'] + ' (95 %)':<26}  verifies")
        for label, entry in row["settings"].items():
            low, high = entry["pooled_95"]
            d_low, d_high = entry["minus_baseline_95"]
            lines.append(
                f"  {label:>9}  {entry['pooled']:.3f} ({low:.3f}-{high:.3f})  {entry['mean_of_request_means']:>13.3f}  "
                f"{entry['minus_baseline']:+.3f} ({d_low:+.3f} to {d_high:+.3f})   {entry['num_draft_tokens']} tokens a round"
            )
    return "\n".join(lines)


def chat_prompt_ids(tokenizer, prompt: str | list[dict[str, str]], max_tokens: int) -> list[int]:
    """A prompt (text: one user turn; or a conversation's messages) in the tokenizer's chat template with the
    assistant's turn opened, as the draft saw chats in training (without a template: the turns' text, one a line);
    its last max_tokens ids."""
    messages = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        ids = list(tokenizer.encode(text, add_special_tokens=False))
    else:
        ids = list(tokenizer.encode("\n".join(m["content"] for m in messages)))
    return ids[-max_tokens:]


def encode_prompts(tokenizer, prompts: list[str], max_tokens: int) -> list[list[int]]:
    return [chat_prompt_ids(tokenizer, prompt, max_tokens) for prompt in prompts]


def run(args, sets) -> dict[str, Any]:
    """Load the profile's target and the draft on args.device, then measure each eval set; without autograd, the
    caller's grad mode left as it was (the command runs in-process under `eagle3-host` and its tests)."""
    import torch

    with torch.no_grad():
        return _run(args, sets)


def _run(args, sets) -> dict[str, Any]:
    import torch

    from backend.profiles import load_profile
    from backend.serve.preflight import resolve_draft_dir
    from backend.serve.reference.spec_decode import SpecDecoder
    from backend.train.checkpoint import load_checkpoint
    from backend.train.target import load_target

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    profile = load_profile(args.profile)
    dtype = args.dtype or (profile.serve.dtype if device.type == "cuda" else "float32")
    target = load_target(profile, device=device, dtype=dtype)
    draft_dir = resolve_draft_dir(Path(args.draft).expanduser())
    draft, config, _meta, _state = load_checkpoint(draft_dir, target_embedding=target.embed_weight())
    draft = draft.to(device=device, dtype=target.dtype).eval()
    decoder = SpecDecoder(target.model, draft, list(config.aux_layer_ids), eos_token_id=NO_EOS)
    settings = parse_settings(args.settings or list(DEFAULT_SETTINGS))
    document: dict[str, Any] = {
        "time": time.time(),
        "profile": profile.name,
        "target": profile.target.path,
        "draft": str(draft_dir),
        "device": str(device),
        "dtype": dtype,
        "max_new_tokens": args.max_new_tokens,
        "ignore_eos": True,
        "how": "each prompt decoded once (greedy), every setting's rounds replayed with the draft (SGLang's tree)",
        "sets": {},
    }
    for eval_set in sets:
        prompts = encode_prompts(target.tokenizer, eval_set.prompts.prompts, args.max_prompt_tokens)
        print(f"spec-settings: set {eval_set.name}: {len(prompts)} prompts ({eval_set.prompts.source})", file=sys.stderr, flush=True)
        row = measure_set(decoder, draft, prompts, args.max_new_tokens, settings, _progress(eval_set.name))
        document["sets"][eval_set.name] = {"source": eval_set.prompts.describe(), **row}
    return document


def _progress(name: str) -> Callable[[str], None]:
    def log(line: str) -> None:
        print(f"  {name}: {line}", file=sys.stderr, flush=True)

    return log
