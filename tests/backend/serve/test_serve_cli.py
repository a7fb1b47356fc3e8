"""`eagle3-host serve` text output: the canary's acceptance lines (both accept-length definitions, per position) as in --json.

Fast: render() on a canary result built from hand-made histograms, and one real `serve` of the mini target with an
untrained draft through the reference engine (an owned job on 127.0.0.1, stopped at the end).
"""

from __future__ import annotations

import json

from backend.cli import main
from backend.jobs.registry import JobRegistry
from backend.serve.acceptance import MEAN_OF_MEANS_LABEL, POOLED_LABEL, acceptance_lines, acceptance_report
from backend.serve.cli import render
from backend.serve.launch import LaunchResult
from backend.serve.preflight import problems_text
from tests.fixtures.reference import save_untrained_draft, write_mini_profile


def canary_dict(acceptance: dict) -> dict:
    return {
        "accept_length": 2.1,
        "server_avg_accept_length": 2.1,
        "tau_hat": 3.0,
        "verdict": "red",
        "reasons": ["serving does not reproduce training"],
        "acceptance": acceptance,
    }


def test_render_lists_the_acceptance_lines_under_the_canary_line():
    histogram = [40, 30, 20, 10]  # 100 verify steps, 3 drafts each; validation predicts much more at position 2
    completion = sum((i + 1) * h for i, h in enumerate(histogram))
    acceptance = acceptance_report([(completion, sum(histogram), histogram)], num_steps=3, val_acc=[0.9, 0.8, 0.9])
    result = LaunchResult(
        ok=False, state="ready", message="red: ...", engine="reference", url="http://127.0.0.1:1", argv=["python"], canary=canary_dict(acceptance)
    )
    lines = render(result, problems_text).splitlines()
    canary_at = next(i for i, line in enumerate(lines) if line.startswith("canary: "))
    expected = [f"  {line}" for line in acceptance_lines(acceptance)]
    assert lines[canary_at + 2 : canary_at + 2 + len(expected)] == expected  # after the one reason line
    assert any(POOLED_LABEL in line for line in expected) and any(MEAN_OF_MEANS_LABEL in line for line in expected)
    assert any(line.strip().startswith("pos  val acc") for line in expected)
    assert acceptance["break_line"] and f"  {acceptance['break_line']}" in lines


def test_render_says_what_the_canary_asked_under_its_line():
    canary = canary_dict({}) | {"prompt_source": "the draft's validation conversations (8 of /data/regen)"}
    result = LaunchResult(ok=False, state="ready", message="m", engine="reference", url="u", argv=["x"], canary=canary)
    lines = render(result, problems_text).splitlines()
    canary_at = next(i for i, line in enumerate(lines) if line.startswith("canary: "))
    assert lines[canary_at + 1] == "  prompts: the draft's validation conversations (8 of /data/regen)"


def test_render_without_an_acceptance_report_prints_no_acceptance_lines():
    result = LaunchResult(ok=False, state="ready", message="m", engine="reference", url="u", argv=["x"], canary=canary_dict({}))
    text = render(result, problems_text)
    assert POOLED_LABEL not in text and "pos  val acc" not in text


def test_serve_text_output_carries_the_acceptance_lines_of_its_json(tmp_path, mini_target_dir, mini_profile, capsys):
    profile_path = write_mini_profile(mini_target_dir, tmp_path / "mini.toml")
    draft = save_untrained_draft(mini_profile, tmp_path / "draft-run")
    run_dir = tmp_path / "runs"
    argv = ["serve", "--run-dir", str(run_dir), "--profile", str(profile_path), "--draft", str(draft), "--engine", "reference", "--max-new-tokens", "24"]
    try:
        main([*argv, "--job-name", "cli-json", "--json"])
        report = json.loads(capsys.readouterr().out)
        main([*argv, "--job-name", "cli-text"])
        text = capsys.readouterr().out
    finally:
        JobRegistry(run_dir).stop(["cli-json", "cli-text"], grace=15)
    assert report["state"] == "ready" and report["canary"]["acceptance"], report
    # greedy decoding of the same prompts by the same checkpoint: the text run measures what the JSON run did
    expected = [f"  {line}" for line in acceptance_lines(report["canary"]["acceptance"])]
    lines = text.splitlines()
    assert all(line in lines for line in expected), (expected, text)
    assert any(POOLED_LABEL in line for line in lines) and any(MEAN_OF_MEANS_LABEL in line for line in lines)
    assert any(line.strip().startswith("pos  val acc") for line in lines), text


def test_a_profiles_reference_args_reach_the_server_argv_or_are_refused_before_anything_starts(mini_profile):
    """[serve] reference_args: the reference server's own options (the smollm2 profile compiles its steps on CUDA),
    checked by that server's parser; what the launcher sets itself, or what the server would refuse, is refused."""
    import pytest

    from backend.profiles import load_profile
    from backend.serve.launch import reference_argv

    def with_args(args):
        return mini_profile.model_copy(update={"serve": mini_profile.serve.model_copy(update={"reference_args": args})})

    argv = reference_argv(with_args(["--compile-steps", "--attention", "sdpa"]), "/drafts/d", 31000)
    assert argv[-3:] == ["--compile-steps", "--attention", "sdpa"] and "--draft" in argv
    assert reference_argv(mini_profile, "/drafts/d", 31000)[-2:] == ["--num-steps", str(mini_profile.serve.num_steps)]
    assert reference_argv(load_profile("smollm2-135m"), "/drafts/d", 31000)[-1] == "--compile-steps"
    for args, words in (
        (["--port=1"], "may not set --port=1: the launcher sets it; nothing was started"),
        (["--no-speculation"], "may not set --no-speculation"),
        (["--bogus"], "unrecognized arguments: --bogus; nothing was started"),
        (["--branches", "two"], "invalid int value: 'two'"),
    ):
        with pytest.raises(ValueError, match=words):
            reference_argv(with_args(args), "/drafts/d", 31000)


def test_serve_refuses_bad_reference_args_in_one_line_and_starts_nothing(tmp_path, mini_target_dir, mini_profile, capsys):
    from tests.fixtures.env import mini_profile_dict
    from tests.fixtures.reference import toml_text

    raw = mini_profile_dict(mini_target_dir)
    raw.setdefault("serve", {})["reference_args"] = ["--bogus"]
    profile_path = tmp_path / "bogus.toml"
    profile_path.write_text(toml_text(raw))
    draft = save_untrained_draft(mini_profile, tmp_path / "draft-run")
    run_dir = tmp_path / "runs"
    code = main(["serve", "--run-dir", str(run_dir), "--profile", str(profile_path), "--draft", str(draft), "--engine", "reference"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "\n" not in err, err
    assert (
        err
        == "error: [serve] reference_args ['--bogus']: python -m backend.serve.reference.server: error: unrecognized arguments: --bogus; nothing was started"
    )
    assert JobRegistry(run_dir).list_jobs() == []  # nothing was started
