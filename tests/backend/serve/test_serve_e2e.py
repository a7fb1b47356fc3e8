"""End to end: preflight -> owned server job -> health -> server info -> canary verdict, through the reference engine."""

import json
import os
import shutil
import subprocess
import sys

import pytest
from safetensors.torch import load_file, save_file

from backend.jobs.registry import JobRegistry
from backend.serve.launch import launch
from backend.serve.preflight import resolve_draft_dir
from tests.fixtures.env import ROOT


THREADS = {"OMP_NUM_THREADS": os.environ.get("EAGLE3_TEST_THREADS", "1")}


def run_launch(tmp_path, profile, draft, name, **kwargs):
    run_dir = tmp_path / "run"
    result = launch(profile, draft, engine="reference", run_dir=run_dir, job_name=name, env=THREADS, log=lambda line: None, **kwargs)
    registry = JobRegistry(run_dir)
    return result, registry


@pytest.mark.slow
def test_good_draft_is_green(tmp_path, tiny_profile, trained_tiny_run):
    result, registry = run_launch(tmp_path, tiny_profile, trained_tiny_run, "good")
    try:
        assert result.state == "ready" and result.preflight["ok"], result.to_dict()
        assert result.server_info["speculative_algorithm"] == "EAGLE3" and result.server_check == []
        assert result.verdict == "green", result.canary
        assert result.ok and result.causes == []
        canary = result.canary
        assert canary["accept_length"] > 1.5
        assert canary["server_avg_accept_length"] > 1.5
        assert canary["tau_hat"] is not None and canary["ratio_to_tau_hat"] >= canary["threshold_ratio"]
        assert canary["features"]["feature_width"] == canary["features"]["expected_feature_width"] == 384
        assert {"preflight_s", "ready_s", "canary_s"} <= set(result.timings)
        environ = open(f"/proc/{result.job['pid']}/environ", "rb").read().split(b"\0")
        assert b"PYTHONSAFEPATH=1" in environ  # the server imports nothing planted in its cwd
        json.dumps(result.to_dict())  # JSON-able as promised
        print(f"\ngood feed: accept {canary['accept_length']:.3f}, tau-hat {canary['tau_hat']:.3f}, ratio {canary['ratio_to_tau_hat']:.3f}")
    finally:
        registry.stop(["good"], grace=15)


@pytest.mark.slow
def test_sglang_style_feed_is_red(tmp_path, tiny_profile, trained_tiny_run):
    """--feed last_hidden: the final hidden state replaces the 3 aux layers and fc is skipped, as in SGLang's failure."""
    result, registry = run_launch(tmp_path, tiny_profile, trained_tiny_run, "broken", feed="last_hidden")
    try:
        assert result.state == "ready", result.to_dict()
        assert result.verdict == "red" and not result.ok
        reasons = result.canary["reasons"]
        assert any(r.startswith("draft receives the wrong features") for r in reasons), reasons
        assert any(r.startswith("serving does not reproduce training") for r in reasons), reasons
        assert result.causes[0]["id"] == "feature_feed"
        assert result.canary["features"]["fc_applied"] is False
        assert result.canary["features"]["feature_width"] == 128
        assert "still running" in result.message
        print(
            f"\nlast_hidden feed: accept {result.canary['accept_length']:.3f}, "
            f"tau-hat {result.canary['tau_hat']:.3f}, ratio {result.canary['ratio_to_tau_hat']:.3f}"
        )
    finally:
        registry.stop(["broken"], grace=15)


def layers0_copy(run, destination):
    shutil.copytree(resolve_draft_dir(run), destination)
    tensors = load_file(str(destination / "model.safetensors"))
    save_file({k.replace("midlayer.", "layers.0."): v for k, v in tensors.items()}, str(destination / "model.safetensors"))
    return destination


@pytest.mark.slow
def test_launch_refuses_on_preflight_problems(tmp_path, tiny_profile, trained_tiny_run):
    draft = layers0_copy(trained_tiny_run, tmp_path / "layers0")
    result, registry = run_launch(tmp_path, tiny_profile, draft, "refused")
    assert result.state == "refused" and not result.ok
    assert "key_prefix" in result.message and "NOT started" in result.message
    assert result.job_name is None and registry.list_jobs() == []


@pytest.mark.slow
def test_server_that_dies_is_reported_with_exit_code_and_log(tmp_path, tiny_profile, trained_tiny_run):
    draft = tmp_path / "truncated"
    shutil.copytree(resolve_draft_dir(trained_tiny_run), draft)
    weights = draft / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    result, registry = run_launch(tmp_path, tiny_profile, draft, "dies", force=True)
    assert result.forced and "corrupt" in [p["code"] for p in result.preflight["problems"]]
    assert result.state == "exited" and result.verdict is None and not result.ok
    assert "exited with code 1" in result.message
    assert any("loading failed" in line for line in result.log_tail)
    assert result.gpu_release["checked"] in (True, False) and result.gpu_release["note"]
    assert registry.get("dies").info.state == "exited"


@pytest.mark.slow
def test_serve_dry_run_prints_argv_and_preflight(tmp_path, tiny_profile, trained_tiny_run):
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "backend",
            "serve",
            "--profile",
            "tiny",
            "--draft",
            str(trained_tiny_run),
            "--engine",
            "reference",
            "--dry-run",
            "--run-dir",
            str(tmp_path / "run"),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    body = json.loads(out.stdout)
    assert body["argv"][1:3] == ["-m", "backend.serve.reference.server"]
    assert body["preflight"]["ok"] is True
    assert not (tmp_path / "run" / "jobs.db").exists()  # nothing started
    out = subprocess.run(
        [sys.executable, "-m", "backend", "serve", "--profile", "llama3.1-8b", "--draft", str(trained_tiny_run), "--dry-run"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    body = json.loads(out.stdout)
    assert out.returncode == 1 and body["argv"][1:3] == ["-m", "sglang.launch_server"]
    assert "fc_shape" in [p["code"] for p in body["preflight"]["problems"]]  # a tiny draft for an 8B target


def test_serve_baseline_dry_run_needs_no_draft(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "backend", "serve", "--profile", "llama3.1-8b", "--baseline", "--dry-run"], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    argv = json.loads(out.stdout)["argv"]
    assert argv[1:3] == ["-m", "sglang.launch_server"] and not [a for a in argv if a.startswith("--speculative")]
    out = subprocess.run([sys.executable, "-m", "backend", "serve", "--profile", "tiny"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "--draft is required" in out.stderr
