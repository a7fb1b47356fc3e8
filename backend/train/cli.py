"""`eagle3-host` training commands: train, extract, export, convert, build-tiny (torch imported inside the handlers)."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING
from backend.train.target import (
    TargetPlacementError,
    parse_placement,
    BUILTIN_TINY,
    load_tokenizer,
    resolve_target_path,
    WHEEL_PREFIX,
    TargetMismatchError,
    load_target,
)
from backend.train.chat_templates import resolve_chat_template, template_text
from backend.train.tiny import is_tiny_target_dir, cache_root, ensure_tiny_target
from backend.commands import data_dir_for
from backend.train.conversations import DataError, ensure_sharegpt_sample

if TYPE_CHECKING:
    from backend.train.trainer import TrainOptions


def register(subparsers, parent: argparse.ArgumentParser) -> None:
    _register_train(subparsers, parent)
    _register_extract(subparsers, parent)
    export = subparsers.add_parser(
        "export",
        parents=[parent],
        help="copy a checkpoint's serving files (config.json + model.safetensors), verifying keys",
        description="Copy config.json and model.safetensors of a checkpoint (or a run dir's latest) into DST, after checking every key and shape.",
    )
    export.add_argument("checkpoint", type=Path, help="checkpoint dir, or a run dir (its checkpoints/latest is used)")
    export.add_argument("destination", type=Path, help="new or empty directory for the serving files")
    export.set_defaults(handler=_export)
    from backend.train.convert import register_convert  # standard library only at import time

    register_convert(subparsers, parent)
    build = subparsers.add_parser("build-tiny", parents=[parent], help="build (or find) the cached tiny CPU target and print its path")
    _add_threads(build)
    build.set_defaults(handler=_build_tiny)


THREADS_HELP = (
    "torch CPU threads (default: $EAGLE3_THREADS, else $OMP_NUM_THREADS when set, else min(physical cores, 4) "
    "less the cores other processes keep busy, at least 1)"
)


def _add_threads(parser) -> None:
    parser.add_argument("--threads", type=int, metavar="N", help=THREADS_HELP)


def physical_cores() -> int:
    """Physical cores this process may run on (SMT siblings counted once); the logical count where topology is unknown."""
    try:
        allowed = os.sched_getaffinity(0)
    except (AttributeError, OSError):
        allowed = set(range(os.cpu_count() or 1))
    cores = set()
    for cpu in allowed:
        topology = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology")
        try:
            cores.add((topology.joinpath("physical_package_id").read_text().strip(), topology.joinpath("core_id").read_text().strip()))
        except OSError:
            cores.add(("cpu", str(cpu)))
    return max(1, len(cores))


def choose_threads(explicit: int | None = None, environ=None, load: float | None = None, cores: int | None = None) -> tuple[int | None, str]:
    """(torch threads to set or None to keep torch's choice, why). Several OpenMP threads competing with other
    busy processes for the same cores run several times slower than one, so cores that others keep busy
    (the 1-minute load average) are left to them; torchrun's processes on one host share the cores."""
    environ = os.environ if environ is None else environ
    if explicit:
        return max(1, explicit), "--threads"
    if environ.get("EAGLE3_THREADS", "").strip().isdigit() and int(environ["EAGLE3_THREADS"]) > 0:
        return int(environ["EAGLE3_THREADS"]), "$EAGLE3_THREADS"
    if environ.get("OMP_NUM_THREADS", "").strip():
        return None, f"$OMP_NUM_THREADS={environ['OMP_NUM_THREADS'].strip()}"
    cores = physical_cores() if cores is None else cores
    per_host = max(1, int(environ.get("LOCAL_WORLD_SIZE", "1") or 1))
    share = max(1, cores // per_host)
    if load is None:
        try:
            load = os.getloadavg()[0]
        except OSError:
            load = 0.0
    free = max(1, int(cores - load + 0.5)) if per_host == 1 else share
    threads = max(1, min(4, share, free))
    return threads, f"{cores} physical core(s), load {load:.1f}{f', {per_host} processes on this host' if per_host > 1 else ''}"


def apply_threads(explicit: int | None = None, log=None) -> int:
    """Set torch's intra-op threads for this command (see choose_threads) and say so; returns the count in use."""
    import torch

    threads, why = choose_threads(explicit)
    if threads is not None:
        torch.set_num_threads(threads)
    used = torch.get_num_threads()
    if log is None:
        log = lambda message: print(message, file=sys.stderr, flush=True)  # noqa: E731
    log(f"torch threads: {used} ({why}; set --threads or $EAGLE3_THREADS to change)")
    return used


def _register_train(subparsers, parent) -> None:
    train = subparsers.add_parser(
        "train",
        parents=[parent],
        help="train an EAGLE-3 draft (also under torchrun)",
        description="Train an EAGLE-3 draft for a profile's target. SIGTERM/SIGINT: finish the step, write a checkpoint, exit 0.",
    )
    train.add_argument("--profile", required=True, help="profile name (tiny, llama3.1-8b, kimi-k2.5) or a TOML path")
    train.add_argument("--out", type=Path, help="output dir (default: $EAGLE3_JOB_DIR, else <run-dir>/runs/train-<timestamp>)")
    train.add_argument("--max-steps", type=int, help="total optimizer steps (absolute: a resumed run continues up to it)")
    train.add_argument(
        "--max-seconds",
        type=float,
        metavar="S",
        help="a time budget: S seconds of steps in all, from the step-0 validation and across resumes (a resumed run trains what "
        "its checkpoint has not spent), the cosine re-fitted to end then (at the measured steps a second); the run ends as at its "
        "last step (validation, checkpoint). With --max-steps, whichever comes first",
    )
    train.add_argument("--schedule", choices=["cosine", "constant"])
    train.add_argument("--lr", type=float)
    train.add_argument("--warmup-steps", type=int)
    train.add_argument("--weight-decay", type=float)
    train.add_argument("--grokfast-alpha", type=float, help="enable the Grokfast-EMA gradient filter with this alpha (e.g. 0.98)")
    train.add_argument("--grokfast-lambda", type=float, help="Grokfast amplification (default from the profile, 2.0)")
    train.add_argument(
        "--resume",
        nargs="?",
        const="latest",
        metavar="CKPT",
        help="resume from CKPT (a checkpoint or run dir), or with no value from the newest checkpoint under --out",
    )
    train.add_argument("--rewarm-steps", type=int, help="linear LR re-warm after a resume (default: half the warmup)")
    train.add_argument("--data", type=Path, help="offline shards dir written by `extract` (default: run the target online)")
    train.add_argument(
        "--conversations",
        type=Path,
        help="chat data for online HF targets: ShareGPT, OpenAI messages or role/content (JSONL or a JSON array), a `data prepare` dir, "
        "or a `data regenerate` dir (refused when another target wrote it) "
        "(default <data_dir>/conversations.jsonl; a profile data dir under its run dir moves with --run-dir)",
    )
    train.add_argument(
        "--extra-conversations",
        type=Path,
        action="append",
        default=[],
        metavar="PATH",
        help="more training conversations (repeatable; any form --conversations takes): their train split is added, validation stays "
        "--conversations' own, and an added conversation whose first prompt is a val one's is dropped (e.g. ShareGPT's own answers "
        "beside the target's regenerated ones)",
    )
    train.add_argument(
        "--group-by-length",
        action="store_true",
        help="batches of similar-length conversations (less padding where short and long ones are mixed; the order stays seeded)",
    )
    train.add_argument(
        "--regenerate-tokens",
        type=int,
        default=0,
        help="regenerate assistant turns greedily in this run, one at a time, not saved (max new tokens; 0 = off); "
        "`data regenerate` does it batched, resumable and once",
    )
    train.add_argument(
        "--draft-head",
        choices=["random", "target"],
        default="random",
        help="a fresh draft's lm_head and final norm: random (default, as SpecForge) or the target's own, its rows of the draft "
        "vocabulary (needs the draft hidden size to equal the target's; a resumed run keeps its checkpoint's)",
    )
    train.add_argument(
        "--ttt-length",
        type=int,
        metavar="N",
        help="draft steps unrolled per training step (training-time test; default: the profile's [train] ttt_length). The draft's share "
        "of a step grows with N (the target's forward does not); a draft served with K steps uses positions 0..K-1 only",
    )
    train.add_argument(
        "--teacher-temperature",
        type=float,
        metavar="T",
        help="the loss's teacher is softmax(target logits / T) over the draft vocabulary (default: the profile's [train] "
        "teacher_temperature, 1: the target's own distribution, as EAGLE-3 and SpecForge train). Below 1 the teacher is "
        "sharper and the argmax, which a greedy chain accepts, weighs more; accuracy and accept length do not depend on T, "
        "the logged loss does",
    )
    train.add_argument(
        "--draft-intermediate-size",
        type=int,
        metavar="N",
        help="the draft MLP's width (default: the profile's [draft] intermediate_size). Exported in the draft's config.json, which "
        "SGLang reads; a resumed run must give the width its checkpoint has",
    )
    _add_chat_template(train)
    _add_target_placement(train)
    train.add_argument("--tensorboard", action="store_true", help="also write TensorBoard event files under <out>/tensorboard")
    train.add_argument("--device", help="cpu, cuda, cuda:1 (default: cuda when present; LOCAL_RANK under torchrun)")
    train.add_argument("--batch-size", type=int)
    train.add_argument("--eval-interval", type=int)
    train.add_argument("--save-interval", type=int)
    train.add_argument("--log-interval", type=int)
    train.add_argument("--max-val-batches", type=int, help="cap validation at this many batches per rank")
    train.add_argument("--seed", type=int)
    train.add_argument("--attn-backend", choices=["eager", "sdpa", "flex"], help="TTT attention kernel (default: flex on CUDA, sdpa on CPU)")
    _add_threads(train)
    train.set_defaults(handler=_train)


def _register_extract(subparsers, parent) -> None:
    extract = subparsers.add_parser(
        "extract",
        parents=[parent],
        help="write offline training shards (aux hidden states + teacher) with the target",
        description="Run the target over the training data and write safetensors shards. The disk estimate is printed first; "
        "nothing is written when it will not fit.",
    )
    extract.add_argument("--profile", required=True)
    extract.add_argument("--out", type=Path, required=True, help="new or empty output directory")
    extract.add_argument("--samples", type=int, help="training samples (tiny: generated; HF: first N conversations)")
    extract.add_argument("--val-samples", type=int, help="held-out samples (tiny only; default 1/10 of --samples)")
    extract.add_argument(
        "--conversations",
        type=Path,
        help="chat file (any format `data prepare` reads), a `data prepare` dir or a `data regenerate` dir (default <data_dir>/conversations.jsonl)",
    )
    extract.add_argument("--regenerate-tokens", type=int, default=0)
    _add_chat_template(extract)
    extract.add_argument(
        "--store",
        choices=["auto", "logits", "last_hidden"],
        default="auto",
        help="teacher as full logits or the final hidden state (auto: logits up to a 4096 vocab)",
    )
    extract.add_argument("--batch-size", type=int, default=8)
    extract.add_argument("--shard-samples", type=int, default=256)
    extract.add_argument("--keep-free-gb", type=float, default=1.0, help="refuse unless this much disk stays free afterwards")
    extract.add_argument("--device", help="where the shards' tensors are gathered, and the target when no device map is given")
    _add_target_placement(extract)
    _add_threads(extract)
    extract.set_defaults(handler=_extract)


def _add_chat_template(parser) -> None:
    parser.add_argument(
        "--chat-template",
        metavar="NAME|FILE",
        help="chat template for the conversations: chatml, llama3, qwen or a Jinja file (default: the tokenizer's own; refused when it has none)",
    )


def _add_target_placement(parser) -> None:
    group = parser.add_argument_group("a target larger than one device (transformers/accelerate device_map; online targets only)")
    group.add_argument(
        "--target-device-map",
        metavar="auto|balanced|balanced_low_0|sequential|cpu|FILE.json",
        help="spread the target's layers over this host's GPUs, CPU and disk (default: the whole target on --device). "
        "FILE.json maps module names to a GPU index, 'cpu' or 'disk'",
    )
    group.add_argument(
        "--target-max-memory", metavar="cuda:0=60GiB,cpu=200GiB", help="per-device caps for the device map (leave room for the draft on --device)"
    )
    group.add_argument("--target-offload-folder", type=Path, metavar="DIR", help="where weights placed on 'disk' are kept")


def target_placement(args: argparse.Namespace):
    """The --target-* flags, checked before anything loads: a device map places one copy of the target per process, so
    several ranks on one host (each would fill every GPU) and offline --data (no target runs) are refused."""

    placement = parse_placement(args.target_device_map, args.target_max_memory, args.target_offload_folder)
    if placement is None:
        return None
    if getattr(args, "data", None) is not None:
        raise TargetPlacementError("--target-device-map places the target for online training; with --data no target runs. Nothing was started.")
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)
    if local_ranks > 1:
        raise TargetPlacementError(
            f"--target-device-map with {local_ranks} ranks on this host: each would place its own copy of the target over every GPU. "
            "Run one process per host (the draft trains on --device). Nothing was started."
        )
    return placement


def chat_preflight(profile, spec: str | None, offline: bool = False, trust_remote_code: bool = False):
    """The --chat-template asked for, checked before anything heavy starts: a tokenizer without a template and none
    given is refused here (one line, exit 2) rather than after the target is loaded. Tiny and offline runs need none."""

    template = resolve_chat_template(spec)
    if offline:
        return template

    if profile.target.path == BUILTIN_TINY:
        return template
    path = resolve_target_path(profile)
    if is_tiny_target_dir(path):
        return template
    template_text(load_tokenizer(path, trust_remote_code), template)
    return template


def regenerated_preflight(profile, conversations: Path | None) -> None:
    """Conversations that `data regenerate` answered with another target are refused before this run's target loads."""
    if conversations is None:
        return
    from backend.train.regenerate import check_regenerated_target

    if profile.target.path != BUILTIN_TINY:
        check_regenerated_target(conversations, resolve_target_path(profile), profile.target.path)


def default_conversations(profile, conversations: Path | None, run_dir, log) -> Path | None:
    """--conversations, else None when the profile's default file exists (the trainer reads it), else, for a target
    from a wheel (smollm2-135m), a ShareGPT V3 sample prepared from its wheel: `train --profile smollm2-135m` (the
    console's `n` key) works on a fresh host with no data of its own."""
    if conversations is not None:
        return conversations

    if not profile.target.path.startswith(WHEEL_PREFIX):
        return None
    data_dir = Path(data_dir_for(profile.paths.data_dir, profile.paths.run_dir, run_dir)).expanduser()
    if (data_dir / "conversations.jsonl").is_file():
        return None
    return ensure_sharegpt_sample(data_dir / "sharegpt-v3-sample", cache_root(), log=log)


def training_estimate(profile, args: argparse.Namespace) -> str | None:
    """One honest line before a real-sized target trains on the CPU: what the profile asks for and what it costs there.

    Measured on this project's 2-core CPU machine (load 5-7 from other work) with SmolLM2-135M (30 layers, hidden 576,
    32,000-token draft vocabulary): 3 steps of 2 x 128 tokens in float32 took ~20 s of wall time after setup; a step
    of 4 x 1,024 (the profile's) had not finished after 10 minutes in bfloat16, nor after 27 (620 CPU-s) in float32."""
    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if profile.target.path == BUILTIN_TINY or not str(device).startswith("cpu") or profile.target.hidden_size < 512 or args.data is not None:
        return None
    batch, seq_len = args.batch_size or profile.train.batch_size, profile.train.seq_len
    steps = f"{args.max_seconds:g} s of steps" if args.max_seconds else f"{args.max_steps or profile.train.max_steps} steps"
    return (
        f"estimate: {steps} of {batch} x {seq_len} tokens for a {profile.target.num_layers}-layer, {profile.target.hidden_size}-wide target on the CPU. "
        f"On a 2-core machine a SmolLM2-135M step of 4 x 1024 tokens takes over 10 minutes (2 x 128: a few seconds), so at this size "
        f"expect days, not minutes: use --max-steps N and --batch-size 1 to watch it train, the tiny profile for a CPU demo, or a GPU host "
        f"(one H200: ~0.2 s a step). The step lines below show the real rate."
    )


def _fail(message: str) -> int:
    print(f"error: {message}", file=sys.stderr, flush=True)
    return 2


def _known_errors() -> tuple:
    from backend.profiles import ProfileError
    from backend.train.checkpoint import CheckpointError
    from backend.train.data import DataError
    from backend.train.draft import DraftConfigError, FeatureWidthError
    from backend.train.extract import ExtractError
    from backend.train.trainer import TrainSetupError

    return (
        ProfileError,
        CheckpointError,
        DataError,
        DraftConfigError,
        FeatureWidthError,
        ExtractError,
        TargetMismatchError,
        TargetPlacementError,
        TrainSetupError,
    )


def train_options(args: argparse.Namespace, chat_template=None, target_placement=None) -> TrainOptions:
    """The typed profile and the flags given (None where a flag was left out: the profile's value holds)."""
    from backend.profiles import load_profile
    from backend.train.trainer import TrainOptions

    return TrainOptions(
        profile=load_profile(args.profile),
        chat_template=chat_template,
        out_dir=args.out,
        run_dir=args.run_dir,
        max_steps=args.max_steps,
        max_seconds=args.max_seconds,
        schedule=args.schedule,
        lr=args.lr,
        weight_decay=args.weight_decay,
        warmup_steps=args.warmup_steps,
        grokfast_alpha=args.grokfast_alpha,
        grokfast_lambda=args.grokfast_lambda,
        resume=args.resume,
        rewarm_steps=args.rewarm_steps,
        data_dir=args.data,
        conversations=args.conversations,
        extra_conversations=tuple(args.extra_conversations),
        group_by_length=args.group_by_length,
        regenerate_tokens=args.regenerate_tokens,
        target_placement=target_placement,
        tensorboard=args.tensorboard,
        device=args.device,
        batch_size=args.batch_size,
        eval_interval=args.eval_interval,
        save_interval=args.save_interval,
        log_interval=args.log_interval,
        max_val_batches=args.max_val_batches,
        seed=args.seed,
        attn_backend=args.attn_backend,
        draft_head=args.draft_head,
        ttt_length=args.ttt_length,
        draft_intermediate_size=args.draft_intermediate_size,
        teacher_temperature=args.teacher_temperature,
    )


def _train(args: argparse.Namespace) -> int:
    from backend.train.trainer import train

    from backend.profiles import load_profile

    known = _known_errors()
    try:
        profile = load_profile(args.profile)
        template = chat_preflight(profile, args.chat_template, offline=args.data is not None, trust_remote_code=profile.serve.trust_remote_code)
        if args.max_seconds is not None and not args.max_seconds > 0:
            raise DataError(f"--max-seconds {args.max_seconds:g}: expected a positive number of seconds (nothing was started)")
        if args.ttt_length is not None and args.ttt_length < 1:
            raise DataError(f"--ttt-length {args.ttt_length}: expected at least 1 draft step (nothing was started)")
        if args.teacher_temperature is not None and not args.teacher_temperature > 0:
            raise DataError(f"--teacher-temperature {args.teacher_temperature:g}: expected a positive temperature (nothing was started)")
        if args.draft_intermediate_size is not None and args.draft_intermediate_size < 1:
            raise DataError(f"--draft-intermediate-size {args.draft_intermediate_size}: expected a positive width (nothing was started)")
        if args.data is None:
            for extra in args.extra_conversations:
                if not extra.expanduser().exists():
                    raise DataError(f"--extra-conversations {extra} does not exist; nothing was started")
            for conversations in [args.conversations, *args.extra_conversations]:
                regenerated_preflight(profile, conversations)
        elif args.extra_conversations:
            raise DataError("--extra-conversations adds chat data to an online run; offline --data shards hold their own (nothing was started)")
        placement = target_placement(args)
    except known as exc:
        return _fail(str(exc))
    first_rank = int(os.environ.get("RANK", "0") or 0) == 0
    log = (lambda m: print(f"[train] {m}", file=sys.stderr, flush=True)) if first_rank else (lambda _m: None)
    apply_threads(args.threads, log=log)
    try:
        if args.data is None:
            args.conversations = default_conversations(profile, args.conversations, args.run_dir, log)
        estimate = training_estimate(profile, args)
        if estimate:
            log(estimate)
    except known as exc:
        return _fail(str(exc))
    try:
        return train(train_options(args, template, placement))
    except known as exc:
        return _fail(str(exc))


def _extract(args) -> int:
    import signal

    from backend.profiles import load_profile
    from backend.train.data import conversation_samples, tiny_data_settings, tiny_samples
    from backend.train.extract import extract

    try:
        profile = load_profile(args.profile)
        template = chat_preflight(profile, args.chat_template, trust_remote_code=profile.serve.trust_remote_code)
        regenerated_preflight(profile, args.conversations)
        placement = target_placement(args)
    except _known_errors() as exc:
        return _fail(str(exc))
    apply_threads(args.threads)
    stop: dict[str, int | None] = {"signal": None}
    previous = signal.signal(signal.SIGTERM, lambda signum, _frame: stop.update(signal=signum))
    try:
        device = args.device or ("cuda" if _cuda() else "cpu")
        target = load_target(profile, device=device, placement=placement)
        if target.placement():
            print(f"extract: target placed by {placement.describe() if placement else 'its device map'}: {target.placement()}", file=sys.stderr, flush=True)
        if is_tiny_target_dir(target.path):
            settings = tiny_data_settings(profile.train.seq_len, args.samples, args.val_samples, seed=profile.train.seed)
            splits = tiny_samples(target, settings, log=lambda m: print(m, file=sys.stderr, flush=True))
        else:
            data_dir = data_dir_for(profile.paths.data_dir, profile.paths.run_dir, args.run_dir)  # moves with --run-dir
            conversations = args.conversations or Path(data_dir).expanduser() / "conversations.jsonl"
            splits = conversation_samples(
                target.tokenizer,
                conversations,
                profile.train.seq_len,
                seed=profile.train.seed,
                limit=args.samples,
                target=target,
                regenerate_tokens=args.regenerate_tokens,
                chat_template=template,
                log=lambda m: print(m, file=sys.stderr, flush=True),
            )
        extract(
            target,
            splits,
            args.out,
            store=args.store,
            batch_size=args.batch_size,
            shard_samples=args.shard_samples,
            keep_free_bytes=int(args.keep_free_gb * (1 << 30)),
            should_stop=lambda: stop["signal"] is not None,
        )
        print(args.out)
        return 0
    except _known_errors() as exc:
        return _fail(str(exc))
    except KeyboardInterrupt:
        print(f"extract: stopped; {args.out} is incomplete (no meta.json) and training will refuse it", file=sys.stderr)
        return 1
    finally:
        signal.signal(signal.SIGTERM, previous)


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def _export(args) -> int:
    from backend.train.checkpoint import export_checkpoint

    try:
        path = export_checkpoint(args.checkpoint, args.destination)
    except _known_errors() as exc:
        return _fail(str(exc))
    print(path)
    return 0


def _build_tiny(args) -> int:

    apply_threads(args.threads)
    print(ensure_tiny_target())
    return 0
