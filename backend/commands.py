"""The host command lines both sides build (stop-and-bench chain, grokking run), their defaults, and profile facts.

One home: `eagle3-host` (backend/chain_cli.py) reads its argparse defaults and builds its argv here, and the
console imports this module (with backend/protocol.py and backend/layout.py, the only backend modules it may).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import PurePosixPath
from typing import Any


CHAIN_PREFIX = "chain-"
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}
CHAIN_GRACE_DEFAULT_S = 120.0  # `stop-and-bench --grace` default
CHAIN_CONCURRENCY_DEFAULT = "1,4"
CHAIN_PROMPTS_DEFAULT = 8
CHAIN_MAX_NEW_TOKENS_DEFAULT = 64
GROK_WEIGHT_DECAY_DEFAULT = 0.1


def option_value(argv: list[str], option: str) -> str | None:
    """The value of `--option VALUE` or `--option=VALUE` in a command line (the last one wins)."""
    found = None
    for index, arg in enumerate(argv):
        if arg == option and index + 1 < len(argv):
            found = argv[index + 1]
        elif arg.startswith(option + "="):
            found = arg.split("=", 1)[1]
    return found


def chain_job_name(train_job: str) -> str:
    return f"{CHAIN_PREFIX}{train_job}"


def chain_argv(train_job: str, extra: list[str] | tuple[str, ...] = ()) -> list[str]:
    """`eagle3-host stop-and-bench --job JOB --json [extra...]`: the chain the `b` key runs."""
    return ["eagle3-host", "stop-and-bench", "--job", train_job, "--json", *extra]


def chain_training_job(argv: list[str], chain_name: str) -> str:
    """Which training job a chain job works on: its --job, else its name without the prefix."""
    return option_value(argv, "--job") or chain_name.removeprefix(CHAIN_PREFIX)


def grok_argv(profile: str, checkpoint: str, lr: float, weight_decay: float, grokfast_alpha: float | None,
              max_steps: int | None = None) -> list[str]:
    """Resume CKPT with a constant LR as a new training job: what `eagle3-host grok` and the `g` key start."""
    argv = ["eagle3-host", "train", "--profile", profile, "--resume", str(PurePosixPath(checkpoint)), "--schedule", "constant",
            "--lr", repr(lr), "--weight-decay", repr(weight_decay)]
    if grokfast_alpha is not None:
        argv += ["--grokfast-alpha", repr(grokfast_alpha)]
    if max_steps is not None:
        argv += ["--max-steps", str(max_steps)]
    return argv


def resume_argv(profile: str, checkpoint: str) -> list[str]:
    """Resume CKPT as a new training job with the profile's own schedule: what the console's resume key starts."""
    return ["eagle3-host", "train", "--profile", profile, "--resume", str(PurePosixPath(checkpoint))]


def resume_job_name(checkpoint: str) -> str:
    """resume-<checkpoint dir name>, e.g. resume-epoch-0-step-300."""
    return f"resume-{PurePosixPath(checkpoint).name}".replace("_", "-")


def grok_job_name(checkpoint: str) -> str:
    """grok-<checkpoint dir name>, as `eagle3-host grok` names it."""
    return f"grok-{PurePosixPath(checkpoint).name}".replace("_", "-")


@dataclass
class ProfileFacts:
    """What the console reads from a profile for its plans; `error` says why a profile could not be read here."""

    name: str
    engine: str | None = None
    port: int | None = None
    data_dir: str | None = None
    learning_rate: float | None = None
    weight_decay: float | None = None
    shape: dict[str, int] | None = None
    error: str | None = None


def profile_facts(name: str) -> ProfileFacts:
    from backend.profiles import ProfileError, load_profile  # pydantic: only when a profile is read

    try:
        profile = load_profile(name)
    except (ProfileError, OSError, ValueError) as exc:
        return ProfileFacts(name=name, error=str(exc).splitlines()[0][:200])
    return ProfileFacts(
        name=profile.name,
        engine=profile.serve.engine,
        port=profile.serve.port,
        data_dir=profile.paths.data_dir,
        learning_rate=profile.train.learning_rate,
        weight_decay=profile.train.weight_decay,
        shape=profile_shape(profile),
    )


def profile_shape(profile: Any) -> dict[str, int]:
    """What one offline sample holds per token for a profile: aux features, teacher, dtype, sequence length."""
    target = profile.target
    return {
        "aux_width": len(target.aux_layer_ids) * target.hidden_size,
        # small vocabularies store teacher logits; large ones the final hidden state (lm_head applied at train time)
        "teacher_width": target.vocab_size if target.vocab_size <= 4096 else target.hidden_size,
        "dtype_bytes": DTYPE_BYTES.get(target.dtype, 2),
        "seq_len": profile.train.seq_len,
    }


def job_profile(argv: list[str], default: str) -> str:
    """The --profile of a recorded command line, else the console's profile."""
    return option_value(argv, "--profile") or default
