"""Launch a speculative server as an owned job: preflight, start, wait for health, check server info, run the canary."""

from __future__ import annotations

import os
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

from backend.profiles import Profile
from backend.serve import canary as canary_mod
from backend.serve import http
from backend.serve.acceptance import checkpoint_val_data, checkpoint_validation
from backend.serve.preflight import resolve_draft_dir, run_preflight, target_config_file
from backend.serve.prompts import PromptFit, load_prompts, served_prompt_fit
from backend.serve.sglang_args import build_sglang_argv, expected_spec_settings
from backend.train.chat_templates import render_chat, resolve_chat_template
from backend.train.conversations import PROMPT_SPLITS, split_prompts
from backend.train.target import resolve_target_path, load_tokenizer
from backend.train.tiny import read_corpus
from backend.host.gpu import open_gpu_source
from backend.host.holders import list_holders
from backend.jobs.registry import SAFE_PATH_ENV, JobRegistry
from backend.protocol import to_dict
from backend.jobs.logs import tail_lines

REPO_ROOT = Path(__file__).resolve().parents[2]
ENGINES = ("sglang", "reference")
FEEDS = ("aux", "last_hidden")
TINY_PROMPT_BYTES = 64


@dataclass
class LaunchResult:
    ok: bool
    state: str  # refused | start_failed | exited | timeout | ready | dry_run
    message: str
    engine: str
    url: str
    argv: list[str]
    job_name: str | None = None
    job: dict[str, Any] | None = None
    preflight: dict[str, Any] | None = None
    forced: bool = False
    timings: dict[str, float] = field(default_factory=dict)
    server_info: dict[str, Any] = field(default_factory=dict)
    server_check: list[str] = field(default_factory=list)  # mismatches between what was asked and what runs
    canary: dict[str, Any] | None = None
    verdict: str | None = None  # green | red (None when the server never became ready)
    causes: list[dict[str, Any]] = field(default_factory=list)
    log_tail: list[str] = field(default_factory=list)
    gpu_release: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# --------------------------------------------------------------------------- argv and inputs


def target_dir(profile: Profile) -> str:
    """Local path of the target (builds the cached tiny target for 'builtin:tiny')."""

    return resolve_target_path(profile)


def target_config_for(profile: Profile, explicit: str | None = None) -> str | dict[str, Any]:
    """--target-config when given (a model dir means its config.json); else the target dir's config.json; else the
    profile's own target facts."""
    if explicit:
        return str(target_config_file(explicit))
    path = Path(os.path.expanduser(profile.target.path))
    if profile.target.path.startswith(("builtin:", "wheel:")):
        path = Path(target_dir(profile))
    if (path / "config.json").is_file():
        return str(path / "config.json")
    target = profile.target
    return {
        "architectures": [target.architecture],
        "hidden_size": target.hidden_size,
        "num_hidden_layers": target.num_layers,
        "vocab_size": target.vocab_size,
        "torch_dtype": target.dtype,
    }


def reference_argv(
    profile: Profile,
    draft_dir: str | None,
    port: int,
    *,
    host: str = "127.0.0.1",
    feed: str = "aux",
    num_steps: int | None = None,
    speculative: bool = True,
    device: str | None = None,
) -> list[str]:
    """device: the reference server's --device (None: its default, auto = cuda:0 when CUDA is available)."""
    argv = [sys.executable, "-m", "backend.serve.reference.server", "--profile", profile.source or profile.name, "--host", host, "--port", str(port)]
    if device is not None:
        argv += ["--device", device]
    if speculative:
        if draft_dir is None:
            raise ValueError("a speculative reference server needs the draft checkpoint directory")
        argv += ["--draft", str(draft_dir), "--feed", feed, "--num-steps", str(num_steps or profile.serve.num_steps)]
        if profile.serve.eagle_topk > 1 and num_steps in (None, profile.serve.num_steps):  # the profile's SGLang tree, as SGLang would draft it
            argv += ["--eagle-topk", str(profile.serve.eagle_topk), "--num-draft-tokens", str(profile.serve.num_draft_tokens), "--static-cache"]
    else:
        argv.append("--no-speculation")
    return argv + checked_reference_args(argv, profile.serve.reference_args)


# What reference_argv sets itself: a profile's [serve] reference_args may not set them again.
LAUNCHER_SETS = ("--profile", "--host", "--port", "--device", "--draft", "--feed", "--num-steps", "--no-speculation", "--eagle-topk", "--num-draft-tokens")


def checked_reference_args(argv: list[str], extra: list[str]) -> list[str]:
    """The profile's [serve] reference_args, refused (ValueError, nothing started) when the reference server's own
    parser would refuse them or they set what the launcher does."""
    if not extra:
        return []
    import contextlib
    import io

    from backend.serve.reference.server import parse_args

    taken = [arg for arg in extra if arg.split("=", 1)[0] in LAUNCHER_SETS]
    if taken:
        raise ValueError(f"[serve] reference_args may not set {', '.join(taken)}: the launcher sets it; nothing was started")
    errors = io.StringIO()
    try:
        with contextlib.redirect_stderr(errors):
            parse_args([*argv[3:], *extra])
    except SystemExit:
        said = errors.getvalue().strip().splitlines()
        raise ValueError(f"[serve] reference_args {extra}: {said[-1] if said else 'refused'}; nothing was started") from None
    return list(extra)


def build_argv(
    profile: Profile,
    draft_dir: str | None,
    engine: str,
    port: int,
    *,
    feed: str = "aux",
    host: str = "127.0.0.1",
    speculative: bool = True,
    device: str | None = None,
) -> list[str]:
    if engine == "reference":
        return reference_argv(profile, draft_dir, port, host=host, feed=feed, speculative=speculative, device=device)
    if device is not None:
        raise ValueError("--device exists only on the reference engine (SGLang places the model itself)")
    if feed != "aux":
        raise ValueError("--feed last_hidden exists only on the reference engine (SGLang feeds what its target captures)")
    target = target_dir(profile) if profile.target.path.startswith(("builtin:", "wheel:")) else profile.target.path
    return build_sglang_argv(profile, draft_dir, target_path=target, port=port, host=host, speculative=speculative)


def canary_prompts(profile: Profile, count: int = 4) -> list[str]:
    """Prompts like the training data: held-out corpus windows for the tiny target, the shipped chat set otherwise."""
    return shipped_prompts(profile, count, tag="chat")[0]


def shipped_prompts(profile: Profile, count: int, tag: str | None = None) -> tuple[list[str], str]:
    """(prompts, what they are): held-out windows of the tiny target's corpus; otherwise the shipped set (`tag`
    filters it) through the target's chat template, or raw, and why, where the target has none."""
    if profile.target.path == "builtin:tiny":
        text = read_corpus(target_dir(profile), "val")
        stride = max(TINY_PROMPT_BYTES, len(text) // (count + 1))
        windows = [text[i * stride : i * stride + TINY_PROMPT_BYTES] for i in range(count)]
        return [w.decode("utf-8", errors="ignore") for w in windows], "held-out windows of the tiny target's corpus"
    prompts = load_prompts(tag=tag, limit=count).prompts
    label = "the shipped chat prompts" if tag == "chat" else "the shipped prompts"
    try:
        tokenizer = load_tokenizer(target_dir(profile), profile.serve.trust_remote_code)
        return [render_chat(tokenizer, [{"role": "user", "content": p}], add_generation_prompt=True, template=None, tokenize=False) for p in prompts], label
    except Exception as exc:  # no tokenizer files, no template, no transformers: the raw prompts still exercise the draft
        return prompts, f"{label}, raw (no chat template: {type(exc).__name__})"


DRAFT_CANARY_PROMPTS = 8  # 4-prompt subsets of one set spread 1.54-2.21 in accept length for one SmolLM2 draft (2026-12-05)


def draft_canary_prompts(profile: Profile, draft_dir: Any, count: int = DRAFT_CANARY_PROMPTS, fit: PromptFit | None = None) -> tuple[list[str], str]:
    """(prompts, where they came from) for the canary of a trained draft: the prompts of the conversations its
    validation ran on (the checkpoint's `val_data`), so that the accept length served and tau-hat predicted from
    validation measure the same distribution; the shipped chat prompts when it records none or they cannot be read here.

    On 2026-12-05 a healthy SmolLM2 draft (tau-hat 2.72, 2.32 served in process on held-out ShareGPT) accepted 1.62
    on 4 shipped chat prompts over HTTP: RED at 0.6 x tau-hat, the server stopped. On the CPU, 64 tokens a prompt, it
    accepts 1.82 on 8 shipped prompts, 1.98 on 8 of its validation prompts, and 1.02 on both with the broken feed
    (docs/serving.md)."""
    return _draft_data_prompts(profile, draft_dir, "val", count, tag="chat", fit=fit)


def draft_bench_prompts(profile: Profile, draft_dir: Any, count: int, fit: PromptFit | None = None) -> tuple[list[str], str]:
    """(prompts, where they came from) for stop & bench's benchmark: the held-out eval prompts of the data the draft
    was trained on (the eval split beside its checkpoint's `val_data`: prompts training never saw), through its
    template; the whole shipped set through the target's chat template otherwise.

    On 2026-12-05 (one H100) the chain's benchmark asked the shipped prompts raw, without the chat template the draft
    was trained on: accept length 1.55 and 0.95x plain decoding, for a draft that served 2.39 and 1.43x on 100 held-out
    ShareGPT prompts through the template on the same server (docs/real-model.md, round 22)."""
    return _draft_data_prompts(profile, draft_dir, "eval", count, fit=fit)


def _draft_data_prompts(
    profile: Profile, draft_dir: Any, split: str, count: int, tag: str | None = None, fit: PromptFit | None = None
) -> tuple[list[str], str]:
    """The first `count` prompts of `split` of the data dir the draft's checkpoint records, through its template,
    that `fit` admits; else shipped_prompts, with the reason. The tiny target's drafts train on corpus windows: always
    shipped_prompts."""
    if profile.target.path == "builtin:tiny":
        return shipped_prompts(profile, count, tag)
    why = ""
    val_data = checkpoint_val_data(draft_dir)
    if val_data is not None:
        what = PROMPT_SPLITS[split]
        try:
            prompts, skipped = _recorded_chat_prompts(profile, val_data, split, count, fit)
        except (OSError, ValueError) as exc:  # moved or deleted (DataError is a ValueError), a template that no longer renders
            why = f" (the draft's {what} could not be used: {exc})"
        else:
            too_long = f"; {fit.describe(skipped)}" if fit is not None and skipped else ""
            if prompts:
                return prompts, f"the draft's {what} ({len(prompts)} of {val_data['conversations']}{too_long})"
            why = f" ({val_data['conversations']} holds no {what}{too_long})"
    prompts, label = shipped_prompts(profile, count, tag)
    return prompts, label + why


FIT_SCAN = 4  # with a fit, up to this many times `count` prompts are read to find `count` that it admits


def _recorded_chat_prompts(profile: Profile, val_data: dict[str, Any], split: str, count: int, fit: PromptFit | None) -> tuple[list[str], int]:
    """(the first `count` rendered prompts `fit` admits, how many it did not admit before them)."""
    conversations = split_prompts(val_data["conversations"], split, count if fit is None else FIT_SCAN * count)
    template = resolve_chat_template(val_data.get("chat_template"))
    tokenizer = load_tokenizer(target_dir(profile), profile.serve.trust_remote_code)
    text = template.text if template is not None else None
    prompts: list[str] = []
    skipped = 0
    for messages in conversations:
        if len(prompts) == count:
            break
        prompt = render_chat(tokenizer, messages, add_generation_prompt=True, template=text, tokenize=False)
        if fit is None or fit.admits(len(tokenizer.encode(prompt))):  # encoded as the servers encode a request's text
            prompts.append(prompt)
        else:
            skipped += 1
    return prompts, skipped


# --------------------------------------------------------------------------- waiting


def wait_ready(url: str, job_exit: Callable[[], int | None], timeout_s: float, log: Callable[[str], None]) -> tuple[str, int | None]:
    """Poll GET /health_generate with backoff until 200. Returns ("ready"|"exited"|"timeout", exit_code)."""
    deadline = time.monotonic() + timeout_s
    delay = 0.25
    last_report = time.monotonic()
    while True:
        code = job_exit()
        if code is not None:
            return "exited", code
        reply = http.get(f"{url}/health_generate", timeout=min(30.0, max(1.0, deadline - time.monotonic())))
        if reply.status == 200:
            return "ready", None
        now = time.monotonic()
        if now >= deadline:
            return "timeout", None
        if now - last_report > 30:
            log(f"waiting for {url}/health_generate: {http.describe(reply)}")
            last_report = now
        time.sleep(min(delay, max(0.0, deadline - now)))
        delay = min(delay * 1.5, 5.0)


def server_mismatches(info: dict[str, Any], expected: dict[str, Any]) -> list[str]:
    """What the server reports vs. what was asked; speculative_algorithm must be EAGLE3 unless expected says otherwise."""
    want_all = {"speculative_algorithm": "EAGLE3", **expected}
    return [f"{key} is {info.get(key)!r}, expected {want!r}" for key, want in want_all.items() if info.get(key) != want]


def gpu_release_check(pids: list[int]) -> dict[str, Any]:
    """After a server exited: does any of its processes still hold a GPU? (backend.host.holders)."""
    try:
        source = open_gpu_source(stream=False)
        try:
            report = list_holders(source)
        finally:
            getattr(source, "close", lambda: None)()
    except Exception as exc:  # a broken driver must not hide the server's own failure
        return {"checked": False, "note": f"GPU holder check failed: {type(exc).__name__}: {exc}"}
    still = [h.pid for h in report.holders if h.pid in pids]
    note = (
        "no GPU visible here (nothing to release)"
        if report.gpu_source == "none" and not report.holders
        else "released"
        if not still
        else f"processes {still} still hold GPU memory"
    )
    return {"checked": True, "gpu_source": report.gpu_source, "still_holding": still, "note": note}


# --------------------------------------------------------------------------- the launch


def launch(
    profile: Profile,
    draft_dir: str | os.PathLike | None,
    *,
    engine: str = "sglang",
    port: int | None = None,
    run_dir: str | os.PathLike | None = None,
    job_name: str | None = None,
    feed: str = "aux",
    force: bool = False,
    target_config: str | None = None,
    host: str = "127.0.0.1",
    prompts: list[str] | None = None,
    max_new_tokens: int = 128,
    ready_timeout_s: float | None = None,
    run_canary: bool = True,
    env: dict[str, str] | None = None,
    speculative: bool = True,
    device: str | None = None,
    log: Callable[[str], None] = lambda line: print(line, file=sys.stderr, flush=True),
) -> LaunchResult:
    """speculative=False starts the same target without a draft (the benchmark baseline): no preflight, no canary."""
    if engine not in ENGINES or feed not in FEEDS:
        raise ValueError(f"engine must be one of {ENGINES} and feed one of {FEEDS}; got {engine!r}, {feed!r}")
    draft = None
    if speculative:
        if draft_dir is None:
            raise ValueError("a speculative launch needs the draft checkpoint directory")
        draft = str(resolve_draft_dir(Path(draft_dir).expanduser()))
    port = port or (http.free_port(host) if engine == "reference" else profile.serve.port)
    url = http.base_url("127.0.0.1" if host in ("0.0.0.0", "::") else host, port)
    argv = build_argv(profile, draft, engine, port, feed=feed, host=host, speculative=speculative, device=device)
    result = LaunchResult(ok=False, state="refused", message="", engine=engine, url=url, argv=argv, forced=force)
    if draft is None:  # speculative=False
        return _start_and_wait(
            result,
            profile,
            argv,
            url,
            run_dir,
            job_name or f"serve-{profile.name}-{engine}-baseline",
            env,
            ready_timeout_s,
            log,
            expected={"speculative_algorithm": None},
        )

    started = time.monotonic()
    sglang_argv = build_sglang_argv(profile, draft, port=port, host=host)
    report = run_preflight(draft, target_config_for(profile, target_config), serving_argv=sglang_argv)
    result.preflight = report.to_dict()
    result.timings["preflight_s"] = time.monotonic() - started
    if not report.ok and not force:
        result.message = (
            f"preflight found {len(report.problems)} problem(s) ({', '.join(report.codes())}); "
            "the server was NOT started. Fix them, or pass --force to launch anyway."
        )
        return result
    if not report.ok:
        log(f"preflight problems {report.codes()} ignored because of --force")

    _start_and_wait(
        result, profile, argv, url, run_dir, job_name or f"serve-{profile.name}-{engine}", env, ready_timeout_s, log, expected=expected_spec_settings(profile)
    )
    if result.state != "ready":
        return result
    if not run_canary:
        result.ok = not result.server_check
        result.message = "server ready (canary skipped)" + (f"; {result.server_check}" if result.server_check else "")
        return result

    canary_started = time.monotonic()
    val_acc, val_rounds = checkpoint_validation(draft)
    if not prompts:
        prompts, prompt_source = draft_canary_prompts(profile, draft, fit=served_prompt_fit(url, max_new_tokens))
    else:
        prompt_source = "given by the caller"
    outcome = canary_mod.run_canary(
        url,
        prompts,
        prompt_source=prompt_source,
        num_steps=int(result.server_info.get("speculative_num_steps") or profile.serve.num_steps),
        val_acc=val_acc,
        val_rounds=val_rounds,
        max_new_tokens=max_new_tokens,
        preflight_codes=report.codes(),
    )
    result.timings["canary_s"] = time.monotonic() - canary_started
    result.canary = outcome.to_dict()
    result.verdict, result.causes = outcome.verdict, outcome.causes
    result.ok = outcome.verdict == canary_mod.GREEN and not result.server_check
    result.message = f"{outcome.verdict}: {outcome.headline}"
    if result.server_check:
        result.message += f"; server runs other settings than asked: {'; '.join(result.server_check)}"
    if not result.ok:
        result.message += f". The server is still running as job {result.job_name!r} (stop it with `eagle3-host job stop --name {result.job_name}`)."
    return result


def _start_and_wait(
    result: LaunchResult,
    profile: Profile,
    argv: list[str],
    url: str,
    run_dir: Any,
    job_name: str,
    env: dict[str, str] | None,
    ready_timeout_s: float | None,
    log: Callable[[str], None],
    expected: dict[str, Any],
) -> LaunchResult:
    """Start the owned job, wait for health, read and check the server info; fills `result` in place."""

    registry = JobRegistry(Path(run_dir or "~/.eagle3").expanduser())
    try:
        # the safe path: neither our server nor SGLang's imports a package planted in its cwd (PYTHONSAFEPATH, which a
        # Python before 3.11 ignores; the job's PYTHONPATH names this package's parent, so backend still imports)
        info = registry.start_job(job_name, "serve", argv, cwd=str(REPO_ROOT), env={**SAFE_PATH_ENV, **(env or {})})
    except Exception as exc:  # JobConflict (name in use), JobBadParams, spawn failures: nothing else was started
        result.state = "start_failed"
        result.message = f"could not start job {job_name!r}: {exc}"
        return result
    result.job_name = job_name
    result.job = _job_dict(info)
    log(f"started job {job_name!r} (pid {info.pid}): waiting for {url}/health_generate")

    wait_started = time.monotonic()
    timeout = ready_timeout_s or profile.serve.ready_timeout_s
    state, exit_code = wait_ready(url, lambda: _job_exit_code(registry, job_name), timeout, log)
    result.timings["ready_s"] = time.monotonic() - wait_started
    if state != "ready":
        result.state = state
        result.log_tail = _log_tail(result.job)
        pid = result.job.get("pid")
        result.gpu_release = gpu_release_check([pid] if pid else [])
        if state == "exited":
            result.message = f"server job {job_name!r} exited with code {exit_code} before answering /health_generate"
        else:
            result.message = (
                f"server job {job_name!r} did not answer /health_generate with 200 within {timeout:.0f} s; "
                f"it is still running (stop it with `eagle3-host job stop --name {job_name}`)"
            )
        return result
    info_reply = http.get(f"{url}/get_server_info", timeout=60)
    result.server_info = server_summary(info_reply.body if isinstance(info_reply.body, dict) else {})
    result.server_check = server_mismatches(result.server_info, expected)
    result.state = "ready"
    result.ok = not result.server_check
    result.message = f"server ready as job {job_name!r}" + (f"; {'; '.join(result.server_check)}" if result.server_check else "")
    return result


SERVER_INFO_KEYS = (
    "model_path",
    "speculative_algorithm",
    "speculative_draft_model_path",
    "speculative_num_steps",
    "speculative_eagle_topk",
    "speculative_num_draft_tokens",
    "first_step_branches",  # the reference engine's --branches
    "dtype",
    "tp_size",
    "version",
    "engine",
    "mem_fraction_static",
    "cuda_graph_max_bs",
    "disable_cuda_graph",
)


def server_summary(info: dict[str, Any]) -> dict[str, Any]:
    """The fields that identify what was served (the full /get_server_info is hundreds of keys)."""
    summary = {k: info.get(k) for k in SERVER_INFO_KEYS if k in info}
    states = info.get("internal_states")
    if isinstance(states, list) and states and isinstance(states[0], dict):
        summary["internal_state"] = {k: v for k, v in states[0].items() if not isinstance(v, (dict, list))}
    return summary


# --------------------------------------------------------------------------- job adapters


def _job_dict(job: Any) -> dict[str, Any]:
    if isinstance(job, dict):
        return job

    return to_dict(job)


def _job_exit_code(registry: Any, name: str) -> int | None:
    """The job's exit code once it has exited; None while it runs."""
    info = registry.get(name).info
    if info.state in ("running", "unknown"):
        return None
    return info.exit_code if info.exit_code is not None else -1


def _log_tail(job: dict[str, Any], lines: int = 30) -> list[str]:

    tail: list[str] = []
    for key, label in (("stdout_path", "stdout"), ("stderr_path", "stderr")):
        path = job.get(key)
        if path and Path(path).is_file():
            tail += [f"[{label}] {line}" for line in tail_lines(path, lines)]
    return tail
