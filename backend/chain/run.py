"""Stop-and-benchmark: stop the owned training job with a checkpoint, free its GPUs, preflight, serve, canary, benchmark.

Each stage appends a record to a stages.jsonl file (the console follows it through the agent) and reports to a
callback; a failure stops the chain, says why, and leaves no half-state: a server whose canary is red is stopped
unless the operator asked to keep it. An amber canary (the draft has not learned enough for a verdict) is no failure:
the server stays up, the benchmark runs, and the result says amber. The result is saved beside the training run so
runs can be compared.
"""

from __future__ import annotations

import functools
import json
import os
import shlex
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from backend.commands import CHAIN_STAGES
from backend.durable import write_atomic
from backend.jsonl import append_record
from backend.layout import RESULTS_DIRNAME, STAGES_FILENAME
from backend.jobs.registry import JobRegistry
from backend.jobs.records import JobNotFound
from backend.host.holders import list_holders
from backend.serve.acceptance import checkpoint_validation
from backend.serve.preflight import resolve_draft_dir, run_preflight
from backend.host.gpu import open_gpu_source

if TYPE_CHECKING:
    from backend.profiles import Profile
    from backend.serve.prompts import PromptFit


class ChainFailed(Exception):
    """A stage failed; the message says why and what was left as it was."""


@dataclass
class ChainOptions:
    job: str
    run_dir: Path
    profile: str | None = None  # default: the --profile of the training job's command line
    engine: str | None = None  # default: the profile's serve.engine
    grace_s: float = 120.0
    port: int | None = None
    keep_on_red: bool = False
    stop_server_after: bool = False
    concurrency: list[int] = field(default_factory=lambda: [1, 4])
    num_prompts: int = 8
    max_new_tokens: int = 64
    stages_path: Path | None = None


@dataclass
class StageReporter:
    """Writes one record per stage transition and forwards it to a callback."""

    path: Path | None
    callback: Callable[[dict[str, Any]], None] | None = None
    started: dict[str, float] = field(default_factory=dict)

    def emit(self, stage: str, status: str, detail: str = "", result: Any = None) -> dict[str, Any]:
        now = time.time()
        if status == "running":
            self.started[stage] = now
        record = {"stage": stage, "status": status, "time": now, "elapsed": round(now - self.started.get(stage, now), 3), "detail": detail}
        if result is not None:
            record["result"] = result
        if self.path is not None:
            append_record(self.path, record)
        if self.callback is not None:
            self.callback(record)
        return record


def profile_from_argv(argv: list[str]) -> str | None:
    """The --profile value of a recorded training command line."""
    for index, arg in enumerate(argv):
        if arg == "--profile" and index + 1 < len(argv):
            return argv[index + 1]
        if arg.startswith("--profile="):
            return arg.split("=", 1)[1]
    return None


def default_stages_path(options: ChainOptions) -> Path | None:
    if options.stages_path is not None:
        return options.stages_path
    job_dir = os.environ.get("EAGLE3_JOB_DIR")
    return Path(job_dir) / STAGES_FILENAME if job_dir else None


def acceptance_summary(acceptance: Any, val_acc: Any) -> dict[str, Any] | None:
    """The canary's acceptance report as saved with the result: both definitions, per position, the first break."""
    if not isinstance(acceptance, dict) or not acceptance:
        return None
    keys = (
        "pooled",
        "pooled_label",
        "mean_of_request_means",
        "mean_of_request_means_label",
        "sum_verify_ct",
        "per_position",
        "val_acc",
        "tau_hat",
        "accept_replayed",
        "prediction_label",
        "break",
        "break_line",
        "tolerance",
        "notes",
    )
    summary = {k: acceptance.get(k) for k in keys}
    if summary["val_acc"] is None and isinstance(val_acc, list):
        summary["val_acc"] = val_acc
    return summary


def throughput_row(level: dict[str, Any]) -> dict[str, Any]:
    keys = ("concurrency", "output_tok_per_s", "accept_length", "accept_length_mean_of_request_means")
    return {key: level.get(key) for key in keys}


def speedup_row(comparison: dict[str, Any] | None) -> dict[str, Any]:
    """A level's comparison with plain decoding in the same engine, for the result screen (empty without one)."""
    if not comparison:
        return {}
    keys = ("baseline_output_tok_per_s", "speedup", "ttft_p50_s", "baseline_ttft_p50_s", "itl_p50_s", "baseline_itl_p50_s", "exact_lengths")
    return {**{key: comparison.get(key) for key in keys}, "outputs_equal": comparison.get("outputs_equal")}


class StopAndBench:
    """The chain, one method per stage; run() drives them and turns exceptions into a failed stage."""

    def __init__(self, options: ChainOptions, on_stage: Callable[[dict[str, Any]], None] | None = None):

        self.options = options
        self.registry = JobRegistry(options.run_dir)
        self.reporter = StageReporter(default_stages_path(options), on_stage)
        self.summary: dict[str, Any] = {"job": options.job, "started_at": time.time(), "stages": {}}
        self.server_job: str | None = None
        self._profile: Profile | None = None

    @property
    def profile(self) -> Profile:
        """The training job's profile, loaded by the stop stage that every later stage follows."""
        if self._profile is None:
            raise ChainFailed("no profile loaded: the stop stage has not run")
        return self._profile

    @profile.setter
    def profile(self, value: Profile) -> None:
        self._profile = value

    @functools.cached_property
    def prompt_fit(self) -> PromptFit | None:
        """What the launched server admits (GET /v1/models), asked once for the canary and the bench."""
        from backend.serve.prompts import served_prompt_fit

        return served_prompt_fit(self.summary["url"], self.options.max_new_tokens)

    # ------------------------------------------------------------------ driver
    def run(self) -> dict[str, Any]:
        steps = [
            ("stop", self.stop_training),
            ("release", self.confirm_release),
            ("checkpoint", self.pick_checkpoint),
            ("preflight", self.preflight),
            ("launch", self.launch),
            ("canary", self.canary),
            ("bench", self.bench),
            ("result", self.save_result),
        ]
        for stage, step in steps:
            self.reporter.emit(stage, "running")
            try:
                detail, result = step()
            except ChainFailed as exc:
                self._fail(stage, str(exc))
                return self.summary
            except Exception as exc:  # an unexpected error still ends the chain cleanly, with its cause
                self._fail(stage, f"{type(exc).__name__}: {exc}")
                return self.summary
            self.summary["stages"][stage] = {"status": "ok", "detail": detail}
            self.reporter.emit(stage, "ok", detail, result)
        self.summary["ok"] = True
        return self.summary

    def _fail(self, stage: str, reason: str) -> None:
        cleanup = self._cleanup_after_failure(stage)
        detail = reason + (f" {cleanup}" if cleanup else "")
        self.summary["stages"][stage] = {"status": "failed", "detail": detail}
        self.summary.update(ok=False, failed_stage=stage, reason=detail)
        self.reporter.emit(stage, "failed", detail)
        for later in CHAIN_STAGES[CHAIN_STAGES.index(stage) + 1 :]:
            self.reporter.emit(later, "skipped", f"not run: {stage} failed")

    def _cleanup_after_failure(self, stage: str) -> str:
        """A server this chain started is stopped on failure, unless the operator keeps it (red canary only)."""
        if not self.server_job:
            return ""
        if stage == "canary" and self.options.keep_on_red:
            return f"The server job {self.server_job!r} was kept running, as asked (--keep-on-red)."
        verdicts = self.registry.stop([self.server_job], grace=15.0)
        outcomes = sorted({v.outcome for v in verdicts})
        return f"The server job {self.server_job!r} this chain started was stopped ({', '.join(outcomes) or 'already gone'})."

    # ------------------------------------------------------------------ stages
    def stop_training(self) -> tuple[str, Any]:
        from backend.profiles import load_profile

        try:
            record = self.registry.get(self.options.job)
        except JobNotFound:
            raise ChainFailed(f"no job named {self.options.job!r} in {self.options.run_dir}; nothing was stopped") from None
        info = record.info
        self.summary["train_job_dir"] = info.job_dir
        profile_name = self.options.profile or profile_from_argv(info.argv)
        if not profile_name:
            raise ChainFailed(f"job {info.name!r} has no --profile in its command line ({shlex.join(info.argv)}); pass --profile. Nothing was stopped.")
        self.profile = load_profile(profile_name)
        self.summary["profile"] = self.profile.name
        if info.state != "running":
            return f"job {info.name!r} was not running ({info.state}); using its last checkpoint", {"state": info.state}
        plan = self.registry.stop_plan([info.name])
        verdicts = self.registry.stop([info.name], grace=self.options.grace_s, gpu_source=self._gpu_source())
        survivors = [v for v in verdicts if v.outcome == "survived"]
        stale = [v for v in verdicts if v.outcome == "stale_not_signalled"]
        result = {"verdicts": [vars(v) for v in verdicts], "planned_pids": [t["pid"] for t in plan.will_signal]}
        if survivors or stale:
            raise ChainFailed(f"stop of {info.name!r} did not finish cleanly: " + "; ".join(f"pid {v.pid} {v.outcome} ({v.detail})" for v in survivors + stale))
        leader = next((v for v in verdicts if v.role == "leader"), None)
        how = leader.outcome if leader else "stopped"
        return f"stopped {info.name!r}: {len(verdicts)} process(es), leader {how}", result

    def confirm_release(self) -> tuple[str, Any]:

        source = self._gpu_source()
        try:
            report = list_holders(source, owner_lookup=self.registry.owned_pids)
        finally:
            getattr(source, "close", lambda: None)()
        owned = [h for h in report.holders if h.owned]
        foreign = [{"pid": h.pid, "user": h.user, "cmdline": h.cmdline, "used_memory_mib": h.used_memory_mib} for h in report.holders if not h.owned]
        self.summary["foreign_gpu_holders"] = foreign
        if owned:
            raise ChainFailed(
                "GPU memory is still held by processes of our jobs: " + ", ".join(f"pid {h.pid} ({h.job})" for h in owned) + ". Nothing was launched."
            )
        if report.gpu_source == "none":
            detail = "no NVIDIA driver on this host: no GPU memory to release"
        else:
            detail = f"our GPU memory is released; {len(foreign)} foreign holder(s) left untouched"
        return detail, {"gpu_source": report.gpu_source, "foreign": foreign}

    def pick_checkpoint(self) -> tuple[str, Any]:

        job_dir = Path(self.summary["train_job_dir"])
        checkpoints = job_dir / "checkpoints"
        if not (checkpoints / "latest").exists():
            raise ChainFailed(f"no complete checkpoint under {checkpoints} (no 'latest' pointer); nothing was launched")
        path = resolve_draft_dir(checkpoints)
        val_acc, val_rounds = checkpoint_validation(path)
        self.summary.update(checkpoint=str(path), val_acc=val_acc, val_rounds=val_rounds)
        return f"latest checkpoint {path.name}", {"path": str(path), "val_acc": val_acc, "val_rounds": val_rounds}

    def preflight(self) -> tuple[str, Any]:
        from backend.serve.launch import target_config_for
        from backend.serve.sglang_args import build_sglang_argv

        checkpoint = self.summary["checkpoint"]
        argv = build_sglang_argv(self.profile, checkpoint, port=self.options.port or self.profile.serve.port)
        report = run_preflight(checkpoint, target_config_for(self.profile), serving_argv=argv)
        self.summary["preflight"] = report.to_dict()
        if not report.ok:
            problems = "; ".join(f"{p.code}: {p.message}" for p in report.problems)
            raise ChainFailed(f"preflight refused {Path(checkpoint).name}: {problems}. Nothing was launched.")
        return "no problems", report.to_dict()

    def launch(self) -> tuple[str, Any]:
        from backend.serve.launch import launch

        engine = self.options.engine or self.profile.serve.engine
        name = f"serve-{self.options.job}"
        self.summary["engine"] = engine
        result = launch(
            self.profile, self.summary["checkpoint"], engine=engine, port=self.options.port, run_dir=self.options.run_dir, job_name=name, run_canary=False
        )
        if result.job_name:
            self.server_job = result.job_name
        self.summary.update(server_job=result.job_name, url=result.url, argv=result.argv, server_info=result.server_info)
        if result.state != "ready":
            tail = "\n".join(result.log_tail[-10:])
            raise ChainFailed(f"{result.message}" + (f"\nlast log lines:\n{tail}" if tail else ""))
        if result.server_check:
            raise ChainFailed(f"server runs other settings than asked: {'; '.join(result.server_check)}")
        return f"{engine} ready at {result.url} as job {result.job_name!r} in {result.timings.get('ready_s', 0):.1f}s", {
            "url": result.url,
            "job": result.job_name,
            "argv": result.argv,
        }

    def canary(self) -> tuple[str, Any]:
        from backend.serve import canary as canary_mod
        from backend.serve.launch import draft_canary_prompts

        info = self.summary.get("server_info") or {}
        steps = int(info.get("speculative_num_steps") or self.profile.serve.num_steps)
        prompts, prompt_source = draft_canary_prompts(self.profile, self.summary["checkpoint"], fit=self.prompt_fit)
        outcome = canary_mod.run_canary(
            self.summary["url"],
            prompts,
            prompt_source=prompt_source,
            num_steps=steps,
            val_acc=self.summary.get("val_acc"),
            max_new_tokens=self.options.max_new_tokens,
            val_rounds=self.summary.get("val_rounds"),
        )
        canary = outcome.to_dict()
        canary.pop("requests", None)
        self.summary["canary"] = canary
        if outcome.verdict not in (canary_mod.GREEN, canary_mod.AMBER):
            causes = "; ".join(c.get("cause", str(c)) if isinstance(c, dict) else str(c) for c in outcome.causes[:3])
            raise ChainFailed(f"canary RED: {outcome.headline}. Likely causes, in order: {causes}. Its prompts: {prompt_source}.")
        return f"{outcome.verdict}: {outcome.headline}", canary

    def bench(self) -> tuple[str, Any]:
        """The benchmark; where the server decodes plainly on request (the reference engine), against that same engine."""
        import asyncio

        from backend.bench import client, results

        from backend.serve.launch import draft_bench_prompts

        url = self.summary["url"]
        prompts, source = draft_bench_prompts(self.profile, self.summary.get("checkpoint"), self.options.num_prompts, fit=self.prompt_fit)
        self.summary["bench_prompts"] = source
        info = asyncio.run(client.fetch_server_info(url))
        baseline = client.resolve_baseline(None, info)
        levels, plain_levels = asyncio.run(client.measure_set(url, baseline, prompts, self.options.concurrency, self.options.max_new_tokens))
        rows = [level.to_dict() for level in levels]
        self.summary["bench"] = rows
        self.summary["bench_loops"] = results.loop_lines(rows)
        self.summary["bench_baseline"] = {
            "mode": baseline.mode,
            "ignore_eos": baseline.measured,
            "levels": [level.to_dict() for level in plain_levels],
            "comparison": results.compare(levels, plain_levels, self.options.max_new_tokens),
        }
        failed = sum(row.get("failed", 0) for row in rows)
        if failed == sum(row.get("requests", 0) for row in rows):
            raise ChainFailed(f"every benchmark request failed: {rows[0].get('errors', [])[:1]}")
        best = max(rows, key=lambda row: row.get("output_tok_per_s") or 0)
        detail = f"{best.get('output_tok_per_s') or 0:.1f} tok/s at concurrency {best.get('concurrency')}, accept length {best.get('accept_length') or 0:.2f}"
        first = next(iter(self.summary["bench_baseline"]["comparison"]), None)
        if first is not None and first["speedup"] is not None:
            detail += f", {first['speedup']:.2f}x plain decoding in the same engine at concurrency {first['concurrency']}"
        return f"{detail}; prompts: {source}", rows

    def save_result(self) -> tuple[str, Any]:
        result = self.result_panel()
        directory = Path(self.summary["train_job_dir"]) / RESULTS_DIRNAME
        directory.mkdir(parents=True, exist_ok=True)
        path = directory / f"stop-and-bench-{time.strftime('%Y%m%d-%H%M%S')}.json"
        write_atomic(path, json.dumps({**self.summary, "result": result}, indent=1, default=str))
        self.summary["result"] = result
        self.summary["saved_to"] = str(path)
        if self.options.stop_server_after and self.server_job:
            self.registry.stop([self.server_job], grace=15.0)
            result["server"] = "stopped after the benchmark (--stop-server-after)"
        return f"saved {path}", result

    # ------------------------------------------------------------------ helpers
    def result_panel(self) -> dict[str, Any]:
        canary = self.summary.get("canary") or {}
        rows = self.summary.get("bench") or []
        baseline = self.summary.get("bench_baseline") or {}
        speedups = {row["concurrency"]: row for row in baseline.get("comparison") or []}
        return {
            "verdict": canary.get("verdict"),
            "verdict_headline": canary.get("headline"),
            "verdict_reasons": canary.get("reasons") or [],
            "accept_length": canary.get("accept_length"),  # pooled over verify steps (SGLang, vLLM)
            "accept_length_mean_of_request_means": canary.get("accept_length_mean_of_request_means"),  # SpecForge
            "tau_hat": canary.get("tau_hat"),
            "ratio_to_tau_hat": canary.get("ratio_to_tau_hat"),
            # the canary's served acceptance per draft position next to val acc_k, and the first break
            "acceptance": acceptance_summary(canary.get("acceptance"), self.summary.get("val_acc")),
            "throughput": [{**throughput_row(r), **speedup_row(speedups.get(r.get("concurrency")))} for r in rows],
            # "same-engine": every row also holds the plain decode of the same prompts (ignore_eos) and the speed-up
            "speedup_baseline": baseline.get("mode"),
            "speedup_c1": (speedups.get(1) or {}).get("speedup"),
            "bench_prompts": self.summary.get("bench_prompts"),  # what the throughput rows asked (draft_bench_prompts)
            "bench_loops": self.summary.get("bench_loops") or [],  # a warning when the answers loop (accept length counts them)
            "checkpoint": self.summary.get("checkpoint"),
            "engine": self.summary.get("engine"),
            "argv": self.summary.get("argv"),
            "server_job": self.server_job,
            "server": "running" if self.server_job else None,
        }

    @staticmethod
    def _gpu_source():

        return open_gpu_source(stream=False)
