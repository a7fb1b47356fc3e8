"""`eagle3-host spec-settings`: the mini target and a saved draft, each setting replayed; bad input refused, nothing written."""

from __future__ import annotations

import json

import pytest
import torch

from backend.bench.spec_settings import SettingsError, encode_prompts, parse_settings
from backend.cli import main
from backend.profiles import load_profile
from backend.serve.acceptance import pooled_accept_length
from backend.serve.reference.spec_decode import NO_EOS, SpecDecoder
from backend.train.checkpoint import load_checkpoint
from backend.train.target import load_target
from tests.fixtures.reference import save_untrained_draft, write_mini_profile

pytestmark = pytest.mark.usefixtures("limited_torch_threads")

PROMPTS = ["def fibonacci(n):", "The quick brown fox", "import os\nimport sys\n"]


@pytest.fixture
def setup(tmp_path, mini_target_dir, mini_profile):
    profile = write_mini_profile(mini_target_dir, tmp_path / "mini.toml")
    draft = save_untrained_draft(mini_profile, tmp_path / "draft-run")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": p}) for p in PROMPTS) + "\n")
    return profile, draft, prompts


def argv(tmp_path, profile, draft, prompts, *extra) -> list[str]:
    return [
        "spec-settings",
        "--run-dir",
        str(tmp_path / "runs"),
        "--profile",
        str(profile),
        "--draft",
        str(draft),
        "--prompts",
        f"mini={prompts}",
        "--device",
        "cpu",
        *extra,
    ]


def test_each_setting_is_replayed_and_the_chain_is_what_the_decoder_serves(tmp_path, setup, capsys):
    profile_path, draft_dir, prompts = setup
    out = tmp_path / "settings.json"
    code = main(argv(tmp_path, profile_path, draft_dir, prompts, "--settings", "3,1 2,4,8", "--settings", "3,2,4", "--max-new-tokens", "20", "--out", str(out)))
    printed = capsys.readouterr().out
    assert code == 0 and torch.is_grad_enabled()  # in-process: the trainer's tests run after it in the same worker
    document = json.loads(out.read_text())
    row = document["sets"]["mini"]
    assert row["prompts"] == 3 and row["baseline"] == "3,1,4" and list(row["settings"]) == ["3,1,4", "2,4,8", "3,2,4"]
    assert row["source"]["count"] == 3 and document["max_new_tokens"] == 20 and document["ignore_eos"] is True
    for label, entry in row["settings"].items():
        low, high = entry["pooled_95"]
        assert low <= entry["pooled"] <= high and len(entry["per_request"]) == 3
        assert f"  {label:>9}  {entry['pooled']:.3f}" in printed
    assert row["settings"]["3,1,4"]["minus_baseline"] == 0.0 and row["settings"]["2,4,8"]["num_draft_tokens"] == 8
    assert f"saved {out}" in printed

    profile = load_profile(str(profile_path))
    target = load_target(profile, device=torch.device("cpu"), dtype="float32")
    draft, config, _, _ = load_checkpoint(draft_dir, target_embedding=target.embed_weight())
    decoder = SpecDecoder(target.model, draft.eval(), list(config.aux_layer_ids), num_steps=3, eos_token_id=NO_EOS)
    served = [decoder.generate(ids, 20) for ids in encode_prompts(target.tokenizer, PROMPTS, 1024)]
    assert row["settings"]["3,1,4"]["pooled"] == pytest.approx(pooled_accept_length([(r.completion_tokens, r.verify_ct) for r in served]))


@pytest.mark.parametrize(
    ("extra", "says"),
    [
        (["--settings", "3,1,6"], "at topk 1 SGLang verifies num_steps + 1 = 4 tokens"),
        (["--settings", "3,4,8 3,4,8"], "--settings repeats 3,4,8"),
        (["--max-new-tokens", "0"], "--max-new-tokens and --max-prompt-tokens must be at least 1"),
    ],
)
def test_settings_sglang_would_not_run_are_refused_in_one_line_and_nothing_is_written(tmp_path, setup, capsys, extra, says):
    profile, draft, prompts = setup
    assert main(argv(tmp_path, profile, draft, prompts, *extra)) == 2
    err = capsys.readouterr().err.strip()
    assert says in err and err.endswith("Nothing was measured.") and len(err.splitlines()) == 1
    assert not (tmp_path / "runs" / "benchmarks").exists()


def test_a_missing_draft_or_prompt_file_is_refused_in_one_line(tmp_path, setup, capsys):
    profile, draft, prompts = setup
    assert main(argv(tmp_path, profile, tmp_path / "no-such-draft", prompts)) == 2
    assert "Nothing was measured." in capsys.readouterr().err
    assert main(argv(tmp_path, profile, draft, tmp_path / "no-such.jsonl")) == 2
    err = capsys.readouterr().err.strip()
    assert "no-such.jsonl" in err and len(err.splitlines()) == 1
    assert not (tmp_path / "runs" / "benchmarks").exists()


def test_settings_read_space_separated_or_repeated():
    assert [s.label for s in parse_settings(["3,1 7,1", "3,4,8"])] == ["3,1,4", "7,1,8", "3,4,8"]
    with pytest.raises(SettingsError, match="names no setting"):
        parse_settings([" "])
