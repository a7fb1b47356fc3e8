"""A stop that arrives while the trainer is still setting up (building the tiny target) ends it at once, cleanly."""

import signal
import subprocess
import sys
import time

import pytest

from tests.fixtures.env import ROOT, subprocess_env


@pytest.mark.slow  # spawns `train --profile tiny`, which starts building the tiny target
def test_sigterm_during_the_tiny_target_build_exits_promptly_and_leaves_no_cache(tmp_path):
    cache = tmp_path / "cache"
    argv = [sys.executable, "-m", "backend", "train", "--profile", "tiny", "--out", str(tmp_path / "run")]
    proc = subprocess.Popen(argv, cwd=ROOT, env=subprocess_env(EAGLE3_CACHE_DIR=str(cache)), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while not any(cache.glob("*")) and time.monotonic() < deadline:  # the build has begun writing
        time.sleep(0.2)
    time.sleep(1.0)
    proc.send_signal(signal.SIGTERM)
    sent = time.monotonic()
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 0, stderr[-2000:]
    assert time.monotonic() - sent < 20, "a stop during setup must not wait for the build to finish"
    assert "during setup" in stderr
    assert not (tmp_path / "run" / "checkpoints" / "latest").exists()
    assert not [p for p in cache.rglob("config.json")], "no half-built target may be left as a cache entry"
