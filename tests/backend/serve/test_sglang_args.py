"""The SGLang argv built from the shipped profiles: section-1 flags present and consistent; parses with ServerArgs."""

import argparse

import pytest

from backend.profiles import load_profile
from backend.serve.sglang_args import (
    REQUIRED_FLAGS,
    argv_inconsistencies,
    build_sglang_argv,
    expected_spec_settings,
    parse_flag_values,
    server_args_part,
)

DRAFT = "/models/drafts/eagle3"
PROFILES = ["llama3.1-8b", "kimi-k2.5"]


@pytest.mark.parametrize("name", PROFILES)
def test_section1_flags_present_and_consistent(name):
    profile = load_profile(name)
    argv = build_sglang_argv(profile, DRAFT, python="python3")
    assert argv[:3] == ["python3", "-m", "sglang.launch_server"]
    assert argv_inconsistencies(argv, profile, DRAFT) == []
    flags = parse_flag_values(argv)
    assert set(REQUIRED_FLAGS) <= set(flags)
    assert flags["--speculative-algorithm"] == "EAGLE3"
    assert flags["--model-path"] == profile.target.path
    assert flags["--dtype"] == "bfloat16"  # explicit, never auto
    assert flags["--host"] == "127.0.0.1"
    assert (flags["--speculative-num-steps"], flags["--speculative-eagle-topk"], flags["--speculative-num-draft-tokens"]) == ("3", "1", "4")


def test_kimi_specifics():
    profile = load_profile("kimi-k2.5")
    flags = parse_flag_values(build_sglang_argv(profile, DRAFT, port=31000))
    assert flags["--tp-size"] == "8" and flags["--trust-remote-code"] is True
    assert flags["--mem-fraction-static"] == "0.9" and flags["--port"] == "31000"
    assert "--trust-remote-code" not in parse_flag_values(build_sglang_argv(load_profile("llama3.1-8b"), DRAFT))


def test_expected_server_settings_follow_topk1_rule():
    assert expected_spec_settings(load_profile("kimi-k2.5")) == {"speculative_num_steps": 3, "speculative_eagle_topk": 1, "speculative_num_draft_tokens": 4}


def test_extra_args_come_last_and_are_caught():
    profile = load_profile("llama3.1-8b").model_copy(
        update={"serve": load_profile("llama3.1-8b").serve.model_copy(update={"extra_args": ["--speculative-algorithm", "EAGLE", "--disable-cuda-graph"]})}
    )
    argv = build_sglang_argv(profile, DRAFT)
    assert argv[-3:] == ["--speculative-algorithm", "EAGLE", "--disable-cuda-graph"]
    flags = parse_flag_values(argv)
    assert flags["--speculative-algorithm"] == "EAGLE" and flags["--disable-cuda-graph"] is True
    assert any("EAGLE3" in problem for problem in argv_inconsistencies(argv, profile, DRAFT))


def test_baseline_argv_drops_only_the_speculative_flags():
    profile = load_profile("kimi-k2.5")
    flags = parse_flag_values(build_sglang_argv(profile, None, speculative=False))
    assert not [flag for flag in flags if flag.startswith("--speculative")]
    assert flags["--dtype"] == "bfloat16" and flags["--tp-size"] == "8" and flags["--trust-remote-code"] is True


def test_flag_parsing_forms():
    flags = parse_flag_values(["--tp=4", "--model", "m", "--speculative-draft-model", "d", "--enable-metrics"])
    assert flags == {"--tp-size": "4", "--model-path": "m", "--speculative-draft-model-path": "d", "--enable-metrics": True}


@pytest.mark.parametrize("name", PROFILES)
def test_argv_parses_with_sglang_server_args(name):
    server_args = pytest.importorskip("sglang.srt.server_args")
    profile = load_profile(name)
    argv = build_sglang_argv(profile, DRAFT)
    parser = argparse.ArgumentParser()
    server_args.ServerArgs.add_cli_args(parser)
    parsed = parser.parse_args(server_args_part(argv))
    args = server_args.ServerArgs.from_cli_args(parsed)
    assert args.speculative_algorithm == "EAGLE3"
    assert args.speculative_draft_model_path == DRAFT
    assert (args.speculative_num_steps, args.speculative_eagle_topk, args.speculative_num_draft_tokens) == (3, 1, 4)
    assert args.dtype == "bfloat16" and args.tp_size == profile.serve.tp_size
    assert args.mem_fraction_static == profile.serve.mem_fraction_static
    assert args.trust_remote_code is profile.serve.trust_remote_code
    baseline = server_args.ServerArgs.from_cli_args(parser.parse_args(server_args_part(build_sglang_argv(profile, None, speculative=False))))
    assert baseline.speculative_algorithm is None and baseline.model_path == profile.target.path
