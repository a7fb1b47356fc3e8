"""benchmarks/paired_accept.py: two drafts' accept lengths on the same prompts, paired, on real replays of round 24."""

import json
import subprocess
import sys

import pytest

from benchmarks.paired_accept import PairingError, compare, request_rounds
from tests.fixtures.env import ROOT

RESULTS = ROOT / "benchmarks" / "results"
# Round 24's A/B on one H100: the greedy-only twin (A) and the one with the sampled answers too (B), each decoding the
# same 60 held-out ShareGPT prompts (float32, 128 tokens, ignore-eos, 3 steps); written before per_request_rounds was.
GREEDY = RESULTS / "h200_round24_replay_gpu_replay_ours_other_draft.json"
SAMPLED = RESULTS / "h200_round24_replay_gpu_replay_ours_draft.json"


def load(path):
    return json.loads(path.read_text())


def test_rounds_rebuilt_from_the_per_request_means_add_up_to_the_pooled_number():
    result = load(GREEDY)
    row = result["sets"]["sgdev/eval"]
    pairs = request_rounds(result, "sgdev/eval")
    assert len(pairs) == 60 and {t for t, _ in pairs} == {128}
    assert sum(t for t, _ in pairs) / sum(v for _, v in pairs) == pytest.approx(row["pooled"], abs=1e-12)


def test_round_24s_twins_differ_by_less_than_the_prompts_can_tell():
    report = compare(load(GREEDY), load(SAMPLED))
    row = report["sets"]["sgdev/eval"]
    assert (row["a_pooled"], row["b_pooled"]) == (pytest.approx(2.2319, abs=1e-4), pytest.approx(2.2430, abs=1e-4))
    assert row["b_minus_a_pooled"] == pytest.approx(0.0111, abs=1e-4)
    low, high = row["b_minus_a_pooled_95"]
    assert low < 0 < high and (row["b_better"], row["b_worse"], row["equal"]) == (26, 27, 7)


def test_a_draft_against_itself_differs_by_exactly_nothing():
    result = load(SAMPLED)
    row = compare(result, result)["sets"]["sgdev/eval"]
    assert row["b_minus_a_pooled"] == 0 and row["b_minus_a_pooled_95"] == [0, 0] and row["equal"] == 60


def test_written_rounds_are_read_as_written():
    result = load(GREEDY)
    result["sets"]["sgdev/eval"]["per_request_rounds"] = [[100, 50]] * 60  # as a --stop-at-eos run writes them
    result |= {"ignore_eos": False}
    assert request_rounds(result, "sgdev/eval") == [(100, 50)] * 60


@pytest.mark.parametrize(
    "change, message",
    [
        ({"max_new_tokens": 256}, "differ in max_new_tokens"),
        ({"device": "cpu"}, "differ in device"),
        ({"sets": {"other/eval": {}}}, "no eval set in both"),
    ],
)
def test_results_of_other_settings_or_prompts_are_not_paired(change, message):
    with pytest.raises(PairingError, match=message):
        compare(load(GREEDY), load(SAMPLED) | change)


def test_fewer_prompts_or_whole_answers_without_rounds_are_refused():
    fewer = load(SAMPLED)
    fewer["sets"]["sgdev/eval"]["per_request"] = fewer["sets"]["sgdev/eval"]["per_request"][:59]
    fewer["sets"]["sgdev/eval"]["tokens"] = 59 * 128
    with pytest.raises(PairingError, match="60 prompts vs 59"):
        compare(load(GREEDY), fewer)
    whole = load(GREEDY) | {"ignore_eos": False}
    with pytest.raises(PairingError, match="stopped at the end of turn"):
        request_rounds(whole, "sgdev/eval")


def test_the_command_prints_the_verdict_and_refuses_in_one_line(tmp_path):
    out = tmp_path / "paired.json"
    done = subprocess.run(
        [sys.executable, "benchmarks/paired_accept.py", str(GREEDY), str(SAMPLED), "--out", str(out)], cwd=ROOT, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    assert "B - A +0.011" in done.stdout and "no difference the prompts can tell" in done.stdout
    assert json.loads(out.read_text())["sets"]["sgdev/eval"]["prompts"] == 60
    other = tmp_path / "other.json"
    other.write_text(json.dumps(load(SAMPLED) | {"num_steps": 7}))
    refused = subprocess.run([sys.executable, "benchmarks/paired_accept.py", str(GREEDY), str(other)], cwd=ROOT, capture_output=True, text=True)
    assert refused.returncode == 2 and refused.stdout == ""
    assert refused.stderr.strip() == "paired_accept: the results differ in num_steps: 3 vs 7; they decoded other things; nothing compared"
