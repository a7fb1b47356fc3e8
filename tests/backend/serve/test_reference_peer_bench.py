"""SGLang's own bench_serving completes against the reference server (benchmarks/peer_bench_serving.sh, end to end).

Slow: the script builds (or reuses) a side venv with SGLang 0.5.23 from PyPI (~6 GB the first time: its import chain
reaches torchvision, whose PyPI wheel needs the CUDA torch), starts the tiny reference server with the trained tiny
draft, and runs bench_serving with its default benchmark flags. Because of that download it runs where the side venv
already exists or EAGLE3_PEER_BENCH=1 asks for it (the result of the last run is benchmarks/results/
peer_bench_serving_cpu.json); it is skipped when the side venv cannot be built (the script's exit 3: no package registry).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
from pathlib import Path

import pytest

from tests.fixtures.env import ROOT, subprocess_env

CONVERSATIONS = 6


def side_venv() -> Path:
    cache = Path(os.environ.get("EAGLE3_CACHE_DIR") or Path(os.environ.get("XDG_CACHE_HOME") or "~/.cache").expanduser() / "eagle3-console")
    return Path(os.environ.get("PEER_SGLANG_VENV") or cache / "peer-sglang")


@pytest.mark.slow
@pytest.mark.skipif(
    not (os.environ.get("EAGLE3_PEER_BENCH") == "1" or (side_venv() / "bin" / "python").exists()),
    reason="SGLang's side venv is a ~6 GB download: set EAGLE3_PEER_BENCH=1 to build it and run bench_serving "
    "(last result: benchmarks/results/peer_bench_serving_cpu.json)",
)
def test_sglang_bench_serving_completes_against_the_reference_server(tmp_path, trained_tiny_run):
    out = tmp_path / "peer_bench_serving.json"
    done = subprocess.run(
        [
            "bash",
            str(ROOT / "benchmarks" / "peer_bench_serving.sh"),
            "--draft",
            str(trained_tiny_run),
            "--conversations",
            str(CONVERSATIONS),
            "--out",
            str(out),
        ],
        cwd=ROOT,
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=3000,
    )
    if done.returncode == 3:
        pytest.skip(f"the side venv with sglang could not be built here: {done.stderr[-600:]}")
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    document = json.loads(out.read_text())
    result = document["result"]
    assert document["sglang_version"] == "0.5.23" and result["backend"] == "sglang" and result["dataset_name"] == "sharegpt"
    assert result["completed"] == CONVERSATIONS and math.isinf(result["request_rate"])  # the default: all at once
    # ignore_eos (bench_serving's default) is honoured: every request produced exactly the tokens it asked for
    assert result["total_output_tokens"] == document["dataset"]["output_tokens_asked"] > 0
    assert result["accept_length"] is not None and result["accept_length"] > 1.2  # the trained draft is accepted
    assert result["server_info"]["speculative_algorithm"] == "EAGLE3"
    assert f"{CONVERSATIONS}/{CONVERSATIONS} requests completed" in done.stdout
