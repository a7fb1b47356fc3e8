"""The reference-only per-request switch `"speculative": false`: a speculative mini server decodes that request plainly.

Fast: the mini target and an untrained draft (tests/fixtures/reference.py), servers on 127.0.0.1, no training.
"""

from __future__ import annotations

import httpx
import pytest

from backend.serve import http

PROMPT = "def parse(line):\n    "
SPEC_FIELDS = ("spec_verify_ct", "spec_accept_length", "spec_num_correct_drafts", "spec_correct_drafts_histogram")


def generate(url: str, **body) -> httpx.Response:
    payload = {"text": PROMPT, "sampling_params": {"temperature": 0, "max_new_tokens": 24, "ignore_eos": True}, **body}
    with httpx.Client(timeout=120, trust_env=False) as client:
        return client.post(f"{url}/generate", json=payload)


def state(url: str) -> dict:
    return http.get(f"{url}/get_server_info").body["internal_states"][0]


def counters(url: str) -> dict:
    """The speculative counters /get_server_info reports (feature fields included: only speculative requests set them)."""
    keys = ("avg_spec_accept_length", "feature_width", "fc_applied", "feature_source")
    return {key: state(url).get(key) for key in keys}


def test_both_servers_advertise_the_switch(mini_servers):
    for name in ("spec", "plain"):
        assert http.get(f"{mini_servers[name].url}/get_server_info").body["plain_decode_per_request"] is True


def test_a_plain_request_on_the_speculative_server_gets_the_plain_decoders_tokens_and_leaves_the_counters(mini_servers):
    spec_url, plain_url = mini_servers["spec"].url, mini_servers["plain"].url
    assert generate(spec_url).status_code == 200  # one speculative request, so the counters hold something
    before, requests_before = counters(spec_url), state(spec_url)["requests_since_flush"]
    assert before["avg_spec_accept_length"] is not None

    plain_here = generate(spec_url, speculative=False)
    assert plain_here.status_code == 200, plain_here.text
    reference = generate(plain_url).json()
    body = plain_here.json()
    assert body["output_ids"] == reference["output_ids"] and len(body["output_ids"]) == 24
    assert body["text"] == reference["text"]
    assert not any(key in body["meta_info"] for key in SPEC_FIELDS), body["meta_info"]
    assert counters(spec_url) == before
    assert state(spec_url)["requests_since_flush"] == requests_before + 1

    speculative = generate(spec_url, speculative=True).json()
    assert speculative["output_ids"] == reference["output_ids"] and speculative["meta_info"]["spec_verify_ct"] > 0


def test_a_streamed_plain_request_sends_one_token_per_event_and_no_spec_fields(mini_servers):
    url = mini_servers["spec"].url
    payload = {"text": PROMPT, "stream": True, "speculative": False, "sampling_params": {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}}
    with httpx.Client(timeout=120, trust_env=False) as client, client.stream("POST", f"{url}/generate", json=payload) as reply:
        events = [line for line in reply.iter_lines() if line.startswith("data: {")]
    assert len(events) == 8 and "spec_verify_ct" not in events[-1]


def test_the_switch_on_a_plain_server_is_plain_either_way(mini_servers):
    url = mini_servers["plain"].url
    assert generate(url, speculative=True).json()["output_ids"] == generate(url, speculative=False).json()["output_ids"]


@pytest.mark.parametrize("value", ["no", 0, [False]])
def test_a_switch_that_is_not_a_boolean_is_refused(mini_servers, value):
    reply = generate(mini_servers["spec"].url, speculative=value)
    assert reply.status_code == 400 and reply.json()["error"]["message"].startswith("speculative must be true or false")
