"""Where SGLang 0.5.23's own clients look (issue 26): sglext, models.retrieve, final-only spec fields, meta_info, ids, health, /metrics.

Each test runs against real reference servers of the mini target on 127.0.0.1 (tests/fixtures/reference.py), through
httpx or the real `openai` client. The SGLang facts each one checks are cited from the 0.5.23 wheel's source.
"""

from __future__ import annotations

import json
import re
from urllib.parse import quote

import httpx
import openai
import pytest

from backend.serve import http
from tests.fixtures.reference import ServerProcess, save_untrained_draft, server_argv, write_mini_profile

PROMPT = "def parse(line):\n    "
SPEC_DETAIL_KEYS = {  # SGLang 0.5.23 entrypoints/openai/protocol.py: SpecTokensDetails
    "spec_accept_rate",
    "spec_accept_length",
    "spec_cap_length",
    "spec_block_accept_length",
    "spec_num_correct_drafts",
    "spec_num_proposed_drafts",
    "spec_verify_ct",
    "spec_correct_drafts_histogram",
    "spec_cap_lens_histogram",
}


def greedy(text=PROMPT, max_new_tokens=16, **extra):
    return {"text": text, "sampling_params": {"temperature": 0, "max_new_tokens": max_new_tokens, "ignore_eos": True}, **extra}


def post(url, path, body):
    with httpx.Client(timeout=120, trust_env=False) as client:
        return client.post(f"{url}{path}", json=body)


def sse(url, path, body):
    """Every `data:` event of a streamed reply, [DONE] excluded (it must come last)."""
    events, done = [], False
    with httpx.Client(timeout=120, trust_env=False) as client, client.stream("POST", f"{url}{path}", json=body) as reply:
        assert reply.status_code == 200, reply.read()
        for line in reply.iter_lines():
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: "):
                assert not done
                events.append(json.loads(line[6:]))
    assert done
    return events


@pytest.fixture(scope="module")
def model_name(spec_url):
    return http.get(f"{spec_url}/v1/models").body["data"][0]["id"]


@pytest.fixture(scope="module")
def client(spec_url):
    with httpx.Client(timeout=120, trust_env=False) as transport:
        yield openai.OpenAI(base_url=f"{spec_url}/v1", api_key="unused", max_retries=0, http_client=transport)


def expected_details(url, max_new_tokens=12):
    """SpecTokensDetails as SGLang builds them from the native meta_info of the same greedy request."""
    meta = post(url, "/generate", greedy(max_new_tokens=max_new_tokens)).json()["meta_info"]
    details = {key: meta.get(key, 0) for key in SPEC_DETAIL_KEYS}
    details.update(spec_cap_length=0.0, spec_block_accept_length=0.0, spec_cap_lens_histogram=[])
    return details


# --------------------------------------------------------------------------- 1. sglext on the OpenAI routes


def test_completions_return_spec_tokens_details_in_sglext(client, spec_url, model_name):
    want = expected_details(spec_url)
    assert want["spec_verify_ct"] > 0
    asked = dict(model=model_name, prompt=PROMPT, max_tokens=12, temperature=0)
    reply = client.completions.create(**asked, extra_body={"ignore_eos": True, "return_spec_tokens_details": True})
    assert reply.model_extra["sglext"] == {"spec_tokens_details": want}  # response level, as CompletionResponse.sglext
    assert "sglext" not in client.completions.create(**asked, extra_body={"ignore_eos": True}).model_extra
    chunks = list(
        client.completions.create(
            **asked, stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True, "return_spec_tokens_details": True}
        )
    )
    # serving_completions: the choice chunks, then one chunk with empty choices and sglext, then the usage chunk
    ext, usage = chunks[-2], chunks[-1]
    assert ext.choices == [] and ext.model_extra["sglext"] == {"spec_tokens_details": want}
    assert usage.choices == [] and usage.usage.completion_tokens == 12 and "sglext" not in (usage.model_extra or {})
    assert not [c for c in chunks[:-2] if "sglext" in (c.model_extra or {})]


def test_chat_return_spec_tokens_details_in_sglext(client, model_name):
    asked = dict(model=model_name, messages=[{"role": "user", "content": "A parser, please."}], max_tokens=10, temperature=0)
    reply = client.chat.completions.create(**asked, extra_body={"ignore_eos": True, "return_spec_tokens_details": True})
    details = reply.model_extra["sglext"]["spec_tokens_details"]
    assert set(details) == SPEC_DETAIL_KEYS and details["spec_verify_ct"] > 0
    assert details["spec_accept_length"] == pytest.approx(10 / details["spec_verify_ct"])
    assert sum(details["spec_correct_drafts_histogram"]) == details["spec_verify_ct"]
    chunks = list(client.chat.completions.create(**asked, stream=True, extra_body={"ignore_eos": True, "return_spec_tokens_details": True}))
    assert chunks[-1].choices == [] and chunks[-1].model_extra["sglext"]["spec_tokens_details"] == details
    assert chunks[-2].choices[0].finish_reason == "length"


def test_no_sglext_without_speculation(plain_url):
    body = {"model": "x", "prompt": PROMPT, "max_tokens": 4, "temperature": 0, "ignore_eos": True, "return_spec_tokens_details": True}
    assert "sglext" not in post(plain_url, "/v1/completions", body).json()  # SGLang: no spec fields, so no sglext
    refused = post(plain_url, "/v1/completions", {**body, "return_spec_tokens_details": "yes"})
    assert refused.status_code == 400 and "return_spec_tokens_details" in refused.json()["message"]


# --------------------------------------------------------------------------- 2. models.retrieve


def test_models_retrieve_decodes_the_quoted_model_path(client, spec_url, model_name):
    assert "/" in model_name  # the target directory: the client sends it quoted
    card = client.models.retrieve(model_name)
    assert (card.id, card.object, card.owned_by) == (model_name, "model", "sglang")
    raw = http.get(f"{spec_url}/v1/models/{quote(model_name, safe='')}")
    assert raw.status == 200 and raw.body["id"] == model_name and raw.body["max_model_len"] == 256
    with pytest.raises(openai.NotFoundError) as missing:
        client.models.retrieve("no/such model")
    assert missing.value.body["code"] == "model_not_found" and "'no/such model'" in missing.value.body["message"]


# --------------------------------------------------------------------------- 3. and 4. streamed /generate, meta_info


def test_streamed_generate_sends_spec_fields_and_latency_in_the_final_chunk_only(spec_url):
    events = sse(spec_url, "/generate", {**greedy(max_new_tokens=24), "stream": True})
    assert len(events) >= 2
    *partial, final = events
    for event in partial:  # tokenizer_manager: spec metrics and e2e_latency only once state.finished
        assert event["meta_info"]["finish_reason"] is None
        assert not [key for key in event["meta_info"] if key.startswith("spec_") or key == "e2e_latency"]
    whole = post(spec_url, "/generate", greedy(max_new_tokens=24)).json()["meta_info"]
    assert final["meta_info"]["finish_reason"] == {"type": "length", "length": 24}
    spec_keys = {key for key in whole if key.startswith("spec_")}
    assert spec_keys and {key: final["meta_info"][key] for key in spec_keys} == {key: whole[key] for key in spec_keys}
    assert final["meta_info"]["e2e_latency"] > 0


def test_meta_info_has_num_retractions_and_reasoning_tokens(spec_url, plain_url):
    for url in (spec_url, plain_url):
        meta = post(url, "/generate", greedy(max_new_tokens=4)).json()["meta_info"]
        assert (meta["num_retractions"], meta["reasoning_tokens"]) == (0, 0)
        for event in sse(url, "/generate", {**greedy(max_new_tokens=4), "stream": True}):
            assert (event["meta_info"]["num_retractions"], event["meta_info"]["reasoning_tokens"]) == (0, 0)
    logprobs = post(spec_url, "/generate", {**greedy(max_new_tokens=5), "return_logprob": True}).json()["meta_info"]
    assert logprobs["output_token_logprobs_length"] == len(logprobs["output_token_logprobs"]) == 5


# --------------------------------------------------------------------------- 5. return_prompt_token_ids, token_ids_logprob


def test_return_prompt_token_ids(spec_url, client, model_name):
    ids = [100, 101, 102, 32, 112, 97]
    body = {"input_ids": ids, "sampling_params": {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True}, "return_prompt_token_ids": True}
    reply = post(spec_url, "/generate", body).json()
    assert reply["prompt_token_ids"] == ids  # top level, beside text/output_ids (tokenizer_manager's out_dict)
    assert "prompt_token_ids" not in post(spec_url, "/generate", {**body, "return_prompt_token_ids": False}).json()
    events = sse(spec_url, "/generate", {**body, "stream": True})
    assert all(event["prompt_token_ids"] == ids for event in events)
    by_text = post(spec_url, "/generate", {**greedy("def f", 4), "return_prompt_token_ids": True}).json()
    assert by_text["prompt_token_ids"] == list(b"def f") and by_text["meta_info"]["prompt_tokens"] == 5
    # the OpenAI forms: completions' return_token_ids, chat's return_prompt_token_ids (non-streaming only, as in SGLang)
    cmpl = client.completions.create(model=model_name, prompt=ids, max_tokens=6, temperature=0, extra_body={"ignore_eos": True, "return_token_ids": True})
    extra = cmpl.choices[0].model_extra
    assert extra["prompt_token_ids"] == ids and extra["token_ids"] == reply["output_ids"]
    chat = {"model": model_name, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "temperature": 0, "return_prompt_token_ids": True}
    answered = post(spec_url, "/v1/chat/completions", chat).json()
    assert answered["choices"][0]["prompt_token_ids"] == list(b"user: hi\nassistant: ")
    refused = post(spec_url, "/v1/chat/completions", {**chat, "stream": True})
    assert refused.status_code == 400 and "return_prompt_token_ids is not supported with streaming" in refused.json()["message"]


def test_token_ids_logprob_is_refused_clearly(spec_url):
    reply = post(spec_url, "/generate", {**greedy(max_new_tokens=4), "return_logprob": True, "token_ids_logprob": [97, 98]})
    assert reply.status_code == 400
    message = reply.json()["error"]["message"]
    assert "token_ids_logprob" in message and "not supported" in message and "top_logprobs_num" in message


# --------------------------------------------------------------------------- 6. /ready, /ping, /metrics


def test_ready_and_ping_answer_200_once_loaded_and_metrics_is_off_by_default(spec_url):
    with httpx.Client(timeout=30, trust_env=False) as c:
        for path in ("/ready", "/ping"):
            reply = c.get(f"{spec_url}{path}")
            assert reply.status_code == 200 and reply.content == b"", path
            assert c.post(f"{spec_url}{path}").status_code == 405
        assert c.get(f"{spec_url}/metrics").json() == {"detail": "Not Found"}  # SGLang mounts it only with --enable-metrics


SAMPLE = re.compile(r'^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(?P<labels>(?:[a-zA-Z_][a-zA-Z0-9_]*="(?:[^"\\]|\\.)*",?)*)\})? (?P<value>\S+)$')


def parse_exposition(text: str) -> dict[tuple[str, frozenset], float]:
    """Prometheus text format 0.0.4: every line a HELP/TYPE comment or a well-formed sample."""
    samples = {}
    for line in text.splitlines():
        if line.startswith("# HELP ") or line.startswith("# TYPE "):
            continue
        match = SAMPLE.match(line)
        assert match, f"not a Prometheus sample line: {line!r}"
        labels = frozenset(re.findall(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"', match["labels"] or ""))
        samples[(match["name"], labels)] = float(match["value"])
    return samples


def series(samples, name, **labels):
    return [value for (n, got), value in samples.items() if n == name and set(labels.items()) <= got]


@pytest.fixture(scope="module")
def metrics_server(tmp_path_factory, mini_target_dir, mini_profile):
    root = tmp_path_factory.mktemp("metrics-server")
    profile = write_mini_profile(mini_target_dir, root / "mini.toml")
    server = ServerProcess(server_argv(profile, http.free_port(), save_untrained_draft(mini_profile, root / "run"), "--enable-metrics"), root / "log")
    try:
        server.wait_ready()
        yield server
    finally:
        server.stop()


def test_metrics_count_what_was_served(metrics_server):
    url = metrics_server.url
    with httpx.Client(timeout=30, trust_env=False) as c:
        before = c.get(f"{url}/metrics")
    assert before.status_code == 200 and before.headers["content-type"].startswith("text/plain; version=0.0.4")
    samples = parse_exposition(before.text)
    assert series(samples, "sglang:num_requests_total") == [0.0, 0.0]
    metas = [post(url, "/generate", greedy(max_new_tokens=n)).json()["meta_info"] for n in (5, 7)]
    metas.append(sse(url, "/generate", {**greedy(max_new_tokens=3), "stream": True})[-1]["meta_info"])
    with httpx.Client(timeout=30, trust_env=False) as c:
        samples = parse_exposition(c.get(f"{url}/metrics").text)
    model = http.get(f"{url}/v1/models").body["data"][0]["id"]
    labels = {"model_name": model, "engine_type": "unified"}
    assert series(samples, "sglang:num_requests_total", is_streaming="false", **labels) == [2.0]
    assert series(samples, "sglang:num_requests_total", is_streaming="true", **labels) == [1.0]
    assert series(samples, "sglang:generation_tokens_total", is_streaming="false") == [12.0]
    assert series(samples, "sglang:prompt_tokens_total", is_streaming="false") == [2.0 * len(PROMPT.encode())]
    assert series(samples, "sglang:spec_verify_calls_total") == [float(sum(m["spec_verify_ct"] for m in metas))]
    accepted = sum(m["spec_num_correct_drafts"] for m in metas) + sum(m["spec_verify_ct"] for m in metas)
    assert series(samples, "sglang:spec_accept_length", **labels) == [pytest.approx(accepted / sum(m["spec_verify_ct"] for m in metas))]
    assert series(samples, "sglang:spec_num_steps") == [float(metrics_server_steps(url))]
    assert series(samples, "sglang:e2e_request_latency_seconds_count", is_streaming="false") == [2.0]
    assert series(samples, "sglang:e2e_request_latency_seconds_bucket", is_streaming="false", le="+Inf") == [2.0]
    assert series(samples, "sglang:num_running_reqs") == [0.0]
    assert http.post_json(f"{url}/flush_cache").ok  # SGLang's counters are monotonic: a flush resets only the averages
    with httpx.Client(timeout=30, trust_env=False) as c:
        flushed = parse_exposition(c.get(f"{url}/metrics").text)
    assert series(flushed, "sglang:num_requests_total", is_streaming="false") == [2.0]
    assert series(flushed, "sglang:spec_accept_length") == []
    assert http.get(f"{url}/get_server_info").body["enable_metrics"] is True


def metrics_server_steps(url):
    return http.get(f"{url}/get_server_info").body["speculative_num_steps"]
