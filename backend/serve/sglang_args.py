"""The SGLang launch command for an EAGLE-3 draft, built as an argv list from a profile (no sglang import)."""

from __future__ import annotations

import os
import sys
from typing import Any

from backend.profiles import Profile
from backend.serve.spec_setting import verify_width

# Flags of reference/sglang-eagle3.md section 1 that every EAGLE-3 launch sets explicitly.
REQUIRED_FLAGS = (
    "--model-path",
    "--speculative-algorithm",
    "--speculative-draft-model-path",
    "--speculative-num-steps",
    "--speculative-eagle-topk",
    "--speculative-num-draft-tokens",
    "--dtype",
    "--tp-size",
    "--mem-fraction-static",
    "--host",
    "--port",
)
# SGLang's aliases (server_args.py), folded to the canonical names when reading an argv.
FLAG_ALIASES = {
    "--model": "--model-path",
    "--speculative-draft-model": "--speculative-draft-model-path",
    "--tensor-parallel-size": "--tp-size",
    "--tp": "--tp-size",
}
SGLANG_PYTHON_ENV = "EAGLE3_SGLANG_PYTHON"  # the interpreter with sglang installed, when not ours


def sglang_python() -> str:
    return os.environ.get(SGLANG_PYTHON_ENV) or sys.executable


def build_sglang_argv(
    profile: Profile,
    draft_path: str | None,
    *,
    target_path: str | None = None,
    port: int | None = None,
    host: str = "127.0.0.1",
    python: str | None = None,
    speculative: bool = True,
) -> list[str]:
    """[python, -m, sglang.launch_server, ...]: every section-1 flag explicit; profile extra_args last.

    speculative=False gives the same server without the five speculative flags (the benchmark baseline).
    """
    serve = profile.serve
    argv = [python or sglang_python(), "-m", "sglang.launch_server", "--model-path", target_path or profile.target.path]
    if speculative:
        argv += [
            "--speculative-algorithm",
            "EAGLE3",
            "--speculative-draft-model-path",
            str(draft_path),
            "--speculative-num-steps",
            str(serve.num_steps),
            "--speculative-eagle-topk",
            str(serve.eagle_topk),
            "--speculative-num-draft-tokens",
            str(serve.num_draft_tokens),
        ]
    argv += [
        "--dtype",
        serve.dtype,
        "--tp-size",
        str(serve.tp_size),
        "--mem-fraction-static",
        str(serve.mem_fraction_static),
        "--host",
        host,
        "--port",
        str(port if port is not None else serve.port),
    ]
    if serve.trust_remote_code:
        argv.append("--trust-remote-code")
    argv.extend(serve.extra_args)
    return argv


def server_args_part(argv: list[str]) -> list[str]:
    """The arguments after `-m sglang.launch_server` (what ServerArgs parses)."""
    if "sglang.launch_server" in argv:
        return argv[argv.index("sglang.launch_server") + 1 :]
    return list(argv)


def parse_flag_values(argv: list[str]) -> dict[str, Any]:
    """--flag value / --flag=value / bare --flag (True); aliases folded; the last occurrence wins, as in argparse."""
    values: dict[str, Any] = {}
    args = server_args_part(argv)
    value: str | bool
    i = 0
    while i < len(args):
        token = args[i]
        if not token.startswith("--"):
            i += 1
            continue
        if "=" in token:
            name, value = token.split("=", 1)
            i += 1
        elif i + 1 < len(args) and not args[i + 1].startswith("--"):
            name, value = token, args[i + 1]
            i += 2
        else:
            name, value = token, True
            i += 1
        values[FLAG_ALIASES.get(name, name)] = value
    return values


def expected_spec_settings(profile: Profile) -> dict[str, int]:
    """What /get_server_info should report after SGLang's own adjustment (topk 1 forces draft tokens = steps + 1)."""
    serve = profile.serve
    tokens = verify_width(serve.num_steps, serve.eagle_topk, serve.num_draft_tokens)
    return {"speculative_num_steps": serve.num_steps, "speculative_eagle_topk": serve.eagle_topk, "speculative_num_draft_tokens": tokens}


def argv_inconsistencies(argv: list[str], profile: Profile, draft_path: str) -> list[str]:
    """Section-1 rules checked on the argv itself (the always-run contract test uses this)."""
    flags = parse_flag_values(argv)
    problems = [f"{flag} missing" for flag in REQUIRED_FLAGS if flag not in flags]
    serve = profile.serve
    expect = {
        "--speculative-algorithm": "EAGLE3",
        "--speculative-draft-model-path": str(draft_path),
        "--speculative-num-steps": str(serve.num_steps),
        "--speculative-eagle-topk": str(serve.eagle_topk),
        "--speculative-num-draft-tokens": str(serve.num_draft_tokens),
        "--dtype": serve.dtype,
        "--tp-size": str(serve.tp_size),
    }
    problems += [f"{flag} is {flags.get(flag)!r}, expected {want!r}" for flag, want in expect.items() if flag in flags and flags[flag] != want]
    if flags.get("--dtype") == "auto":
        problems.append("--dtype auto: float32 drafts would be served as float16")
    if serve.eagle_topk == 1 and serve.num_draft_tokens != serve.num_steps + 1:
        problems.append("topk 1 needs num_draft_tokens = num_steps + 1 (SGLang adjusts it otherwise)")
    if serve.trust_remote_code != (flags.get("--trust-remote-code") is True):
        problems.append("--trust-remote-code does not follow the profile")
    return problems
