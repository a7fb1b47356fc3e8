"""The reference server against SGLang 0.5.23's documented wire format, the real `openai` client, and malformed requests.

Fast: the mini target and an untrained draft (tests/fixtures/reference.py), servers on 127.0.0.1, no training.
"""

from __future__ import annotations

import json
import time

import httpx
import openai
import pytest

from backend.serve import http
from backend.serve.reference.server import FLUSH_BODY
from tests.fixtures.reference import (
    MAX_BODY_BYTES,
    REQUEST_TIMEOUT_S,
    parse_raw_response,
    raw_exchange,
)

PROMPT = "def parse(line):\n    "
ERROR_RESPONSE_KEYS = {"object", "message", "type", "param", "code"}  # SGLang's ErrorResponse


def native(url, body, method="POST"):
    with httpx.Client(timeout=120, trust_env=False) as client:
        return client.request(method, f"{url}/generate", json=body)


def greedy(text=PROMPT, max_new_tokens=16, **params):
    return {"text": text, "sampling_params": {"temperature": 0, "max_new_tokens": max_new_tokens, **params}}


def native_stream(url, body):
    events, done = [], False
    with httpx.Client(timeout=120, trust_env=False) as client, client.stream("POST", f"{url}/generate", json={**body, "stream": True}) as reply:
        assert reply.status_code == 200 and reply.headers["content-type"] == "text/event-stream"
        for line in reply.iter_lines():
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: "):
                assert not done, "an event after [DONE]"
                events.append(json.loads(line[6:]))
    assert done
    return events


@pytest.fixture(scope="module")
def model_name(spec_url):
    return http.get(f"{spec_url}/get_model_info").body["served_model_name"]


@pytest.fixture(scope="module")
def client(spec_url):
    with httpx.Client(timeout=120, trust_env=False) as transport:
        yield openai.OpenAI(base_url=f"{spec_url}/v1", api_key="unused", max_retries=0, http_client=transport)


# --------------------------------------------------------------------------- native /generate


def test_generate_meta_info_has_sglang_fields(spec_url, mini_servers):
    reply = native(spec_url, {**greedy(max_new_tokens=24, ignore_eos=True), "rid": "my-request-7"})
    assert reply.status_code == 200, reply.text
    body = reply.json()
    assert set(body) == {"text", "output_ids", "meta_info"}
    meta = body["meta_info"]
    assert meta["id"] == "my-request-7"  # rid echoed, not replaced
    assert meta["finish_reason"] == {"type": "length", "length": 24}
    assert meta["prompt_tokens"] == len(PROMPT.encode()) and meta["completion_tokens"] == len(body["output_ids"]) == 24
    assert meta["cached_tokens"] == 0 and meta["weight_version"] == "default" and meta["e2e_latency"] > 0
    verify, steps = meta["spec_verify_ct"], mini_servers["profile"].serve.num_steps
    assert verify > 0 and meta["spec_accept_length"] == pytest.approx(24 / verify)
    assert meta["spec_num_proposed_drafts"] == verify * steps  # verify_ct x (num_draft_tokens - 1)
    assert meta["spec_accept_rate"] == pytest.approx(meta["spec_num_correct_drafts"] / meta["spec_num_proposed_drafts"])
    histogram = meta["spec_correct_drafts_histogram"]
    assert sum(histogram) == verify and sum(i * n for i, n in enumerate(histogram)) == meta["spec_num_correct_drafts"]
    assert len(histogram) <= steps + 1
    assert (meta["spec_accepted_drafts"], meta["spec_proposed_drafts"], meta["spec_accept_histogram"]) == (
        meta["spec_num_correct_drafts"],
        meta["spec_num_proposed_drafts"],
        histogram,
    )


def test_plain_server_reports_no_spec_fields(plain_url):
    meta = native(plain_url, greedy(max_new_tokens=4)).json()["meta_info"]
    assert not [key for key in meta if key.startswith("spec_")]


def test_speculative_output_equals_plain_and_put_is_generate(spec_url, plain_url):
    for prompt in (PROMPT, "import os\n", "class A:"):
        spec = native(spec_url, greedy(prompt, 20, ignore_eos=True), method="PUT").json()
        plain = native(plain_url, greedy(prompt, 20, ignore_eos=True)).json()
        assert spec["output_ids"] == plain["output_ids"] and spec["text"] == plain["text"]


def test_ignore_eos_and_stop_token_ids(spec_url):
    free = native(spec_url, greedy(max_new_tokens=16, ignore_eos=True)).json()
    token = free["output_ids"][3]
    first = free["output_ids"].index(token)
    stopped = native(spec_url, greedy(max_new_tokens=16, stop_token_ids=[token])).json()
    assert stopped["output_ids"] == free["output_ids"][: first + 1]
    assert stopped["meta_info"]["finish_reason"] == {"type": "stop", "matched": token}
    # ignore_eos skips every stop-token check (SGLang's rule): exactly max_new_tokens come back
    ignored = native(spec_url, greedy(max_new_tokens=16, stop_token_ids=[token], ignore_eos=True)).json()
    assert ignored["output_ids"] == free["output_ids"] and ignored["meta_info"]["finish_reason"]["type"] == "length"


def test_stop_strings_match_and_trim(spec_url):
    free = native(spec_url, greedy(max_new_tokens=24, ignore_eos=True)).json()["text"]
    stop = free[4:6]
    reply = native(spec_url, greedy(max_new_tokens=24, ignore_eos=True, stop=[stop])).json()
    assert reply["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert reply["text"] == free[: free.index(stop)]
    kept = native(spec_url, greedy(max_new_tokens=24, ignore_eos=True, stop=stop, no_stop_trim=True)).json()
    assert kept["text"] == free[: free.index(stop) + len(stop)]


def test_max_new_tokens_zero(spec_url):
    body = native(spec_url, greedy(max_new_tokens=0)).json()
    assert body["output_ids"] == [] and body["text"] == ""
    assert body["meta_info"]["finish_reason"] == {"type": "length", "length": 0}
    events = native_stream(spec_url, greedy(max_new_tokens=0))
    assert len(events) == 1 and events[0]["meta_info"]["completion_tokens"] == 0


def test_return_logprob(spec_url):
    reply = native(
        spec_url,
        {**greedy(max_new_tokens=8, ignore_eos=True), "return_logprob": True, "top_logprobs_num": 3, "return_text_in_logprobs": True, "logprob_start_len": 0},
    ).json()
    meta, ids = reply["meta_info"], reply["output_ids"]
    output = meta["output_token_logprobs"]
    assert [entry[1] for entry in output] == ids and all(entry[0] <= 0 for entry in output)
    assert all(isinstance(entry[2], str) for entry in output)
    # greedy decoding: each emitted token is the top-1 of its position
    assert [top[0][1] for top in meta["output_top_logprobs"]] == ids and all(len(top) == 3 for top in meta["output_top_logprobs"])
    assert len(meta["input_token_logprobs"]) == meta["prompt_tokens"] and meta["input_token_logprobs"][0][0] is None
    plain = native(spec_url, {**greedy(max_new_tokens=4), "return_logprob": True}).json()["meta_info"]
    assert plain["input_token_logprobs"] == [] and plain["output_token_logprobs"][0][2] is None
    assert "output_top_logprobs" not in plain


def test_stream_sends_each_state_once(spec_url):
    body = greedy(max_new_tokens=20, ignore_eos=True)
    events = native_stream(spec_url, body)
    counts = [e["meta_info"]["completion_tokens"] for e in events]
    assert counts == sorted(set(counts)) and counts[-1] == 20  # strictly growing: the last state is not repeated
    assert [e["meta_info"]["finish_reason"] for e in events[:-1]] == [None] * (len(events) - 1)
    assert events[-1]["meta_info"]["finish_reason"] == {"type": "length", "length": 20}
    assert "e2e_latency" in events[-1]["meta_info"] and "e2e_latency" not in events[0]["meta_info"]
    assert events[-1]["output_ids"] == native(spec_url, body).json()["output_ids"]


def test_flush_cache_get_and_post(spec_url):
    with httpx.Client(timeout=30, trust_env=False) as c:
        for method in ("GET", "POST"):
            reply = c.request(method, f"{spec_url}/flush_cache")
            assert reply.status_code == 200 and reply.text == FLUSH_BODY
    assert "avg_spec_accept_length" not in http.get(f"{spec_url}/get_server_info").body["internal_states"][0]


def test_error_bodies_follow_sglang(spec_url):
    refused = native(spec_url, greedy(temperature=0.7))
    assert refused.status_code == 400 and "greedily" in refused.json()["error"]["message"]  # _create_error_response
    with httpx.Client(timeout=30, trust_env=False) as c:
        bad_json = c.post(f"{spec_url}/generate", content=b"{not json", headers={"Content-Type": "application/json"})
        assert bad_json.status_code == 400 and set(bad_json.json()) == ERROR_RESPONSE_KEYS
        assert bad_json.json()["type"] == "Bad Request" and bad_json.json()["code"] == 400
        assert c.get(f"{spec_url}/nope").json() == {"detail": "Not Found"}
        wrong = c.delete(f"{spec_url}/generate")
        assert wrong.status_code == 405 and wrong.json() == {"detail": "Method Not Allowed"}


def test_model_info_and_v1_models(spec_url, model_name):
    info = http.get(f"{spec_url}/get_model_info").body
    assert info["is_generation"] is True and info["architectures"] == ["LlamaForCausalLM"]
    models = http.get(f"{spec_url}/v1/models").body
    assert models["object"] == "list" and models["data"][0]["id"] == model_name
    assert models["data"][0]["owned_by"] == "sglang" and models["data"][0]["max_model_len"] == 256
    missing = http.get(f"{spec_url}/v1/models/nope")
    assert missing.status == 404 and missing.body["error"]["code"] == "model_not_found"


# --------------------------------------------------------------------------- the openai client


def test_openai_completions(client, spec_url, model_name):
    assert [m.id for m in client.models.list().data] == [model_name]
    reply = client.completions.create(model=model_name, prompt=PROMPT, max_tokens=12, temperature=0, extra_body={"ignore_eos": True, "rid": "cmpl-mine"})
    expected = native(spec_url, greedy(max_new_tokens=12, ignore_eos=True)).json()
    assert reply.id == "cmpl-mine" and reply.object == "text_completion"
    assert reply.choices[0].text == expected["text"] and reply.choices[0].finish_reason == "length"
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens) == (len(PROMPT.encode()), 12)
    streamed = list(
        client.completions.create(
            model=model_name, prompt=PROMPT, max_tokens=12, temperature=0, stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True}
        )
    )
    assert "".join(c.choices[0].text for c in streamed if c.choices) == expected["text"]
    assert [c.choices[0].finish_reason for c in streamed if c.choices][-1] == "length"
    assert streamed[-1].choices == [] and streamed[-1].usage.completion_tokens == 12


def test_openai_chat(client, model_name):
    messages = [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "A parser, please."}]
    reply = client.chat.completions.create(model=model_name, messages=messages, max_tokens=10, temperature=0, extra_body={"ignore_eos": True})
    choice = reply.choices[0]
    assert reply.object == "chat.completion" and choice.message.role == "assistant" and choice.finish_reason == "length"
    assert reply.usage.completion_tokens == 10
    chunks = list(
        client.chat.completions.create(model=model_name, messages=messages, max_tokens=10, temperature=0, stream=True, extra_body={"ignore_eos": True})
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == choice.message.content
    assert chunks[-1].choices[0].finish_reason == "length" and all(c.id == chunks[0].id for c in chunks)


def test_openai_logprobs(client, model_name):
    completion = client.completions.create(model=model_name, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=2, extra_body={"ignore_eos": True})
    logprobs = completion.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == 6 and all(len(t) == 2 for t in logprobs.top_logprobs)
    chat = client.chat.completions.create(
        model=model_name,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=5,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
        extra_body={"ignore_eos": True},
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == 5 and all(len(t.top_logprobs) == 2 and t.logprob <= 0 for t in content)


def test_openai_refusals_are_400(client, model_name):
    with pytest.raises(openai.BadRequestError) as sampled:
        client.completions.create(model=model_name, prompt=PROMPT, max_tokens=4, temperature=0.8)
    assert "greedily" in sampled.value.body["message"]
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=model_name, prompt=PROMPT, max_tokens=0, temperature=0)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=model_name, messages=[], max_tokens=4, temperature=0)


# --------------------------------------------------------------------------- malformed requests over raw sockets


def post_raw(headers: str, body: bytes = b"") -> bytes:
    return f"POST /generate HTTP/1.1\r\nHost: 127.0.0.1\r\n{headers}\r\n".encode() + body


def post_body(body: bytes) -> bytes:
    return post_raw(f"Content-Length: {len(body)}\r\n", body)


def refused(port: int, payload: bytes, status: int, reason: str, **kwargs) -> dict:
    code, headers, body = parse_raw_response(raw_exchange(port, payload, **kwargs))
    assert code == status, body
    error = json.loads(body)
    assert set(error) == ERROR_RESPONSE_KEYS and error["code"] == status and reason in error["message"], error
    return error


def assert_serving(server) -> None:
    assert server.alive()
    assert http.get(f"{server.url}/health_generate", timeout=10).status == 200
    assert native(server.url, greedy(max_new_tokens=2)).status_code == 200


MALFORMED = [
    ("not utf-8", post_body(b'{"text": "\xff\xfe"}'), 400, "UTF-8"),
    ("deep nesting", post_body(b"[" * 100_000), 400, "too deeply"),
    ("huge integer", post_body(b"9" * 5000), 400, "acceptable JSON"),
    ("NaN", post_body(b"NaN"), 400, "NaN"),
    ("length abc", post_raw("Content-Length: abc\r\n", b"{}"), 400, "Content-Length"),
    ("length -1", post_raw("Content-Length: -1\r\n", b"{}"), 400, "Content-Length"),
    ("two lengths", post_raw("Content-Length: 2\r\nContent-Length: 3\r\n", b"{}"), 400, "Content-Length"),
    ("length and chunked", post_raw("Content-Length: 2\r\nTransfer-Encoding: chunked\r\n", b"{}"), 400, "both"),
    ("bad chunk size", post_raw("Transfer-Encoding: chunked\r\n", b"zz\r\n{}\r\n0\r\n\r\n"), 400, "chunk size"),
    ("too large", post_raw(f"Content-Length: {MAX_BODY_BYTES + 1}\r\n", b"{"), 413, "limit"),
    ("gigantic", post_raw("Content-Length: 99999999999\r\n"), 413, "limit"),
    ("garbage request line", b"HELLO THERE FRIEND OF MINE\r\n\r\n", 400, "Bad request"),
    ("HTTP/2.0", b"GET /health HTTP/2.0\r\n\r\n", 400, "HTTP/1.1"),
    ("binary junk", bytes(range(256)) * 4 + b"\r\n\r\n", 400, "Bad request"),
    ("long header", post_raw("X-Pad: " + "a" * 70_000 + "\r\n"), 431, "too long"),
    ("body not an object", post_body(b"[]"), 400, "JSON object"),
]


@pytest.mark.parametrize("name, payload, status, reason", MALFORMED, ids=[case[0] for case in MALFORMED])
def test_malformed_requests_get_a_4xx_with_a_reason(mini_servers, name, payload, status, reason):
    server = mini_servers["spec"]
    if name == "body not an object":  # a semantic refusal: SGLang's {"error": {"message"}} body
        code, _, body = parse_raw_response(raw_exchange(server.port, payload, half_close=True))
        assert code == 400 and reason in json.loads(body)["error"]["message"]
    else:
        refused(server.port, payload, status, reason, half_close=True)
    assert_serving(server)


def test_unknown_method_is_405(mini_servers):
    server = mini_servers["spec"]
    code, _, body = parse_raw_response(raw_exchange(server.port, b"BREW /generate HTTP/1.1\r\nHost: x\r\n\r\n"))
    assert code == 405 and json.loads(body) == {"detail": "Method Not Allowed"}
    assert_serving(server)


def test_short_body_times_out_instead_of_pinning_a_thread(mini_servers):
    server = mini_servers["spec"]
    started = time.monotonic()
    refused(server.port, post_raw("Content-Length: 100\r\n", b'{"text": '), 408, "did not arrive")
    assert time.monotonic() - started < REQUEST_TIMEOUT_S + 10
    assert_serving(server)


def test_chunked_body_and_oversized_upload(mini_servers):
    server = mini_servers["spec"]
    body = json.dumps(greedy(max_new_tokens=3)).encode()
    chunked = post_raw("Transfer-Encoding: chunked\r\nConnection: close\r\n", f"{len(body):x}\r\n".encode() + body + b"\r\n0\r\n\r\n")
    code, _, reply = parse_raw_response(raw_exchange(server.port, chunked))
    assert code == 200 and json.loads(reply)["meta_info"]["completion_tokens"] == 3
    # a client that sends its whole oversized body still reads the 413 (the server drains before closing)
    big = post_raw(f"Content-Length: {MAX_BODY_BYTES * 2}\r\n", b"x" * (MAX_BODY_BYTES * 2))
    refused(server.port, big, 413, "limit")
    assert_serving(server)


def test_client_leaving_mid_stream_does_not_hurt_the_server(mini_servers):
    server = mini_servers["spec"]
    body = json.dumps({**greedy(max_new_tokens=120, ignore_eos=True), "stream": True}).encode()
    raw_exchange(server.port, post_raw(f"Content-Length: {len(body)}\r\n", body), read_timeout=0.5)
    assert_serving(server)
    with httpx.Client(timeout=30, trust_env=False) as c:  # a v1 request without JSON content type
        reply = c.post(f"{server.url}/v1/completions", content=b"{}", headers={"Content-Type": "text/plain"})
        assert reply.status_code == 400 and "application/json" in reply.json()["message"]
