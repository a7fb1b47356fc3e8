"""`eagle3-host data`: the prepare and regenerate commands over backend/train/conversations.py and regenerate.py (torch imported inside the handlers)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from backend.train.conversations import SPLIT_FILES, DataError, prepare, prepare_report
from backend.train.chat_templates import resolve_chat_template, template_text
from backend.train.target import load_tokenizer, TargetMismatchError, load_target
from backend.train.tiny import is_tiny_target_dir


def register(subparsers, parent) -> None:
    data = subparsers.add_parser("data", help="chat data: normalize, split and check conversations for training and bench")
    commands = data.add_subparsers(dest="data_command", metavar="SUBCOMMAND", required=True)
    command = commands.add_parser(
        "prepare",
        parents=[parent],
        help="normalize ShareGPT / OpenAI messages / role-content files into train, val and eval JSONL",
        description="Read ShareGPT, OpenAI/UltraChat 'messages' or role/content conversations (JSONL, JSON arrays, cut-off arrays), "
        "repair or drop what cannot train, and write DIR/train.jsonl, val.jsonl, eval.jsonl and prepare.json (each atomically).",
    )
    command.add_argument("--input", type=Path, action="append", required=True, metavar="FILE", help="a chat file (repeat for several)")
    command.add_argument("--out", type=Path, required=True, metavar="DIR", help="new, empty, or a previous prepare output")
    command.add_argument("--val-fraction", type=float, default=0.02, help="share held out for validation, by content hash (default 0.02)")
    command.add_argument("--eval-count", type=int, default=200, help="held-out prompts written to eval.jsonl for bench (default 200)")
    command.add_argument("--seed", type=int, default=0, help="split seed (default 0)")
    command.add_argument("--limit", type=int, metavar="N", help="keep at most N conversations (the first N read)")
    command.add_argument("--tokenizer", metavar="PATH", help="also check that the chat template renders with this tokenizer (a model dir)")
    command.add_argument("--chat-template", metavar="NAME|FILE", help="chatml, llama3, qwen or a Jinja file (default: the tokenizer's own)")
    command.set_defaults(handler=_prepare_command)
    _register_regenerate(commands, parent)


def _prepare_command(args) -> int:

    try:
        template = resolve_chat_template(args.chat_template)
        tokenizer = None
        if args.tokenizer:
            tokenizer = load_tokenizer(os.path.expanduser(args.tokenizer))
            template_text(tokenizer, template)
        elif template is not None:
            raise DataError("--chat-template needs --tokenizer here (prepare writes text; the template is applied when training). Nothing was written.")
        meta = prepare(args.input, args.out, args.val_fraction, args.eval_count, args.seed, args.limit)
    except DataError as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return 2
    for line in prepare_report(meta, args.out):
        print(f"data prepare: {line}" if not line.startswith("  ") else line, flush=True)
    if tokenizer is not None:
        first = json.loads((Path(args.out).expanduser() / SPLIT_FILES["train"]).open(encoding="utf-8").readline() or "null")
        if first:
            ids = tokenizer.apply_chat_template(first["conversations"], tokenize=True, chat_template=template.text if template else None)
            ids = ids["input_ids"] if hasattr(ids, "keys") else ids
            print(f"data prepare: chat template {template.name if template else 'of the tokenizer'} renders the first train conversation as {len(ids)} tokens")
    return 0


def _register_regenerate(commands, parent) -> None:
    command = commands.add_parser(
        "regenerate",
        parents=[parent],
        help="replace each assistant turn of a `data prepare` dir with the target's own answer (batched, resumable)",
        description="Re-generate every assistant turn with the profile's target: the conversation up to that turn goes through "
        "the chat template and the target's answer replaces the dataset's. Finished conversations are appended (fsync'd) "
        "to DIR/train.jsonl and val.jsonl; run the same command again after a kill to resume. DIR/regenerate.json records "
        "the target, template and settings; `train --conversations DIR` and `extract --conversations DIR` read it.",
    )
    command.add_argument("--profile", required=True, help="profile whose target answers (name or TOML path)")
    command.add_argument("--input", type=Path, required=True, metavar="DIR", help="a `data prepare` output dir")
    command.add_argument("--out", type=Path, required=True, metavar="DIR", help="new or empty dir, or an unfinished regeneration to resume")
    command.add_argument("--max-new-tokens", type=int, default=256, help="longest answer in tokens (default 256)")
    command.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default); > 0 samples")
    command.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default 1.0)")
    command.add_argument("--seed", type=int, default=0, help="sampling seed; each conversation's draws are fixed by it and its content")
    command.add_argument("--batch-size", type=int, default=16, help="conversations generated together (default 16)")
    command.add_argument("--max-prompt-tokens", type=int, help="a conversation ends before an answer whose prompt is longer (default: the profile's seq_len)")
    command.add_argument(
        "--cache",
        choices=("dynamic", "static"),
        default="dynamic",
        help="static: batches (greedy or sampled) share one preallocated KV cache, --batch-size rows by --max-prompt-tokens + --max-new-tokens, "
        "so on CUDA transformers compiles the decode step once and replays it (keep --max-prompt-tokens near the prompts you have: "
        "every step attends over the whole width); dynamic (default): the cache grows with each batch",
    )
    command.add_argument("--limit", type=int, metavar="N", help="regenerate the first N train conversations only")
    command.add_argument("--val-limit", type=int, metavar="N", help="regenerate the first N val conversations only")
    command.add_argument(
        "--max-answers",
        type=int,
        metavar="N",
        help="answer at most the first N assistant turns of each conversation, leaving its later turns out: more conversations "
        "in the same time (default: every turn)",
    )
    command.add_argument("--chat-template", metavar="NAME|FILE", help="chatml, llama3, qwen or a Jinja file (default: the tokenizer's own)")
    command.add_argument(
        "--max-seconds",
        type=float,
        metavar="S",
        help="start no answer after S seconds; what is done is written as usable data (the val split comes first) and the same command resumes the rest",
    )
    command.add_argument(
        "--reuse",
        type=Path,
        metavar="DIR",
        help="an earlier regeneration (same target, dtype, template and answer settings): a conversation whose source content it "
        "answered is taken from it, not generated again (a grown or re-split prepare dir)",
    )
    command.add_argument("--reuse-source", type=Path, metavar="DIR", help="the prepare dir --reuse regenerated, when it has moved (checked by sha256)")
    command.add_argument("--device", help="cpu, cuda, cuda:1 (default: cuda when present)")
    command.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], help="target dtype (default: the profile's)")
    command.add_argument("--threads", type=int, metavar="N", help="torch CPU threads (see `train --help`)")
    command.set_defaults(handler=_regenerate_command)


def _regenerate_command(args) -> int:
    from backend.profiles import ProfileError, load_profile
    from backend.train.cli import apply_threads, chat_preflight
    from backend.train.regenerate import RegenerateSettings, Sampling, fit_prompts_to_positions, regenerate, source_identity

    try:
        profile = load_profile(args.profile)
        if args.limit is not None and args.limit <= 0 or args.val_limit is not None and args.val_limit < 0:
            raise DataError("--limit must be > 0 and --val-limit >= 0. Nothing was written.")
        if args.max_answers is not None and args.max_answers <= 0:
            raise DataError(f"--max-answers {args.max_answers}: expected at least 1 answer per conversation. Nothing was written.")
        if args.max_seconds is not None and args.max_seconds <= 0:
            raise DataError(f"--max-seconds {args.max_seconds:g}: expected a positive number of seconds. Nothing was written.")
        source_identity(args.input.expanduser())  # refuse a wrong --input before the target loads
        if args.reuse_source is not None and args.reuse is None:
            raise DataError("--reuse-source names the prepare dir of a --reuse regeneration; give --reuse too. Nothing was written.")
        settings = RegenerateSettings(
            source=args.input,
            out=args.out,
            sampling=Sampling(args.max_new_tokens, args.temperature, args.top_p, args.seed),
            batch_size=args.batch_size,
            max_prompt_tokens=args.max_prompt_tokens or profile.train.seq_len,
            limit=args.limit,
            val_limit=args.val_limit,
            max_seconds=args.max_seconds,
            max_answers=args.max_answers,
            reuse=args.reuse,
            reuse_source=args.reuse_source,
            cache=args.cache,
        )
        settings.sampling.check()  # wrong answer settings and a wrong --cache are refused before the target loads
        settings.static_batches()
        chosen = chat_preflight(profile, args.chat_template, trust_remote_code=profile.serve.trust_remote_code)
        apply_threads(args.threads)
        import torch

        device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
        dtype = args.dtype or profile.target.dtype
        target = load_target(profile, device=device, dtype=dtype)
        if is_tiny_target_dir(target.path):
            raise DataError(
                "the built-in tiny target trains on its own generated continuations and has no chat template; regenerate with a Hugging Face target"
            )
        settings = fit_prompts_to_positions(settings, target, explicit=args.max_prompt_tokens is not None)
        template = template_text(target.tokenizer, chosen)
        regenerate(target, settings, chosen.name if chosen else "tokenizer", template, dtype, device)
    except (DataError, ProfileError, TargetMismatchError) as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return 2
    print(args.out)
    return 0
