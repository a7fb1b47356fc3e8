"""The reference engine over real HTTP on 127.0.0.1: SGLang's wire format, streaming, greedy equality, clean SIGTERM."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from backend.jobs.records import read_exit_file
from backend.jobs.registry import JobRegistry
from backend.serve import http
from backend.serve.launch import canary_prompts, reference_argv, wait_ready
from tests.fixtures.env import ROOT

THREADS = {"OMP_NUM_THREADS": os.environ.get("EAGLE3_TEST_THREADS", "1")}


def test_draft_is_required_with_speculation():
    out = subprocess.run(
        [sys.executable, "-m", "backend.serve.reference.server", "--profile", "tiny", "--port", "1"], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 2 and "--draft is required" in out.stderr


def start_servers(registry, jobs, timeout=300):
    """Start every (name, argv) as an owned job, then wait until each answers /health_generate with 200."""
    urls = {}
    for name, argv in jobs.items():
        registry.start_job(name, "serve", argv, cwd=str(ROOT), env=THREADS)
        urls[name] = http.base_url("127.0.0.1", int(argv[argv.index("--port") + 1]))
    for name, url in urls.items():

        def exit_code(name=name):
            info = registry.get(name).info
            return None if info.state in ("running", "unknown") else info.exit_code

        state, code = wait_ready(url, exit_code, timeout, lambda line: None)
        assert state == "ready", (name, state, code, Path(registry.get(name).info.stderr_path).read_text()[-2000:])
    return urls


@pytest.fixture(scope="module")
def servers(tmp_path_factory, tiny_profile, trained_tiny_run):
    """A speculative server and a plain (baseline) server of the tiny target, both owned jobs."""
    registry = JobRegistry(tmp_path_factory.mktemp("run"))
    urls = start_servers(
        registry,
        {
            "spec": reference_argv(tiny_profile, str(trained_tiny_run), http.free_port()),
            "plain": reference_argv(tiny_profile, str(trained_tiny_run), http.free_port(), speculative=False),
        },
    )
    yield {"registry": registry, **urls}
    registry.stop(["spec", "plain"], grace=15)


def generate(url, prompt, max_new_tokens=64, **extra):
    body = {"text": prompt, "sampling_params": {"temperature": 0, "max_new_tokens": max_new_tokens}, **extra}
    return http.post_json(f"{url}/generate", body, timeout=300)


@pytest.mark.slow
def test_server_info_and_generate_speak_sglang(servers, tiny_profile):
    info = http.get(f"{servers['spec']}/get_server_info").body
    assert info["speculative_algorithm"] == "EAGLE3"
    assert (info["speculative_num_steps"], info["speculative_eagle_topk"], info["speculative_num_draft_tokens"]) == (5, 1, 6)
    assert info["model_path"] == "builtin:tiny" and info["speculative_draft_model_path"]
    prompt = canary_prompts(tiny_profile, 1)[0]
    reply = generate(servers["spec"], prompt)
    assert reply.ok, reply.text
    meta = reply.body["meta_info"]
    assert meta["completion_tokens"] == len(reply.body["output_ids"]) == 64
    assert meta["prompt_tokens"] == len(prompt.encode())
    assert meta["spec_accept_length"] == pytest.approx(meta["completion_tokens"] / meta["spec_verify_ct"])
    assert meta["e2e_latency"] > 0
    state = http.get(f"{servers['spec']}/get_server_info").body["internal_states"][0]
    assert state["avg_spec_accept_length"] > 1.0
    assert state["feature_width"] == state["expected_feature_width"] == 3 * 128
    assert state["feature_source"] == "aux" and state["fc_applied"] is True
    plain = http.get(f"{servers['plain']}/get_server_info").body
    assert plain["speculative_algorithm"] is None
    assert "spec_verify_ct" not in generate(servers["plain"], prompt, 8).body["meta_info"]


@pytest.mark.slow
def test_the_canary_reads_what_prompts_the_server_admits_from_its_model_card(servers, tiny_profile):
    """served_prompt_fit: the server's max_model_len (GET /v1/models, as SGLang's) less the new tokens asked; a
    prompt it admits is served, one token longer is refused with HTTP 400, as the fit predicts."""
    from backend.serve.prompts import PromptFit, served_prompt_fit

    fit = served_prompt_fit(servers["spec"], 16)
    assert fit == PromptFit(tiny_profile.draft.max_position_embeddings, 16)
    longest = "x" * (fit.context_len - 16)  # the tiny target's tokens are bytes
    assert fit.admits(len(longest)) and not fit.admits(len(longest) + 1)
    assert generate(servers["spec"], longest, 16).ok
    refused = generate(servers["spec"], longest + "x", 16)
    assert refused.status == 400 and "exceeds the context length" in refused.text
    assert served_prompt_fit(f"http://127.0.0.1:{http.free_port()}", 16) is None  # nothing listening: prompts as they come


@pytest.mark.slow
def test_speculative_output_equals_plain_decoding(servers, tiny_profile):
    for prompt in canary_prompts(tiny_profile, 4) + ["def main(argv=None):\n    "]:
        spec = generate(servers["spec"], prompt, 96).body
        plain = generate(servers["plain"], prompt, 96).body
        assert spec["output_ids"] == plain["output_ids"]
        assert spec["text"] == plain["text"]


def stream(url, prompt, max_new_tokens):
    body = {"text": prompt, "stream": True, "sampling_params": {"temperature": 0, "max_new_tokens": max_new_tokens}}
    events, done = [], False
    with httpx.Client(timeout=300, trust_env=False) as client, client.stream("POST", f"{url}/generate", json=body) as r:
        assert r.status_code == 200 and r.headers["content-type"] == "text/event-stream"
        for line in r.iter_lines():
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: "):
                events.append((time.perf_counter(), json.loads(line[6:])))
    assert done
    return [event for _, event in events]


@pytest.mark.slow
def test_streaming_chunks_are_cumulative_and_match(servers, tiny_profile):
    prompt = canary_prompts(tiny_profile, 2)[1]
    for name in ("spec", "plain"):
        events = stream(servers[name], prompt, 48)
        counts = [e["meta_info"]["completion_tokens"] for e in events]
        assert counts == sorted(counts) and counts[-1] == 48 and len(events) >= 3
        assert events[-1]["output_ids"] == generate(servers["plain"], prompt, 48).body["output_ids"]
    spec_events = stream(servers["spec"], prompt, 48)
    assert "spec_verify_ct" in spec_events[-1]["meta_info"]
    assert len(spec_events) - 1 < 48  # several tokens per verify round


@pytest.mark.slow
def test_bad_requests_are_refused_clearly(servers):
    url = servers["spec"]
    reply = generate(url, "x", 4, sampling_params={"temperature": 0.7, "max_new_tokens": 4})
    assert reply.status == 400 and "greedily only" in reply.body["error"]["message"]
    no_temperature = http.post_json(f"{url}/generate", {"text": "x", "sampling_params": {"max_new_tokens": 4}})
    assert no_temperature.status == 400
    batch = http.post_json(f"{url}/generate", {"text": ["a", "b"], "sampling_params": {"temperature": 0}})
    assert batch.status == 400 and "batched" in batch.body["error"]["message"]
    assert http.post_json(f"{url}/generate", {"input_ids": [999999], "sampling_params": {"temperature": 0}}).status == 400
    assert http.get(f"{url}/nope").status == 404
    with httpx.Client(trust_env=False) as client:
        assert client.post(f"{url}/generate", content=b"{not json").status_code == 400


@pytest.mark.slow
def test_flush_cache_resets_the_average(servers):
    url = servers["spec"]
    generate(url, "import os\n", 16)
    assert "avg_spec_accept_length" in http.get(f"{url}/get_server_info").body["internal_states"][0]
    assert http.post_json(f"{url}/flush_cache").ok
    assert "avg_spec_accept_length" not in http.get(f"{url}/get_server_info").body["internal_states"][0]


@pytest.mark.slow
def test_503_while_loading_then_clean_exit_on_sigterm(tmp_path, tiny_profile, trained_tiny_run):
    registry = JobRegistry(tmp_path / "run")
    port = http.free_port()
    registry.start_job("boot", "serve", reference_argv(tiny_profile, str(trained_tiny_run), port), cwd=str(ROOT), env=THREADS)
    url = http.base_url("127.0.0.1", port)
    first = None
    deadline = time.monotonic() + 60
    while first is None and time.monotonic() < deadline:
        first = http.get(f"{url}/health_generate", timeout=5).status
        time.sleep(0.05)
    assert first == 503  # bound at once, model still loading
    state, _ = wait_ready(url, lambda: None, 300, lambda line: None)
    assert state == "ready"
    verdicts = registry.stop(["boot"], grace=15)
    assert [v.outcome for v in verdicts if v.role == "leader"] == ["exited_on_term"]
    assert read_exit_file(registry.jobs_dir / "boot")[0] == 0
    assert "shutting down" in Path(registry.jobs_dir / "boot" / "stderr.log").read_text()


def test_a_state_handed_to_the_streaming_thread_stays_as_it_was_while_decoding_goes_on():
    from backend.serve.reference.engine import Generation, GenerationSpec

    gen = Generation(spec=GenerationSpec(input_ids=[1], max_new_tokens=8, stop_token_ids=frozenset()), rid="r", started=0.0, output_ids=[5, 6])
    gen.accepted_per_round, gen.output_logprobs = [1], [[-0.1, 5, None]]
    handed = gen.copy()
    gen.output_ids.append(7)
    gen.accepted_per_round.append(2)
    gen.output_logprobs.append([-0.2, 7, None])
    gen.finish = {"type": "length", "length": 3}
    assert handed.output_ids == [5, 6] and handed.accepted_per_round == [1] and handed.output_logprobs == [[-0.1, 5, None]] and handed.finish is None
