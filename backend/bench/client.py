"""Async benchmark client: streams greedy /generate requests at several concurrency levels, speculative and a baseline."""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx

from backend.serve import http
from backend.serve.acceptance import acceptance_report, histogram_from_meta, repeated_word_share
from backend.serve.prompts import PromptSet
from backend.serve.reference.native_api import PLAIN_SWITCH, PLAIN_SWITCH_INFO
from backend.train.target import load_tokenizer

SAME_ENGINE = "same-engine"  # plain decoding asked per request of the speculative server itself
BASELINE_URL = "url"  # a second server of the same target without speculation
NO_BASELINE = "none"


class TemplateError(ValueError):
    """The --chat-template tokenizer could not be loaded or has no chat template."""


class BaselineError(ValueError):
    """The baseline asked for cannot be measured against this server."""


@dataclass(frozen=True)
class RequestOptions:
    """How one side of a comparison asks: ignore_eos for fixed lengths, plain for the reference engine's per-request switch."""

    ignore_eos: bool = False
    plain: bool = False

    def payload(self, prompt: str, max_new_tokens: int) -> dict[str, Any]:
        params: dict[str, Any] = {"temperature": 0, "max_new_tokens": max_new_tokens}
        if self.ignore_eos:
            params["ignore_eos"] = True
        payload: dict[str, Any] = {"text": prompt, "stream": True, "sampling_params": params}
        if self.plain:
            payload[PLAIN_SWITCH] = False
        return payload


@dataclass(frozen=True)
class Baseline:
    """What the speculative side is compared with: mode SAME_ENGINE, BASELINE_URL (with url) or NO_BASELINE."""

    mode: str
    url: str | None = None

    @property
    def measured(self) -> bool:
        return self.mode != NO_BASELINE


def plain_per_request(info: dict[str, Any]) -> bool:
    """A speculative server that decodes a request plainly when asked (the reference engine advertises it)."""
    return bool(info.get(PLAIN_SWITCH_INFO)) and bool(info.get("speculative_algorithm"))


def resolve_baseline(choice: str | None, info: dict[str, Any]) -> Baseline:
    """choice: SAME_ENGINE, NO_BASELINE, a URL, or None for SAME_ENGINE where the server offers it, else none."""
    if choice is None:
        return Baseline(SAME_ENGINE) if plain_per_request(info) else Baseline(NO_BASELINE)
    if choice == NO_BASELINE:
        return Baseline(NO_BASELINE)
    if choice == SAME_ENGINE:
        if not plain_per_request(info):
            why = "it does not speculate" if not info.get("speculative_algorithm") else f"it does not advertise {PLAIN_SWITCH_INFO} (SGLang has no such switch)"
            raise BaselineError(f"--baseline {SAME_ENGINE}: the server cannot decode a request plainly on request: {why}; give a baseline server's URL instead")
        return Baseline(SAME_ENGINE)
    if not choice.startswith(("http://", "https://")):
        raise BaselineError(f"--baseline {choice!r}: expected {SAME_ENGINE}, {NO_BASELINE} or a server URL (http://HOST:PORT)")
    return Baseline(BASELINE_URL, choice.rstrip("/"))


def templated(prompts: PromptSet, model_dir: str) -> PromptSet:
    """Wrap each prompt as one user turn in the tokenizer's chat template (generation prompt appended)."""
    try:
        tokenizer = load_tokenizer(model_dir)
        texts = [tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True) for p in prompts.prompts]
    except Exception as exc:  # missing files, no template, no transformers
        raise TemplateError(f"cannot apply the chat template of {model_dir}: {type(exc).__name__}: {exc}") from None
    digest = hashlib.sha256(json.dumps(texts).encode()).hexdigest()
    return PromptSet(texts, f"{prompts.source} [chat template {model_dir}]", digest)


@dataclass
class RequestResult:
    index: int
    ok: bool
    error: str | None = None
    completion_tokens: int = 0
    verify_ct: int = 0
    ttft_s: float | None = None
    latency_s: float = 0.0
    chunk_gaps_s: list[float] = field(default_factory=list)  # time between streamed chunks after the first
    text: str = ""
    histogram: list[int] | None = None  # spec_correct_drafts_histogram of the last event (cumulative per request)
    histogram_note: str | None = None  # why histogram is None


async def stream_generate(
    client: httpx.AsyncClient, url: str, prompt: str, index: int, max_new_tokens: int, options: RequestOptions = RequestOptions()
) -> RequestResult:
    payload = options.payload(prompt, max_new_tokens)
    started = time.perf_counter()
    result = RequestResult(index=index, ok=False)
    last_chunk: float | None = None
    try:
        async with client.stream("POST", f"{url}/generate", json=payload) as response:
            if response.status_code != 200:
                body = (await response.aread()).decode(errors="replace")[:300]
                result.error = f"HTTP {response.status_code}: {body}"
                return result
            async for event in http.sse_events(response):
                now = time.perf_counter()
                meta = event.get("meta_info") or {}
                tokens = int(meta.get("completion_tokens") or 0)
                if tokens > result.completion_tokens:
                    if result.ttft_s is None:
                        result.ttft_s = now - started
                    elif last_chunk is not None:
                        result.chunk_gaps_s.append(now - last_chunk)
                    last_chunk = now
                    result.completion_tokens = tokens
                result.verify_ct = int(meta.get("spec_verify_ct") or result.verify_ct)
                if meta.get("spec_verify_ct"):
                    result.histogram, result.histogram_note = histogram_from_meta(meta)
                result.text = event.get("text", result.text)
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
        return result
    result.latency_s = time.perf_counter() - started
    result.ok = result.completion_tokens > 0
    if not result.ok:
        result.error = "stream ended without tokens"
    return result


def percentile(values: list[float], pct: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    rank = (len(ordered) - 1) * pct / 100.0
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


@dataclass
class LevelResult:
    concurrency: int
    requests: int
    failed: int
    duration_s: float
    output_tokens: int
    output_tok_per_s: float
    request_per_s: float
    accept_length: float | None  # pooled over verify steps (SGLang, vLLM): sum(completion_tokens) / sum(spec_verify_ct)
    server_avg_accept_length: float | None
    ttft_p50_s: float | None
    ttft_p99_s: float | None
    itl_p50_s: float | None  # gaps between streamed chunks (a chunk can hold several accepted tokens)
    itl_p99_s: float | None
    tpot_p50_s: float | None  # per request: (latency - ttft) / (completion_tokens - 1)
    tpot_p99_s: float | None
    latency_p50_s: float | None
    latency_p99_s: float | None
    errors: list[str] = field(default_factory=list)
    texts: list[str] = field(default_factory=list, repr=False)
    accept_length_mean_of_request_means: float | None = None  # SpecForge's benchmark: mean of completion/verify_ct
    completion_tokens_min: int | None = None  # per completed request; both equal max_new_tokens under ignore_eos
    completion_tokens_max: int | None = None
    # acceptance.acceptance_report without validation: both definitions labelled, served acceptance per draft position
    acceptance: dict[str, Any] = field(default_factory=dict)
    repeated_word_share: float | None = None  # answers' words that repeat an earlier 8-word run of their answer (loops)

    def to_dict(self, with_texts: bool = False) -> dict[str, Any]:
        data = asdict(self)
        if not with_texts:
            data.pop("texts")
        return data


async def run_level(
    url: str, prompts: list[str], concurrency: int, max_new_tokens: int, timeout_s: float = 600.0, options: RequestOptions = RequestOptions()
) -> LevelResult:
    """All prompts at one concurrency level, after /flush_cache so the server's average covers this level only."""
    async with http.async_client(timeout=timeout_s, connections=max(concurrency, 1)) as client:
        await client.post(f"{url}/flush_cache")
        gate = asyncio.Semaphore(concurrency)

        async def one(index: int, prompt: str) -> RequestResult:
            async with gate:
                return await stream_generate(client, url, prompt, index, max_new_tokens, options)

        started = time.perf_counter()
        results = await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
        duration = time.perf_counter() - started
        info = await client.get(f"{url}/get_server_info")
    server_info = info.json() if info.status_code == 200 else {}
    return summarize(concurrency, results, duration, server_info)


def summarize(concurrency: int, results: list[RequestResult], duration: float, server_info: dict[str, Any]) -> LevelResult:
    done = [r for r in results if r.ok]
    tokens = sum(r.completion_tokens for r in done)
    verify = sum(r.verify_ct for r in done)
    ttfts = [r.ttft_s for r in done if r.ttft_s is not None]
    gaps = [g for r in done for g in r.chunk_gaps_s]
    tpots = [(r.latency_s - r.ttft_s) / (r.completion_tokens - 1) for r in done if r.ttft_s is not None and r.completion_tokens > 1]
    latencies = [r.latency_s for r in done]
    states = server_info.get("internal_states") or [{}]
    server_avg = states[0].get("avg_spec_accept_length") if states and isinstance(states[0], dict) else None
    by_index = sorted(results, key=lambda r: r.index)
    steps = server_info.get("speculative_num_steps")
    acceptance = acceptance_report(
        [(r.completion_tokens, r.verify_ct, r.histogram) for r in done],
        steps if isinstance(steps, int) and steps > 0 else None,
        histogram_notes=[r.histogram_note for r in done if r.histogram_note],
    )
    return LevelResult(
        concurrency=concurrency,
        requests=len(results),
        failed=len(results) - len(done),
        duration_s=duration,
        output_tokens=tokens,
        output_tok_per_s=tokens / duration if duration > 0 else 0.0,
        request_per_s=len(done) / duration if duration > 0 else 0.0,
        accept_length=tokens / verify if verify else None,
        server_avg_accept_length=server_avg,
        ttft_p50_s=percentile(ttfts, 50),
        ttft_p99_s=percentile(ttfts, 99),
        itl_p50_s=percentile(gaps, 50),
        itl_p99_s=percentile(gaps, 99),
        tpot_p50_s=percentile(tpots, 50),
        tpot_p99_s=percentile(tpots, 99),
        latency_p50_s=percentile(latencies, 50),
        latency_p99_s=percentile(latencies, 99),
        errors=[f"prompt {r.index}: {r.error}" for r in results if not r.ok][:10],
        texts=[r.text for r in by_index],
        accept_length_mean_of_request_means=acceptance["mean_of_request_means"],
        completion_tokens_min=min((r.completion_tokens for r in done), default=None),
        completion_tokens_max=max((r.completion_tokens for r in done), default=None),
        acceptance=acceptance,
        repeated_word_share=repeated_word_share([r.text for r in done]),
    )


async def fetch_server_info(url: str) -> dict[str, Any]:
    async with http.async_client(timeout=30) as client:
        try:
            reply = await client.get(f"{url}/get_server_info")
        except httpx.HTTPError as exc:
            raise ConnectionError(f"{url}/get_server_info: no answer ({type(exc).__name__}: {exc})") from None
    if reply.status_code != 200:
        raise ConnectionError(f"{url}/get_server_info: HTTP {reply.status_code}")
    return reply.json()


async def warm_up(url: str, prompt: str, max_new_tokens: int, options: RequestOptions) -> None:
    """One request that is not counted: the first one pays one-off costs (CUDA graph capture, lazy initialisation)."""
    async with http.async_client(timeout=600.0, connections=1) as client:
        await stream_generate(client, url, prompt, -1, max_new_tokens, options)


def side_options(baseline: Baseline, stop_at_eos: bool = False) -> tuple[RequestOptions, RequestOptions]:
    """(speculative side, plain side). With a baseline every request ignores eos, so both sides decode exactly
    max_new_tokens per prompt; stop_at_eos ends both at the target's end of turn instead (whole answers: greedy
    sides that produce equal outputs produce equal lengths, which the comparison's outputs_equal shows)."""
    fixed = not stop_at_eos
    return RequestOptions(ignore_eos=baseline.measured and fixed), RequestOptions(ignore_eos=fixed, plain=baseline.mode == SAME_ENGINE)


async def measure_set(
    url: str, baseline: Baseline, prompts: list[str], concurrency: list[int], max_new_tokens: int, stop_at_eos: bool = False
) -> tuple[list[LevelResult], list[LevelResult]]:
    """(speculative levels, baseline levels) over one prompt set (side_options), the two sides alternating level by level."""
    spec_side, plain_side = side_options(baseline, stop_at_eos)
    plain_url = url if baseline.mode == SAME_ENGINE else baseline.url or url
    await warm_up(url, prompts[0], max_new_tokens, spec_side)
    if baseline.measured:
        await warm_up(plain_url, prompts[0], max_new_tokens, plain_side)
    levels, baseline_levels = [], []
    for level in concurrency:
        levels.append(await run_level(url, prompts, level, max_new_tokens, options=spec_side))
        if baseline.measured:
            baseline_levels.append(await run_level(plain_url, prompts, level, max_new_tokens, options=plain_side))
    return levels, baseline_levels
