"""Stop-and-benchmark, headless: a real tiny training job is stopped with a checkpoint, served, canaried, benchmarked."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from backend.commands import CHAIN_STAGES
from backend.chain.run import ChainOptions, StopAndBench, profile_from_argv
from backend.layout import METRICS_FILENAME, STAGES_FILENAME, list_results
from backend.jobs.registry import JobRegistry
from tests.fixtures.env import ROOT, subprocess_env


def run_chain(run_dir: Path, job: str, *extra: str, timeout: float = 600) -> tuple[int, list[dict]]:
    argv = [sys.executable, "-m", "backend", "stop-and-bench", "--run-dir", str(run_dir), "--job", job, "--json", *extra]
    done = subprocess.run(argv, cwd=ROOT, env=subprocess_env(), capture_output=True, text=True, timeout=timeout)
    lines = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    return done.returncode, lines


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"


def test_profile_is_read_from_the_recorded_command_line():
    assert profile_from_argv(["python", "-m", "backend", "train", "--profile", "tiny"]) == "tiny"
    assert profile_from_argv(["x", "--profile=kimi-k2.5"]) == "kimi-k2.5"
    assert profile_from_argv(["x", "--profile"]) is None


def test_unknown_job_stops_the_chain_before_anything_is_touched(tmp_path):
    stages_file = tmp_path / "stages.jsonl"
    code, lines = run_chain(tmp_path / "run", "no-such-job", "--stages-file", str(stages_file))
    assert code == 1
    summary = lines[-1]
    assert summary["type"] == "summary" and summary["ok"] is False and summary["failed_stage"] == "stop"
    assert "no job named 'no-such-job'" in summary["reason"]
    recorded = [json.loads(line) for line in stages_file.read_text().splitlines()]
    final = {r["stage"]: r["status"] for r in recorded}
    assert final == {"stop": "failed", **{stage: "skipped" for stage in CHAIN_STAGES[1:]}}


def test_a_finished_job_without_checkpoint_launches_nothing(tmp_path):
    registry = JobRegistry(tmp_path)
    registry.start_job("short", "train", [sys.executable, "-c", "pass", "--profile", "tiny"])
    deadline = time.monotonic() + 30
    while registry.get("short").info.state == "running" and time.monotonic() < deadline:
        time.sleep(0.1)
    code, lines = run_chain(tmp_path, "short")
    summary = lines[-1]
    assert code == 1 and summary["failed_stage"] == "checkpoint", summary
    assert "no complete checkpoint" in summary["reason"]
    assert [job.name for job in registry.list_jobs()] == ["short"], "no server job may have been started"


# --- the canary stage's verdicts, with every other stage stubbed (no process, no server) ------------------------


def stubbed_chain(tmp_path: Path, monkeypatch, accept_length: float, val_acc: list[float]) -> tuple[StopAndBench, list]:
    """A chain whose stages before the canary only fill the summary; the canary judges `accept_length` for real."""
    from backend.profiles import load_profile
    from backend.serve import canary as canary_mod
    from backend.serve import launch as launch_mod
    from backend.serve.acceptance import tau_hat

    chain = StopAndBench(ChainOptions(job="train-x", run_dir=tmp_path / "run", stages_path=tmp_path / STAGES_FILENAME))
    chain.profile = load_profile("tiny")
    stopped: list = []
    monkeypatch.setattr(chain.registry, "stop", lambda names, **_: stopped.append(list(names)) or [])
    monkeypatch.setattr(launch_mod, "shipped_prompts", lambda profile, count, tag=None: (["prompt"] * count, "stub prompts"))
    monkeypatch.setattr(
        canary_mod,
        "run_canary",
        lambda url, prompts, *, num_steps, val_acc, **_: judged_canary(canary_mod, accept_length, tau_hat(val_acc, num_steps)),
    )

    def launched():
        chain.server_job = "serve-train-x"
        chain.summary.update(url="http://127.0.0.1:9", server_info={"speculative_num_steps": 5})
        return "ready", None

    chain.stop_training = lambda: (chain.summary.update(train_job_dir=str(tmp_path / "job")), ("stopped", None))[1]
    chain.confirm_release = lambda: ("released", None)
    chain.pick_checkpoint = lambda: (chain.summary.update(checkpoint=str(tmp_path / "ckpt"), val_acc=val_acc), ("ckpt", None))[1]
    chain.preflight = lambda: ("no problems", None)
    chain.launch = launched
    chain.bench = lambda: (chain.summary.update(bench=[{"concurrency": 1, "output_tok_per_s": 10.0}]), ("10 tok/s", None))[1]
    return chain, stopped


def judged_canary(canary_mod, accept_length: float, tau: float | None):
    verify = 200
    verdict, headline, reasons, causes = canary_mod.judge(
        accept_length=accept_length, requests=4, sum_verify_ct=verify, tau=tau, features={}, server_info={"speculative_algorithm": "EAGLE3"}
    )
    return canary_mod.CanaryResult(
        verdict=verdict,
        headline=headline,
        reasons=reasons,
        causes=causes,
        accept_length=accept_length,
        server_avg_accept_length=accept_length,
        tau_hat=tau,
        ratio_to_tau_hat=accept_length / tau if tau else None,
        threshold_ratio=canary_mod.REPRODUCE_RATIO,
        zero_acceptance_ceiling=canary_mod.zero_acceptance_ceiling(4, verify),
        num_steps=5,
        sum_completion_tokens=round(accept_length * verify),
        sum_verify_ct=verify,
        features={},
    )


def stage_records(tmp_path: Path) -> dict[str, dict]:
    return {r["stage"]: r for r in map(json.loads, (tmp_path / STAGES_FILENAME).read_text().splitlines())}


def test_an_amber_canary_keeps_the_server_runs_the_bench_and_reports_amber(tmp_path, monkeypatch):
    chain, stopped = stubbed_chain(tmp_path, monkeypatch, accept_length=1.41, val_acc=[0.002] * 7)  # issue 12's 13-step draft
    summary = chain.run()
    assert summary["ok"] is True and stopped == [], "amber must not stop the server the way red does"
    canary = stage_records(tmp_path)["canary"]
    assert canary["status"] == "ok" and canary["detail"].startswith("amber: inconclusive: the draft has not learned yet")
    assert canary["result"]["verdict"] == "amber" and canary["result"]["reasons"]
    assert stage_records(tmp_path)["bench"]["status"] == "ok"
    result = summary["result"]
    assert result["verdict"] == "amber" and result["verdict_headline"].startswith("inconclusive")
    assert result["server"] == "running" and list_results(tmp_path / "job")[0]["verdict"] == "amber"


def test_a_green_canary_says_green_and_a_red_one_stops_the_server(tmp_path, monkeypatch):
    green, _ = stubbed_chain(tmp_path / "g", monkeypatch, accept_length=3.6, val_acc=[0.825] * 7)
    assert green.run()["result"]["verdict"] == "green"
    assert stage_records(tmp_path / "g")["canary"]["detail"].startswith("green: accept length 3.60")
    red, stopped = stubbed_chain(tmp_path / "r", monkeypatch, accept_length=1.44, val_acc=[0.825] * 7)
    summary = red.run()
    assert summary["ok"] is False and summary["failed_stage"] == "canary" and summary["reason"].startswith("canary RED")
    assert "Its prompts: stub prompts" in summary["reason"]  # the red line says what was asked
    assert stopped == [["serve-train-x"]] and stage_records(tmp_path / "r")["bench"]["status"] == "skipped"


def wait_for_training(job_dir: Path, after_step: int, timeout: float = 300) -> None:
    metrics = job_dir / METRICS_FILENAME
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if metrics.exists():
            steps = [json.loads(line).get("step", 0) for line in metrics.read_text().splitlines() if line.strip()]
            if steps and max(steps) > after_step:
                return
        time.sleep(0.5)
    raise AssertionError(f"training never got past step {after_step}: {job_dir}")


@pytest.mark.slow
def test_stop_and_bench_end_to_end_on_tiny(trained_tiny_run, tmp_path):
    run_dir = tmp_path / "run"
    registry = JobRegistry(run_dir)
    checkpoint = trained_tiny_run / "checkpoints" / (trained_tiny_run / "checkpoints" / "latest").read_text().strip()
    argv = [
        "eagle3-host",
        "train",
        "--profile",
        "tiny",
        "--resume",
        str(checkpoint),
        "--max-steps",
        "100000",
        "--save-interval",
        "100000",
        "--eval-interval",
        "100000",
    ]
    job = registry.start_job("train-demo", "train", argv, env={"OMP_NUM_THREADS": "1"})
    wait_for_training(Path(job.job_dir), after_step=300)

    code, lines = run_chain(run_dir, "train-demo", "--stop-server-after", "--concurrency", "1", "--num-prompts", "3")
    summary = lines[-1]
    stages = {r["stage"]: r for r in lines if r.get("status") in ("ok", "failed")}
    assert code == 0, json.dumps(summary, indent=1, default=str)[-3000:]
    assert [s for s in CHAIN_STAGES if stages[s]["status"] == "ok"] == list(CHAIN_STAGES)

    result = summary["result"]
    assert result["verdict"] == "green"
    assert result["accept_length"] > 1.5
    assert result["tau_hat"] is not None and result["ratio_to_tau_hat"] > 0.6
    assert result["throughput"][0]["output_tok_per_s"] > 0
    new_checkpoint = Path(result["checkpoint"])
    assert new_checkpoint.parent == Path(job.job_dir) / "checkpoints", "served the checkpoint written at the stop"
    assert int(new_checkpoint.name.split("_step_")[1]) > 300

    saved = list_results(job.job_dir)
    assert len(saved) == 1 and saved[0]["verdict"] == "green"
    assert (Path(job.job_dir) / "results").is_dir()

    jobs = {info.name: info for info in registry.list_jobs()}
    assert set(jobs) == {"train-demo", "serve-train-demo"}
    assert all(info.state != "running" for info in jobs.values()), {n: i.state for n, i in jobs.items()}
    assert not any(alive(info.pid) for info in jobs.values()), "a process of the run was left behind"


def test_the_saved_result_carries_per_position_acceptance_and_the_first_break(tmp_path, monkeypatch):
    from backend.serve import canary as canary_mod
    from backend.serve.acceptance import acceptance_report

    chain, _ = stubbed_chain(tmp_path, monkeypatch, accept_length=3.6, val_acc=[0.825] * 7)
    real = canary_mod.run_canary

    def with_histogram(url, prompts, *, num_steps, val_acc, **kw):
        outcome = real(url, prompts, num_steps=num_steps, val_acc=val_acc, **kw)  # the stub: a judged accept length
        # 200 steps: positions 0-1 as validation predicts, position 2 collapses
        outcome.acceptance = acceptance_report([(720, 200, [35, 29, 110, 26])], num_steps, val_acc)
        outcome.accept_length_mean_of_request_means = outcome.acceptance["mean_of_request_means"]
        return outcome

    monkeypatch.setattr(canary_mod, "run_canary", with_histogram)
    summary = chain.run()
    result = summary["result"]
    acceptance = result["acceptance"]
    assert acceptance["break"]["position"] == 2 and acceptance["break_line"].startswith("served acceptance breaks at position 2")
    assert acceptance["val_acc"] == [0.825] * 7 and len(acceptance["per_position"]) == 5
    assert "pooled over verify steps" in acceptance["pooled_label"] and "SpecForge" in acceptance["mean_of_request_means_label"]
    assert result["accept_length_mean_of_request_means"] == pytest.approx(3.6)
    assert list_results(tmp_path / "job")[0]["acceptance"]["break"]["position"] == 2


def test_a_result_without_histogram_has_no_positions_and_does_not_fail(tmp_path, monkeypatch):
    chain, _ = stubbed_chain(tmp_path, monkeypatch, accept_length=3.6, val_acc=[0.825] * 7)
    summary = chain.run()
    assert summary["ok"] is True and summary["result"]["acceptance"] is None


# --- the bench stage against a real speculative mini reference server ------------------------------------------


def test_the_bench_stage_measures_plain_decoding_in_the_same_engine(tmp_path, mini_servers, mini_profile):
    chain = StopAndBench(ChainOptions(job="train-x", run_dir=tmp_path / "run", concurrency=[1, 2], num_prompts=2, max_new_tokens=12))
    chain.profile = mini_profile
    chain.summary["url"] = mini_servers["spec"].url
    detail, rows = chain.bench()
    assert "x plain decoding in the same engine at concurrency 1" in detail
    baseline = chain.summary["bench_baseline"]
    assert baseline["mode"] == "same-engine" and baseline["ignore_eos"] is True and len(baseline["levels"]) == 2
    assert all(row["output_tokens"] == 2 * 12 for row in rows + baseline["levels"]), "ignore_eos: exactly max_new_tokens per prompt"
    panel = chain.result_panel()
    assert panel["speedup_baseline"] == "same-engine" and panel["speedup_c1"] == panel["throughput"][0]["speedup"] > 0
    shares = [row["repeated_word_share"] for row in rows]
    assert all(0 <= share <= 1 for share in shares) and (panel["bench_loops"] != []) == (max(shares) >= 0.2)
    # no checkpoint recording its data, a target without a chat template: the shipped set as it is, and the panel says so
    assert panel["bench_prompts"].startswith("the shipped prompts, raw (no chat template") and detail.endswith(f"; prompts: {panel['bench_prompts']}")
    for row in panel["throughput"]:
        assert row["baseline_output_tok_per_s"] > 0 and row["speedup"] == pytest.approx(row["output_tok_per_s"] / row["baseline_output_tok_per_s"])
        assert row["exact_lengths"] is True and row["outputs_equal"]["equal"] == row["outputs_equal"]["compared"] == 2
        assert row["ttft_p50_s"] > 0 and row["baseline_ttft_p50_s"] > 0 and row["itl_p50_s"] > 0 and row["baseline_itl_p50_s"] > 0


def test_the_bench_stage_against_a_plain_server_has_no_speedup(tmp_path, mini_servers, mini_profile):
    chain = StopAndBench(ChainOptions(job="train-x", run_dir=tmp_path / "run", concurrency=[1], num_prompts=1, max_new_tokens=8))
    chain.profile = mini_profile
    chain.summary["url"] = mini_servers["plain"].url
    detail, _rows = chain.bench()
    assert "plain decoding" not in detail and chain.summary["bench_baseline"]["levels"] == []
    panel = chain.result_panel()
    assert panel["speedup_baseline"] == "none" and panel["speedup_c1"] is None and "speedup" not in panel["throughput"][0]
