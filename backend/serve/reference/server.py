"""Reference engine: an HTTP server speaking SGLang 0.5.23's wire format over the project's own speculative decoder.

python -m backend.serve.reference.server --profile P --draft DIR --port N [--host 127.0.0.1]
       [--feed aux|last_hidden] [--num-steps K] [--no-speculation] [--served-model-name NAME]
       [--device auto|cpu|cuda[:N]] [--static-cache] [--compile-steps]
       [--max-body-bytes B] [--request-timeout S] [--header-timeout S] [--max-connections N] [--max-waiting N]
       [--enable-metrics]

Native routes (/generate, /flush_cache, /health*, /ready, /ping, /get_server_info, /get_model_info, and /metrics
with --enable-metrics) and the OpenAI ones (/v1/models, /v1/completions, /v1/chat/completions; see openai_api.py). Greedy only (temperature 0). One
generation at a time (a lock around the model). One event loop collects request heads (a deadline, a size and
header-count cap, no thread per connection); bounded worker pools serve complete requests, a small one of its own
for health and info GETs so they answer while generations run; past the queue, 503. Outputs equal plain greedy
decoding of the target. Every malformed request gets a 4xx with a reason; sockets time out, bodies are bounded; a
client that leaves costs one log line. Limits and deliberate differences from SGLang: docs/serving.md.
"""

from __future__ import annotations

import argparse
import collections
import json
import math
import os
import queue
import re
import selectors
import signal
import socket
import sys
import threading
import time
import traceback
import uuid
from dataclasses import dataclass, field
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler
from typing import Any, Callable
from urllib.parse import unquote, urlsplit

from backend.serve.reference import hf_tokenizer, openai_api, serving_metrics
from backend.serve.reference.openai_api import OpenAIRequestError

DEFAULT_MAX_NEW_TOKENS = 128  # SGLang's default
DEFAULT_MAX_BODY_BYTES = 16 * 1024 * 1024
DEFAULT_REQUEST_TIMEOUT_S = 30.0
DEFAULT_HEADER_TIMEOUT_S = 10.0  # the whole request head (request line and headers), however it is dripped
DEFAULT_MAX_CONNECTIONS = 64  # requests served at once; complete requests past that queue (4x), then get 503
DEFAULT_MAX_WAITING = 1024  # connections still sending a request head; past that, the oldest is dropped
MAX_HEAD_BYTES = 64 * 1024  # request line and headers together; more is 431
MAX_HEADER_LINES = 100  # what http.client allows; more is 431
GREEDY_TEMPERATURE = 1e-6  # SGLang decodes greedily below this temperature
WEIGHT_VERSION = "default"
FLUSH_BODY = "Cache flushed.\nPlease check backend logs for more details. (When there are running or waiting requests, the operation will not be performed.)\n"
DRAIN_LIMIT_BYTES = 64 * 1024 * 1024
# Sampling parameters that would change greedy output; refused unless left at their neutral value.
NEUTRAL_SAMPLING: dict[str, tuple[object, ...]] = {
    "top_k": (-1, 1, None),
    "top_p": (1.0, 1, None),
    "min_p": (0.0, 0, None),
    "repetition_penalty": (1.0, 1, None),
    "frequency_penalty": (0.0, 0, None),
    "presence_penalty": (0.0, 0, None),
    "n": (1, None),
    "min_new_tokens": (0, None),
    "stop_regex": (None, [], ""),
    "regex": (None,),
    "json_schema": (None,),
    "ebnf": (None,),
    "structural_tag": (None,),
    "logit_bias": (None, {}),
}
IGNORED_SAMPLING = ("spaces_between_special_tokens", "sampling_seed", "custom_params")
HANDLED_SAMPLING = ("temperature", "max_new_tokens", "stop", "stop_token_ids", "ignore_eos", "no_stop_trim", "skip_special_tokens")
UNSUPPORTED_GENERATE = (
    "input_embeds",
    "image_data",
    "audio_data",
    "video_data",
    "lora_path",
    "session_params",
    "return_hidden_states",
    "custom_logit_processor",
    "token_ids_logprob",
)


UNSUPPORTED_HINTS = {
    "token_ids_logprob": "; ask for top_logprobs_num instead (top_logprobs_num = the vocab size returns every token's logprob)",
}


class RequestError(ValueError):
    """A /generate body this engine will not serve: 400 with SGLang's {"error": {"message"}} body."""


class HttpError(Exception):
    """A request refused before it reaches a route handler (framing, JSON, routing, loading)."""

    def __init__(
        self,
        status: int,
        message: str = "",
        *,
        payload: Any = None,
        close: bool = False,
        drain: int = 0,
        err_type: str | None = None,
        headers: dict[str, str] | None = None,
        dropped: str | None = None,
    ):
        super().__init__(message)
        self.dropped = dropped  # the client left or stalled: what the one log line for it says
        self.status = int(status)
        self.payload = payload if payload is not None else error_body(status, message, err_type)
        self.close = close
        self.drain = drain  # bytes of unread body to drop after replying
        self.headers = headers


class ClientGone(Exception):
    """The client stopped reading a streamed reply; the generation is abandoned."""


def error_body(status: int, message: str, err_type: str | None = None) -> dict[str, Any]:
    """SGLang's ErrorResponse shape (what its RequestValidationError and HTTPException handlers send)."""
    return {"object": "error", "message": message, "type": err_type or HTTPStatus(status).phrase, "param": None, "code": int(status)}


def log(message: str) -> None:
    print(f"[reference_server {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------- one request, as the engine sees it


@dataclass
class GenerationSpec:
    input_ids: list[int]
    max_new_tokens: int
    stop_token_ids: frozenset[int]  # eos ∪ sampling_params.stop_token_ids; empty with ignore_eos
    stop_strings: tuple[str, ...] = ()
    no_stop_trim: bool = False
    skip_special_tokens: bool = True
    return_logprob: bool = False
    top_logprobs_num: int = 0
    logprob_start_len: int = -1
    return_text_in_logprobs: bool = False


@dataclass
class NativeRequest:
    spec: GenerationSpec
    rid: str
    stream: bool
    return_prompt_token_ids: bool = False  # the reply carries the prompt's ids as top-level `prompt_token_ids`


@dataclass
class Generation:
    """The state of one request as it decodes: what a streamed chunk or the final reply reports."""

    spec: GenerationSpec
    rid: str
    started: float
    output_ids: list[int] = field(default_factory=list)
    verify_ct: int = 0
    accepted_per_round: list[int] = field(default_factory=list)
    finish: dict[str, Any] | None = None
    output_logprobs: list[list] = field(default_factory=list)
    output_top_logprobs: list[list] = field(default_factory=list)
    input_logprobs: list[list] = field(default_factory=list)
    input_top_logprobs: list = field(default_factory=list)
    latency: float | None = None


def finish_reason(spec: GenerationSpec, output_ids: list[int], stop_string: str | None) -> dict[str, Any] | None:
    """SGLang's order: length first, then a matched stop token (eos included), then a matched stop string."""
    if len(output_ids) >= spec.max_new_tokens:
        return {"type": "length", "length": spec.max_new_tokens}
    if output_ids and output_ids[-1] in spec.stop_token_ids:
        return {"type": "stop", "matched": output_ids[-1]}
    if stop_string is not None:
        return {"type": "stop", "matched": stop_string}
    return None


def correct_drafts_histogram(accepted_per_round: list[int]) -> list[int]:
    """Index = drafts accepted in one verify step, value = how many steps accepted that many (grows as needed)."""
    histogram = [0] * (max(accepted_per_round) + 1) if accepted_per_round else []
    for accepted in accepted_per_round:
        histogram[accepted] += 1
    return histogram


# --------------------------------------------------------------------------- the engine


def streaming_decoder_class(base: type | None = None):
    """`base` (SpecDecoder, or StaticDecoder) whose stop rules (stop ids, stop strings) are set per request and which reports each emission."""
    from backend.serve.reference.spec_decode import SpecDecoder

    class StreamingDecoder(base or SpecDecoder):  # type: ignore[misc]
        on_emit: Callable[[Any], None] | None = None
        stop_string_hit: Callable[[list[int]], bool] | None = None

        def _emit(self, result, tokens, max_new_tokens=None):
            before = len(result.output_ids)
            super()._emit(result, tokens, max_new_tokens)
            if self.on_emit is not None and len(result.output_ids) > before:
                self.on_emit(result)

        def _done(self, result, max_new_tokens: int) -> bool:
            if super()._done(result, max_new_tokens):
                return True
            return bool(result.output_ids) and self.stop_string_hit is not None and self.stop_string_hit(result.output_ids)

    return StreamingDecoder


class LogprobTracker:
    """Log-probabilities of prompt and emitted tokens from a separate KV-cached target pass (greedy output is unchanged)."""

    def __init__(self, runner, prompt_ids: list[int], top_n: int, label: Callable[[int], str | None]):
        import torch

        self.torch, self.runner, self.top_n, self.label = torch, runner, top_n, label
        ids = torch.tensor([prompt_ids], dtype=torch.long, device=runner.device)
        logits, _, self.cache = runner.forward(ids, None, hidden_states=False)
        self.prompt_rows = torch.log_softmax(logits[0].float(), dim=-1)  # row i predicts token i + 1
        self.last_row = self.prompt_rows[-1]

    def entry(self, row, token: int) -> list:
        value = float(row[token]) if row is not None else None
        return [_finite(value), int(token), self.label(token)]

    def top(self, row) -> list | None:
        if row is None or self.top_n <= 0:
            return None if row is None else []
        values, indices = row.topk(min(self.top_n, row.numel()))
        return [[_finite(float(v)), int(i), self.label(int(i))] for v, i in zip(values, indices)]

    def prompt(self, prompt_ids: list[int], start: int) -> tuple[list, list]:
        rows = [None if pos == 0 else self.prompt_rows[pos - 1] for pos in range(len(prompt_ids))]
        picked = range(max(start, 0), len(prompt_ids))
        return [self.entry(rows[p], prompt_ids[p]) for p in picked], [self.top(rows[p]) for p in picked]

    def extend(self, tokens: list[int]) -> tuple[list, list]:
        ids = self.torch.tensor([tokens], dtype=self.torch.long, device=self.runner.device)
        logits, _, self.cache = self.runner.forward(ids, self.cache, hidden_states=False)
        new_rows = self.torch.log_softmax(logits[0].float(), dim=-1)
        rows = [self.last_row] + list(new_rows[:-1])
        self.last_row = new_rows[-1]
        return [self.entry(r, t) for r, t in zip(rows, tokens)], [self.top(r) for r in rows]


def _finite(value: float | None) -> float | None:
    if value is None or math.isfinite(value):
        return value
    return -1e30 if value < 0 else 1e30  # JSON has no infinities


class Engine:
    """Target + optional draft behind one lock, with SGLang-style cumulative acceptance counters."""

    def __init__(
        self,
        profile,
        draft_dir: str | None,
        feed: str,
        num_steps: int | None,
        speculative: bool,
        device: str | None = None,
        static_cache: bool | None = None,
        compile_steps: bool = False,
    ):
        """device: "auto"/None picks cuda:0 when CUDA is available, else cpu. On CUDA the target loads in the profile's
        [serve] dtype and decodes through the static-cache decoder under CUDA graphs; on CPU it loads as it always
        did (the profile's target dtype) and decodes eagerly, unless static_cache=True asks for the static decoder."""
        import torch

        if speculative and draft_dir is None:
            raise ValueError("a speculative engine needs a draft checkpoint directory; none was given, nothing was loaded")
        with torch.no_grad():  # loading and the warm-up decode; the caller's thread keeps its own grad mode
            self._load(profile, draft_dir, feed, num_steps, speculative, device, static_cache, compile_steps)

    def _load(self, profile, draft_dir, feed, num_steps, speculative, device, static_cache, compile_steps) -> None:
        import torch

        from backend.train.target import load_target

        self.profile = profile
        self.speculative = speculative
        self.draft_dir = draft_dir
        self.device = self.resolve_device(device)
        on_cuda = self.device.type == "cuda"
        if on_cuda:
            torch.cuda.set_device(self.device)
        self.target = load_target(profile, device=self.device, dtype=profile.serve.dtype) if on_cuda else load_target(profile)
        self.tokenizer = self.target.tokenizer
        self.tokenizer_path = hf_tokenizer.exposed_tokenizer_dir(self.target.path, log)
        self.num_steps = num_steps or profile.serve.num_steps
        self.feed = feed
        self.expected_feature_width = None
        draft = None
        aux_ids = list(profile.target.aux_layer_ids)
        if speculative and draft_dir is not None:  # (a speculative engine without one was refused above)
            from backend.train.checkpoint import load_checkpoint

            draft, config, _meta, _state = load_checkpoint(draft_dir, target_embedding=self.target.embed_weight())
            draft = draft.to(self.device).eval()
            self.expected_feature_width = config.aux_width
            aux_ids = list(config.aux_layer_ids)
        kwargs = {"aux_layer_ids": aux_ids, "num_steps": self.num_steps, "feed": feed, "eos_token_id": getattr(self.tokenizer, "eos_token_id", None)}
        self.decoder = self._build_decoder(draft, kwargs, on_cuda if static_cache is None else static_cache, compile_steps)
        self.eos_ids = frozenset(self.decoder.eos)
        self.lock = threading.Lock()
        self.counters_lock = threading.Lock()
        self.last_features: dict[str, Any] = {}
        self.flush()

    @staticmethod
    def resolve_device(name: str | None):
        """The device to load on: auto (or None) is cuda:0 when CUDA is available, else cpu; cuda is cuda:0; else as torch reads it."""
        import torch

        if name in (None, "auto"):
            name = "cuda" if torch.cuda.is_available() else "cpu"
        device = torch.device(name)
        if device.type == "cuda":
            if not torch.cuda.is_available():
                raise ValueError(f"device {name!r} was asked for but CUDA is not available here; nothing was loaded")
            device = torch.device("cuda", device.index or 0)  # torch 2.11 refuses set_device("cuda") without an index
        return device

    def _build_decoder(self, draft, kwargs: dict[str, Any], static_cache: bool, compile_steps: bool):
        """The static-cache decoder when asked (the default on CUDA) and the target is one it runs; else the eager one."""
        self.decoder_kind = "eager"
        if static_cache:
            from backend.serve.reference.static_decode import StaticDecoder, StaticUnsupported

            try:
                # + one verify's width: the server admits prompt + max_new_tokens <= context_len, a verify writes num_steps more
                decoder = streaming_decoder_class(StaticDecoder)(
                    self.target.model, draft, max_len=self.context_len + self.num_steps + 1, compile=compile_steps, **kwargs
                )
                self._warm(decoder)
                self.decoder_kind = "static-cuda-graphs" if decoder.use_graphs else "static"
                return decoder
            except StaticUnsupported as exc:
                log(f"{exc}; decoding eagerly instead")
            except Exception:  # a capture that fails here would fail every request: serve eagerly, say why
                log("the static-cache decoder failed its warm-up; decoding eagerly instead:\n" + traceback.format_exc(limit=6))
        return streaming_decoder_class()(self.target.model, draft, **kwargs)

    def _warm(self, decoder) -> None:
        """One short plain (and speculative) decode at load: the first cache prefix's graphs are captured now."""
        prompt = [0, 1, 2, 3]
        decoder.plain(prompt, 3)
        if decoder.draft is not None:
            decoder.generate(prompt, 2 * self.num_steps + 2)

    @property
    def context_len(self) -> int:
        return self.profile.draft.max_position_embeddings

    @property
    def vocab_size(self) -> int:
        return self.target.vocab_size

    def flush(self) -> None:
        with self.counters_lock:
            self.verify_tokens = 0  # tokens emitted by verify rounds (accepted drafts + the bonus token)
            self.verify_ct = 0
            self.requests = 0

    def try_flush(self) -> bool:
        """Reset the counters unless a generation is running (SGLang flushes only when idle)."""
        if not self.lock.acquire(blocking=False):
            return False
        try:
            self.flush()
        finally:
            self.lock.release()
        return True

    def avg_accept_length(self) -> float | None:
        with self.counters_lock:
            return self.verify_tokens / self.verify_ct if self.verify_ct else None

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text))

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def chat_prompt(self, messages: list[dict[str, str]]) -> dict[str, Any]:
        """The tokenizer's chat template when it has one; otherwise a plain "role: content" transcript."""
        if getattr(self.tokenizer, "chat_template", None):
            text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            return {"input_ids": list(self.tokenizer.encode(text, add_special_tokens=False))}
        return {"text": hf_tokenizer.transcript(messages)}

    # --- generation ----------------------------------------------------------------------------------

    def run(self, spec: GenerationSpec, rid: str, on_progress: Callable[[Generation], None] | None = None) -> Generation:
        """Greedy continuation; on_progress(generation) after every emission (one verify round, or one plain token)."""
        gen = Generation(spec=spec, rid=rid, started=time.perf_counter())
        with self.lock:
            tracker = self._tracker(spec, gen)

            def emitted(result) -> None:
                self._update(gen, result, tracker)
                if on_progress is not None:
                    on_progress(gen)

            result = self._decode(spec, emitted)
            self._update(gen, result, tracker)
        gen.finish = gen.finish or {"type": "length", "length": spec.max_new_tokens}
        gen.latency = gen.latency if gen.latency is not None else time.perf_counter() - gen.started
        self._count(result)
        return gen

    def _decode(self, spec: GenerationSpec, emitted: Callable[[Any], None]):
        decoder = self.decoder
        decoder.eos, decoder.on_emit = set(spec.stop_token_ids), emitted
        decoder.stop_string_hit = (lambda ids: self._stop_string(spec, ids) is not None) if spec.stop_strings else None
        try:
            if self.speculative:
                return decoder.generate(spec.input_ids, spec.max_new_tokens)
            return decoder.plain(spec.input_ids, spec.max_new_tokens)
        finally:
            decoder.eos, decoder.on_emit, decoder.stop_string_hit = set(self.eos_ids), None, None

    def _tracker(self, spec: GenerationSpec, gen: Generation) -> LogprobTracker | None:
        if not spec.return_logprob:
            return None
        label = (lambda token: self.decode([token], skip_special_tokens=False)) if spec.return_text_in_logprobs else (lambda token: None)
        tracker = LogprobTracker(self.decoder.target, spec.input_ids, spec.top_logprobs_num, label)
        if spec.logprob_start_len >= 0:
            gen.input_logprobs, gen.input_top_logprobs = tracker.prompt(spec.input_ids, spec.logprob_start_len)
        return tracker

    def _update(self, gen: Generation, result, tracker: LogprobTracker | None) -> None:
        new = [int(t) for t in result.output_ids[len(gen.output_ids) :]]
        if tracker is not None and new:
            entries, tops = tracker.extend(new)
            gen.output_logprobs += entries
            gen.output_top_logprobs += tops
        gen.output_ids += new
        gen.verify_ct = result.verify_ct
        gen.accepted_per_round = [int(a) for a in result.accepted_per_round]
        gen.finish = finish_reason(gen.spec, gen.output_ids, self._stop_string(gen.spec, gen.output_ids))
        if gen.finish is not None and gen.latency is None:
            gen.latency = time.perf_counter() - gen.started

    def _stop_string(self, spec: GenerationSpec, output_ids: list[int]) -> str | None:
        if not spec.stop_strings or not output_ids:
            return None
        longest = max(len(s) for s in spec.stop_strings)
        tail = self.decode(output_ids[-(longest + 1) :], spec.skip_special_tokens)
        return next((s for s in spec.stop_strings if s in tail), None)

    def _count(self, result) -> None:
        with self.counters_lock:
            self.requests += 1
            if not self.speculative:
                return
            self.verify_ct += result.verify_ct
            self.verify_tokens += sum(int(a) + 1 for a in result.accepted_per_round)
            self.last_features = {"feature_width": result.feature_width, "fc_applied": result.fc_applied, "feature_detail": result.feature_source}

    # --- what the wire reports -----------------------------------------------------------------------

    def output(self, gen: Generation) -> dict[str, Any]:
        """SGLang's /generate object: {text, output_ids, meta_info}; cumulative while streaming."""
        return {"text": self.output_text(gen), "output_ids": list(gen.output_ids), "meta_info": self.meta_info(gen)}

    def output_text(self, gen: Generation) -> str:
        ids, finish, spec = gen.output_ids, gen.finish, gen.spec
        matched = finish.get("matched") if finish else None
        if isinstance(matched, int) and not spec.no_stop_trim:
            ids = ids[:-1]
        text = self.decode(ids, spec.skip_special_tokens)
        if isinstance(matched, str) and not spec.no_stop_trim and matched in text:
            text = text[: text.index(matched)]
        # An unfinished multi-byte character decodes to U+FFFD; hold it back until its last byte arrives.
        return text if finish else text.rstrip("\ufffd")

    def meta_info(self, gen: Generation) -> dict[str, Any]:
        """SGLang's meta_info; like its tokenizer manager, the latency and the speculative fields only once finished."""
        meta: dict[str, Any] = {
            "id": gen.rid,
            "finish_reason": gen.finish,
            "prompt_tokens": len(gen.spec.input_ids),
            "weight_version": WEIGHT_VERSION,
            "num_retractions": 0,  # one request at a time: nothing is ever retracted for memory
        }
        if gen.spec.return_logprob:
            meta.update(input_token_logprobs=gen.input_logprobs, output_token_logprobs=gen.output_logprobs)
            meta["output_token_logprobs_length"] = len(gen.output_logprobs)
            if gen.spec.top_logprobs_num > 0:
                meta.update(input_top_logprobs=gen.input_top_logprobs, output_top_logprobs=gen.output_top_logprobs)
        meta.update(reasoning_tokens=0, completion_tokens=len(gen.output_ids), cached_tokens=0)  # no reasoning parser
        if gen.finish is not None:
            if gen.latency is not None:
                meta["e2e_latency"] = gen.latency
            meta.update(self.spec_meta(gen))
        return meta

    def spec_meta(self, gen: Generation) -> dict[str, Any]:
        """SGLang's per-request speculative fields; present once at least one verify step ran."""
        if not self.speculative or gen.verify_ct == 0:
            return {}
        correct = sum(gen.accepted_per_round)
        proposed = gen.verify_ct * self.num_steps  # verify_ct x (num_draft_tokens - 1); topk 1 chains
        histogram = correct_drafts_histogram(gen.accepted_per_round)
        return {
            "spec_verify_ct": gen.verify_ct,
            "spec_accept_length": len(gen.output_ids) / gen.verify_ct,
            "spec_accept_rate": correct / proposed,
            "spec_num_correct_drafts": correct,
            "spec_num_proposed_drafts": proposed,
            "spec_correct_drafts_histogram": histogram,
            # SGLang still sends these older names beside the new ones
            "spec_accepted_drafts": correct,
            "spec_proposed_drafts": proposed,
            "spec_accept_histogram": histogram,
        }

    def internal_state(self) -> dict[str, Any]:
        state: dict[str, Any] = {"engine": "reference", "requests_since_flush": self.requests}
        average = self.avg_accept_length()
        if average is not None:
            state["avg_spec_accept_length"] = average
        if self.speculative:
            # feature_width / fc_applied are what the decoder observed on the last request (None before one ran).
            state.update({"feature_width": None, "fc_applied": None, "feature_source": self.feed})
            state.update(self.last_features)
            state["expected_feature_width"] = self.expected_feature_width
        return state

    def log_generation(self, gen: Generation) -> None:
        meta = self.spec_meta(gen)
        spec = f", verify {gen.verify_ct}, accept len {meta.get('spec_accept_length', 0):.2f}" if self.speculative else ""
        log(f"generate {gen.rid}: prompt {len(gen.spec.input_ids)} tokens, completion {len(gen.output_ids)}{spec}, {gen.latency or 0:.2f} s")


# --------------------------------------------------------------------------- request parsing


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return (_is_int(value) or isinstance(value, float)) and math.isfinite(value)


def _prompt_ids(body: dict[str, Any], engine: Engine) -> list[int]:
    text, input_ids = body.get("text"), body.get("input_ids")
    if isinstance(text, list) or (isinstance(input_ids, list) and input_ids and isinstance(input_ids[0], list)):
        raise RequestError("batched requests are not served by the reference engine; send one prompt per request")
    if (text is None) == (input_ids is None):
        raise RequestError("give exactly one of 'text' (a string) or 'input_ids' (a list of ints)")
    if text is not None:
        if not isinstance(text, str):
            raise RequestError("'text' must be a string")
        ids = engine.encode(text)
    else:
        if not isinstance(input_ids, list) or not all(_is_int(i) for i in input_ids):
            raise RequestError("'input_ids' must be a list of ints")
        ids = _checked_ids(input_ids, engine, "input_ids")
    if not ids:
        raise RequestError("the prompt is empty")
    return ids


def _checked_ids(ids: list[int], engine: Engine, name: str) -> list[int]:
    vocab = engine.vocab_size
    if any(not 0 <= i < vocab for i in ids):
        raise RequestError(f"'{name}' holds ids outside the target vocab 0..{vocab - 1}")
    return list(ids)


def _rid(body: dict[str, Any]) -> str:
    rid = body.get("rid")
    if rid is None:
        return uuid.uuid4().hex
    if isinstance(rid, list):
        raise RequestError("batched requests are not served by the reference engine; 'rid' must be one string")
    if not isinstance(rid, str) or not rid:
        raise RequestError("'rid' must be a non-empty string")
    return rid


def _check_sampling_keys(params: dict[str, Any]) -> None:
    temperature = params.get("temperature", 1.0)  # SGLang's default is 1.0, i.e. sampling
    if not _is_number(temperature) or not 0 <= temperature < GREEDY_TEMPERATURE:
        raise RequestError(f"sampling_params.temperature is {temperature!r}: the reference engine decodes greedily only; send temperature 0")
    for key, value in params.items():
        if key in NEUTRAL_SAMPLING and value not in NEUTRAL_SAMPLING[key]:
            raise RequestError(f"sampling_params.{key}={value!r} is not supported by the reference engine (greedy only)")
        if key not in NEUTRAL_SAMPLING and key not in IGNORED_SAMPLING and key not in HANDLED_SAMPLING:
            raise RequestError(f"sampling_params.{key} is not supported by the reference engine")


def _max_new_tokens(params: dict[str, Any], prompt_len: int, context_len: int) -> int:
    max_new = params.get("max_new_tokens", DEFAULT_MAX_NEW_TOKENS)
    if max_new is None:  # SGLang: up to the context length
        max_new = context_len - prompt_len
    if not _is_int(max_new) or max_new < 0:
        raise RequestError(f"sampling_params.max_new_tokens must be a non-negative int, got {max_new!r}")
    if prompt_len + max_new > context_len:
        raise RequestError(f"prompt ({prompt_len}) + max_new_tokens ({max_new}) exceeds the context length {context_len}")
    return max_new


def _stop_strings(params: dict[str, Any]) -> tuple[str, ...]:
    stop = params.get("stop")
    if stop in (None, "", []):
        return ()
    stop = [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise RequestError("sampling_params.stop must be a string or a list of non-empty strings")
    return tuple(stop)


def _flag(mapping: dict[str, Any], key: str, default: bool, where: str) -> bool:
    value = mapping.get(key, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise RequestError(f"{where}{key} must be true or false, got {value!r}")
    return value


def _stop_token_ids(params: dict[str, Any], engine: Engine) -> frozenset[int]:
    if _flag(params, "ignore_eos", False, "sampling_params."):
        return frozenset()  # SGLang's ignore_eos skips the stop-token check entirely
    extra = params.get("stop_token_ids") or []
    if not isinstance(extra, list) or not all(_is_int(i) for i in extra):
        raise RequestError("sampling_params.stop_token_ids must be a list of ints")
    return engine.eos_ids | frozenset(_checked_ids(extra, engine, "stop_token_ids"))


def _logprob_options(body: dict[str, Any], engine: Engine) -> dict[str, Any]:
    top = body.get("top_logprobs_num", 0) or 0
    start = body.get("logprob_start_len", -1)
    if not _is_int(top) or not 0 <= top <= engine.vocab_size:
        raise RequestError(f"top_logprobs_num must be an int in 0..{engine.vocab_size}, got {top!r}")
    if start is None:
        start = -1
    if not _is_int(start) or start < -1:
        raise RequestError(f"logprob_start_len must be an int >= -1, got {start!r}")
    return {
        "return_logprob": _flag(body, "return_logprob", False, ""),
        "top_logprobs_num": top,
        "logprob_start_len": start,
        "return_text_in_logprobs": _flag(body, "return_text_in_logprobs", False, ""),
    }


def parse_generate(body: Any, engine: Engine) -> NativeRequest:
    """A /generate body (SGLang's GenerateReqInput, one prompt) -> what the engine runs."""
    if not isinstance(body, dict):
        raise RequestError("the body must be a JSON object")
    for key in UNSUPPORTED_GENERATE:
        if body.get(key) not in (None, False, [], {}):
            raise RequestError(f"'{key}' is not supported by the reference engine{UNSUPPORTED_HINTS.get(key, '')}")
    ids = _prompt_ids(body, engine)
    rid = _rid(body)
    params = body.get("sampling_params") or {}
    if not isinstance(params, dict):
        raise RequestError("'sampling_params' must be an object")
    _check_sampling_keys(params)
    spec = GenerationSpec(
        input_ids=ids,
        max_new_tokens=_max_new_tokens(params, len(ids), engine.context_len),
        stop_token_ids=_stop_token_ids(params, engine),
        stop_strings=_stop_strings(params),
        no_stop_trim=_flag(params, "no_stop_trim", False, "sampling_params."),
        skip_special_tokens=_flag(params, "skip_special_tokens", True, "sampling_params."),
        **_logprob_options(body, engine),
    )
    stream, prompt_ids = _flag(body, "stream", False, ""), _flag(body, "return_prompt_token_ids", False, "")
    return NativeRequest(spec=spec, rid=rid, stream=stream, return_prompt_token_ids=prompt_ids)


# --------------------------------------------------------------------------- request bodies


def parse_content_length(values: list[str]) -> int:
    texts = {value.strip() for value in values}
    if len(texts) != 1:
        raise HttpError(400, f"conflicting Content-Length headers {sorted(texts)}", close=True)
    text = texts.pop()
    if not re.fullmatch(r"[0-9]{1,19}", text):
        raise HttpError(400, f"Content-Length {text[:40]!r} is not a non-negative integer", close=True)
    return int(text)


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def parse_json(raw: bytes) -> Any:
    if not raw.strip():
        raise HttpError(400, "the body is empty; send a JSON object")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise HttpError(400, f"the body is not UTF-8 (byte {exc.start}: {exc.reason})") from None
    try:
        return json.loads(text, parse_constant=_reject_constant)
    except RecursionError:
        raise HttpError(400, "the body nests JSON arrays or objects too deeply") from None
    except json.JSONDecodeError as exc:
        raise HttpError(400, f"the body is not JSON: {exc.msg} (line {exc.lineno}, column {exc.colno})") from None
    except ValueError as exc:  # an integer of more than 4300 digits, NaN, Infinity
        raise HttpError(400, f"the body is not acceptable JSON: {exc}") from None


# --------------------------------------------------------------------------- HTTP

ROUTES = {
    "/health": {"GET": "health"},
    "/health_generate": {"GET": "health"},
    "/ready": {"GET": "health"},  # SGLang: 200 once loaded and not paused (this engine never pauses)
    "/ping": {"GET": "health"},  # SGLang's SageMaker health check
    "/metrics": {"GET": "metrics"},  # only with --enable-metrics, as in SGLang; 404 otherwise
    "/get_server_info": {"GET": "server_info"},
    "/server_info": {"GET": "server_info"},
    "/get_model_info": {"GET": "model_info"},
    "/model_info": {"GET": "model_info"},
    "/flush_cache": {"GET": "flush_cache", "POST": "flush_cache"},
    "/generate": {"POST": "generate", "PUT": "generate"},
    "/v1/models": {"GET": "models"},
    "/v1/completions": {"POST": "completions"},
    "/v1/chat/completions": {"POST": "chat"},
}
NOT_FOUND = {"detail": "Not Found"}  # FastAPI's bodies for unknown routes and methods
METHOD_NOT_ALLOWED = {"detail": "Method Not Allowed"}


# --------------------------------------------------------------------------- connections
#
# One event-loop thread (serve_forever) accepts connections and collects each request head without a thread of
# its own: a client that drips its head, or never sends one, costs a file descriptor, never a thread, and is
# closed at the head deadline. A complete head goes to a bounded pool of worker threads (cheap GETs to a small
# pool of their own, so health checks answer while generations hold the main pool); when a pool's queue is full
# the request is answered 503 at once. After a kept-alive reply the connection goes back to the event loop.

LIGHT_PATHS = frozenset(
    {"/health", "/health_generate", "/ready", "/ping", "/metrics", "/get_server_info", "/server_info", "/get_model_info", "/model_info", "/v1/models"}
)
LIGHT_WORKERS = 4
LIGHT_QUEUE = 64
HEAD_END = re.compile(rb"\r?\n\r?\n")
HAS_BODY = re.compile(rb"(?im)^(content-length|transfer-encoding)[ \t]*:")
LINGER_S = 2.0  # after a refusal from the event loop: how long unread input is drained so the client sees the reply
SWEEP_INTERVAL_S = 0.1
DROP_LOG_PER_SECOND = 20


@dataclass
class ConnectionLimits:
    """What one client, and all of them together, may hold (docs/serving.md, "The reference server's limits")."""

    header_timeout: float = DEFAULT_HEADER_TIMEOUT_S  # a whole request head, from accept (or its first byte on a kept-alive connection)
    max_connections: int = DEFAULT_MAX_CONNECTIONS  # requests served at once: the main pool's worker threads
    max_waiting: int = DEFAULT_MAX_WAITING  # open connections whose next request head is still arriving
    max_head_bytes: int = MAX_HEAD_BYTES
    max_header_lines: int = MAX_HEADER_LINES

    @property
    def queue_size(self) -> int:
        """Complete requests that may wait for a main-pool worker; past that, 503."""
        return 4 * self.max_connections

    def descriptors(self) -> int:
        """File descriptors the limits can hold at once (every waiting, queued and served connection, plus slack)."""
        return self.max_waiting + self.max_connections + self.queue_size + LIGHT_WORKERS + LIGHT_QUEUE + 64


class DropLog:
    """One log line per dropped client, at most `per_second` a second; the rest are counted in one line."""

    def __init__(self, per_second: int = DROP_LOG_PER_SECOND):
        self.per_second = per_second
        self.lock = threading.Lock()
        self.window = time.monotonic()
        self.logged = 0
        self.suppressed = 0

    def __call__(self, message: str) -> None:
        with self.lock:
            self._roll(time.monotonic())
            if self.logged < self.per_second:
                self.logged += 1
                log(message)
            else:
                self.suppressed += 1

    def flush(self) -> None:
        with self.lock:
            self._roll(time.monotonic())

    def _roll(self, now: float) -> None:
        if now - self.window < 1.0:
            return
        if self.suppressed:
            log(f"{self.suppressed} more dropped clients in the last {now - self.window:.1f} s were not logged one by one")
        self.window, self.logged, self.suppressed = now, 0, 0


def client_name(address: Any) -> str:
    return f"{address[0]}:{address[1]}" if isinstance(address, tuple) and len(address) >= 2 else str(address)


def request_line(head: bytes | bytearray) -> str:
    """'METHOD /path' of a (partial) head for a log line, printable and short."""
    first = bytes(head[:512]).split(b"\n", 1)[0].strip()
    words = first.decode("latin-1").split()[:2]
    text = " ".join(words) if words else "(no request line)"
    return "".join(c if c.isprintable() else "?" for c in text)[:160]


def is_light(head: bytes | bytearray) -> bool:
    """A body-less GET of a route that never waits for the engine: served by the light pool."""
    words = bytes(head[:512]).split(b"\n", 1)[0].split()
    if len(words) < 2 or words[0] not in (b"GET", b"HEAD") or HAS_BODY.search(head):
        return False
    path = urlsplit(words[1].decode("latin-1")).path
    return path in LIGHT_PATHS or path.startswith("/v1/models/")


def refusal_bytes(status: int, message: str, headers: dict[str, str] | None = None) -> bytes:
    body = json.dumps(error_body(status, message)).encode()
    lines = [f"HTTP/1.1 {status} {HTTPStatus(status).phrase}", "Content-Type: application/json", f"Content-Length: {len(body)}", "Connection: close"]
    lines += [f"{name}: {value}" for name, value in (headers or {}).items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


@dataclass(eq=False)
class Waiting:
    """A connection whose next request head is still arriving (read by the event loop, no thread), or one being closed."""

    sock: socket.socket
    address: Any
    deadline: float
    buffer: bytearray = field(default_factory=bytearray)
    fresh: bool = True  # new: the head deadline runs from accept; kept alive: idle until a first byte, then the deadline
    closing: bool = False  # refused: input is drained until the client closes or LINGER_S passes
    drained: int = 0


@dataclass
class Accepted:
    """A complete request head and the connection it came on, queued for a worker."""

    sock: socket.socket
    address: Any
    data: bytes  # the head and whatever followed it in the same reads


class SocketReader:
    """A handler's rfile: the bytes the event loop already read (the head, maybe more), then the socket.

    Reads block with the socket's timeout (TimeoutError past it). leftover() hands unread bytes (a pipelined
    next request) back to the event loop.
    """

    closed = False

    def __init__(self, sock: socket.socket, prefix: bytes):
        self.sock = sock
        self.buffer = bytearray(prefix)

    def _fill(self, size: int) -> bool:
        data = self.sock.recv(max(size, 1))
        self.buffer += data
        return bool(data)

    def _take(self, size: int) -> bytes:
        out = bytes(self.buffer[:size])
        del self.buffer[:size]
        return out

    def readline(self, limit: int = -1) -> bytes:
        while True:
            end = self.buffer.find(b"\n", 0, limit if limit >= 0 else len(self.buffer))
            if end >= 0:
                return self._take(end + 1)
            if 0 <= limit <= len(self.buffer):
                return self._take(limit)
            if not self._fill(1 << 16):
                return self._take(len(self.buffer))

    def read1(self, size: int = -1) -> bytes:
        if not self.buffer:
            self._fill(size if size > 0 else 1 << 16)
        return self._take(len(self.buffer) if size < 0 else size)

    def read(self, size: int = -1) -> bytes:
        while size < 0 or len(self.buffer) < size:
            if not self._fill(1 << 16 if size < 0 else size - len(self.buffer)):
                break
        return self._take(len(self.buffer) if size < 0 else size)

    def leftover(self) -> bytes:
        return self._take(len(self.buffer))

    def close(self) -> None:
        pass  # the socket outlives one request on a kept-alive connection


class SocketWriter:
    """A handler's wfile: unbuffered sendall (the socket's timeout bounds a client that stops reading)."""

    closed = False

    def __init__(self, sock: socket.socket):
        self.sock = sock

    def write(self, data: bytes) -> int:
        self.sock.sendall(data)
        return len(data)

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass


class WorkerPool:
    """At most `size` threads, started as needed and kept, serving Accepted items from a queue of at most `queue_size`."""

    def __init__(self, name: str, size: int, queue_size: int, serve: Callable[[Accepted], None]):
        self.name, self.size, self.serve = name, size, serve
        self.queue: queue.Queue[Accepted | None] = queue.Queue(maxsize=queue_size)
        self.lock = threading.Lock()
        self.threads: list[threading.Thread] = []
        self.idle = 0

    def offer(self, item: Accepted) -> bool:
        """Queue one request; False when the queue is full (the caller answers 503)."""
        try:
            self.queue.put_nowait(item)
        except queue.Full:
            return False
        with self.lock:
            if self.queue.qsize() > self.idle and len(self.threads) < self.size:
                thread = threading.Thread(target=self._work, name=f"{self.name}-{len(self.threads)}", daemon=True)
                self.threads.append(thread)
                thread.start()
        return True

    def busy(self) -> int:
        with self.lock:
            return len(self.threads) - self.idle

    def _work(self) -> None:
        while True:
            with self.lock:
                self.idle += 1
            item = self.queue.get()
            with self.lock:
                self.idle -= 1
            if item is None:
                return
            self.serve(item)

    def stop(self) -> None:
        for _ in self.threads:
            try:
                self.queue.put_nowait(None)
            except queue.Full:
                return  # daemon threads; the process is ending


class ReferenceHTTPServer:
    """The listening socket, the event loop that collects request heads, and the bounded worker pools."""

    request_queue_size = 128  # the kernel's accept backlog; the event loop empties it quickly

    def __init__(
        self,
        address: tuple[str, int],
        info: dict[str, Any],
        max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
        request_timeout: float = DEFAULT_REQUEST_TIMEOUT_S,
        limits: ConnectionLimits | None = None,
    ):
        self.engine: Engine | None = None
        self.info = info
        self.loading = True
        self.metrics: serving_metrics.ServingMetrics | None = None  # set with --enable-metrics
        self.max_body_bytes = max_body_bytes
        self.request_timeout = request_timeout
        self.limits = limits or ConnectionLimits()
        host, port = address
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.socket = socket.create_server((host, port), family=family, backlog=self.request_queue_size)
        self.socket.setblocking(False)
        self.server_address = self.socket.getsockname()[:2]
        self.drop_log = DropLog()
        self.pool = WorkerPool("request", self.limits.max_connections, self.limits.queue_size, self._serve)
        self.light_pool = WorkerPool("light", LIGHT_WORKERS, LIGHT_QUEUE, self._serve)
        self._selector = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._returned: collections.deque[tuple[socket.socket, Any, bytes]] = collections.deque()
        self._waiting: dict[socket.socket, Waiting] = {}  # insertion order: the oldest first
        self._stop = threading.Event()
        self._stopped = threading.Event()

    # --- the event loop --------------------------------------------------------------------------------

    def serve_forever(self, poll_interval: float = 0.5) -> None:
        self._selector.register(self.socket, selectors.EVENT_READ, "listen")
        self._selector.register(self._wake_r, selectors.EVENT_READ, "wake")
        next_sweep = 0.0
        try:
            while not self._stop.is_set():
                for key, _events in self._selector.select(timeout=min(poll_interval, SWEEP_INTERVAL_S)):
                    if key.data == "listen":
                        self._accept()
                    elif key.data == "wake":
                        self._take_returned()
                    else:
                        self._readable(key.data)
                now = time.monotonic()
                if now >= next_sweep:
                    self._expire(now)
                    self.drop_log.flush()
                    next_sweep = now + SWEEP_INTERVAL_S
        finally:
            self._stopped.set()

    def shutdown(self) -> None:
        """Stop serve_forever and wait until it has returned (requests in flight are not waited for)."""
        self._stop.set()
        self._wake()
        self._stopped.wait()

    def server_close(self) -> None:
        for waiting in list(self._waiting.values()):
            self._forget(waiting)
        self._selector.close()
        self.socket.close()
        self.pool.stop()
        self.light_pool.stop()
        self._wake_r.close()
        self._wake_w.close()

    def _wake(self) -> None:
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass  # already awake (buffer full) or closed

    def _accept(self) -> None:
        for _ in range(256):  # then let the other connections be read
            try:
                sock, address = self.socket.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # out of file descriptors: the oldest waiting head makes room
                if not self._evict_oldest(f"the server ran out of file descriptors ({exc.strerror})"):
                    time.sleep(0.05)
                return
            sock.setblocking(False)
            if sock.family in (socket.AF_INET, socket.AF_INET6):  # headers and body are separate writes: no Nagle stall
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._admit(Waiting(sock, address, deadline=time.monotonic() + self.limits.header_timeout))

    def _admit(self, waiting: Waiting) -> None:
        if len(self._waiting) >= self.limits.max_waiting:
            self._evict_oldest(f"{self.limits.max_waiting} connections were already waiting to send a request head")
        self._waiting[waiting.sock] = waiting
        self._selector.register(waiting.sock, selectors.EVENT_READ, waiting)
        if waiting.buffer:
            self._check_head(waiting)

    def _evict_oldest(self, reason: str) -> bool:
        oldest = next(iter(self._waiting.values()), None)
        if oldest is None:
            return False
        if not oldest.closing:
            self._log_drop(oldest, f"dropped while its request head was still arriving: {reason}")
            self._send_quietly(oldest.sock, refusal_bytes(503, f"the server is at its connection limit ({reason}); retry shortly", {"Retry-After": "1"}))
        self._forget(oldest)
        return True

    def _take_returned(self) -> None:
        try:
            while self._wake_r.recv(4096):
                pass
        except OSError:
            pass
        now = time.monotonic()
        while self._returned:
            sock, address, leftover = self._returned.popleft()
            sock.setblocking(False)
            deadline = now + (self.limits.header_timeout if leftover else self.request_timeout)
            self._admit(Waiting(sock, address, deadline=deadline, buffer=bytearray(leftover), fresh=False))

    def _readable(self, waiting: Waiting) -> None:
        try:
            data = waiting.sock.recv(1 << 16)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:  # a reset: logged unless it ends a kept-alive connection between requests
            if waiting.buffer and not waiting.closing:
                self._log_drop(waiting, f"reset the connection after {len(waiting.buffer)} bytes of an incomplete request head ({exc.strerror})")
            elif waiting.fresh and not waiting.closing:
                self._log_drop(waiting, f"reset the connection before a request head arrived ({exc.strerror})")
            self._forget(waiting)
            return
        if waiting.closing:
            waiting.drained += len(data)
            if not data or waiting.drained > DRAIN_LIMIT_BYTES:
                self._forget(waiting)
            return
        if not data:
            if waiting.buffer:
                self._log_drop(waiting, f"closed the connection after {len(waiting.buffer)} bytes of an incomplete request head")
            self._forget(waiting)  # with nothing sent: a port probe, or a kept-alive connection the client closed
            return
        if not waiting.buffer and not waiting.fresh:
            waiting.deadline = time.monotonic() + self.limits.header_timeout  # kept alive: the head's clock starts now
        waiting.buffer += data
        self._check_head(waiting)

    def _check_head(self, waiting: Waiting) -> None:
        limits = self.limits
        end = HEAD_END.search(waiting.buffer)
        size = end.end() if end else len(waiting.buffer)
        if size > limits.max_head_bytes:
            message = f"the request head is too long: more than {limits.max_head_bytes} bytes (request line and headers together)"
            self._refuse(waiting, 431, message, f"refused with 431: a request head of more than {limits.max_head_bytes} bytes")
            return
        if end is None:
            return
        header_lines = waiting.buffer.count(b"\n", 0, end.end()) - 2
        if header_lines > limits.max_header_lines:
            message = f"too many headers: {header_lines} header lines, at most {limits.max_header_lines}"
            self._refuse(waiting, 431, message, f"refused with 431: {header_lines} header lines")
            return
        self._forget(waiting, close=False)
        pool = self.light_pool if is_light(waiting.buffer[: end.end()]) else self.pool
        if not pool.offer(Accepted(waiting.sock, waiting.address, bytes(waiting.buffer))):
            busy = f"{pool.busy()} requests in progress and {pool.queue.maxsize} queued"
            self._refuse(waiting, 503, f"the server is busy ({busy}); retry shortly", f"refused with 503: {busy}", {"Retry-After": "1"})

    def _expire(self, now: float) -> None:
        for waiting in [w for w in self._waiting.values() if w.deadline <= now]:
            if waiting.closing or not (waiting.buffer or waiting.fresh):
                self._forget(waiting)  # lingering done, or a kept-alive connection idle past request_timeout
                continue
            timeout = self.limits.header_timeout
            got = f"{len(waiting.buffer)} bytes received"
            message = f"the request head did not arrive within {timeout:g} s ({got}); send the request line and headers at once"
            self._refuse(waiting, 408, message, f"closed with 408: the request head did not arrive within {timeout:g} s ({got})")

    def _refuse(self, waiting: Waiting, status: int, message: str, what: str, headers: dict[str, str] | None = None) -> None:
        """Answer from the event loop, then linger: drain input until the client closes, so it reads the answer."""
        self._log_drop(waiting, what)
        if not self._send_quietly(waiting.sock, refusal_bytes(status, message, headers)):
            self._forget(waiting)
            return
        waiting.closing, waiting.buffer, waiting.deadline = True, bytearray(), time.monotonic() + LINGER_S
        if waiting.sock not in self._waiting:
            self._waiting[waiting.sock] = waiting
            self._selector.register(waiting.sock, selectors.EVENT_READ, waiting)

    def _send_quietly(self, sock: socket.socket, data: bytes) -> bool:
        try:
            sock.setblocking(False)
            sock.send(data)  # a few hundred bytes: the socket's send buffer takes them whole
            sock.shutdown(socket.SHUT_WR)
        except OSError:
            return False
        return True

    def _log_drop(self, waiting: Waiting, what: str) -> None:
        self.drop_log(f"client {client_name(waiting.address)} {request_line(waiting.buffer)}: {what}")

    def _forget(self, waiting: Waiting, close: bool = True) -> None:
        self._waiting.pop(waiting.sock, None)
        try:
            self._selector.unregister(waiting.sock)
        except (KeyError, ValueError):
            pass
        if close:
            waiting.sock.close()

    # --- the workers -----------------------------------------------------------------------------------

    def _serve(self, accepted: Accepted) -> None:
        """One request on a worker thread; a kept-alive connection then goes back to the event loop."""
        sock, handler = accepted.sock, None
        try:
            sock.setblocking(True)
            sock.settimeout(self.request_timeout)
            handler = Handler(sock, accepted.address, self, accepted.data)
        except Exception:  # a bug must cost one connection, never a worker
            log(f"client {client_name(accepted.address)}: the connection failed:\n{traceback.format_exc()}")
        if handler is not None and not handler.close_connection and not self._stop.is_set():
            self._returned.append((sock, accepted.address, handler.reader.leftover()))
            self._wake()
            return
        try:
            sock.shutdown(socket.SHUT_WR)
        except OSError:
            pass
        sock.close()


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: ReferenceHTTPServer  # type: ignore[assignment]  # not a socketserver.BaseServer: see ReferenceHTTPServer
    responded = False
    phase = "sending its request"
    dropped_logged = False

    def __init__(self, sock: socket.socket, address: Any, server: ReferenceHTTPServer, prefix: bytes):
        self.prefix = prefix
        super().__init__(sock, address, server)  # type: ignore[arg-type]

    def setup(self) -> None:
        self.connection = self.request
        self.connection.settimeout(self.server.request_timeout)  # every socket read and write; a stalled client frees its thread
        self.reader = SocketReader(self.connection, self.prefix)
        self.rfile = self.reader  # type: ignore[assignment]
        self.wfile = SocketWriter(self.connection)  # type: ignore[assignment]

    def handle(self) -> None:
        """One request; the server hands a kept-alive connection back to its event loop for the next head."""
        self.close_connection = True
        try:
            self.handle_one_request()
        except (ConnectionError, TimeoutError) as exc:  # the head arrived whole, so this is the stdlib's own error reply failing
            self._dropped(f"went away ({exc})")
            self.close_connection = True

    def finish(self) -> None:
        pass  # the server closes the connection, or keeps it for the next request

    @property
    def who(self) -> str:
        return client_name(self.client_address)

    def _dropped(self, what: str) -> None:
        """One log line per dropped client: who, which request, what happened (only the first cause is logged)."""
        if self.dropped_logged:
            return
        self.dropped_logged = True
        request = f"{self.command} {urlsplit(self.path).path}" if getattr(self, "command", None) else "(no request line)"
        self.server.drop_log(f"client {self.who} {request_line(request.encode('latin-1', 'replace'))}: {what}")

    def log_message(self, format: str, *args: Any) -> None:
        pass  # one line per request would drown the job log; generate() logs its own summary

    # --- sending ---------------------------------------------------------------------------------------

    def _send_bytes(self, status: int, data: bytes, content_type: str | None, close: bool = False, headers: dict[str, str] | None = None) -> None:
        self.send_response(status)
        if content_type:
            self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        if close or self.close_connection:
            self.close_connection = True
            self.send_header("Connection", "close")
        self.phase = "reading its reply"
        self.end_headers()
        self.responded = True
        if self.command != "HEAD":
            self.wfile.write(data)

    def _send_json(self, status: int, payload: Any, close: bool = False, headers: dict[str, str] | None = None) -> None:
        self._send_bytes(status, json.dumps(payload).encode(), "application/json", close, headers)

    def _send_empty(self, status: int) -> None:
        self._send_bytes(status, b"", None)

    def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
        """The stdlib calls this for a bad request line, oversized headers or an unknown method: answer in JSON, 4xx."""
        if self.request_version == "HTTP/0.9":
            self.request_version = "HTTP/1.1"  # so a status line goes out even for a garbled request line
        reason = message or HTTPStatus(code).phrase
        payload = error_body(code, f"{reason}: {explain}" if explain else reason)
        if code == HTTPStatus.NOT_IMPLEMENTED:  # an unknown method: what FastAPI answers for one
            code, payload = HTTPStatus.METHOD_NOT_ALLOWED, dict(METHOD_NOT_ALLOWED)
        elif code == HTTPStatus.HTTP_VERSION_NOT_SUPPORTED:  # the client's mistake, so a 4xx
            code, payload = HTTPStatus.BAD_REQUEST, error_body(400, f"{reason}: send HTTP/1.0 or HTTP/1.1")
        try:
            self._send_json(code, payload, close=True)
        except OSError:
            self.close_connection = True

    def _start_sse(self) -> None:
        self.phase = "reading its streamed reply"
        self.send_response(HTTPStatus.OK)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        self.responded = True

    def _write_chunk(self, data: bytes) -> None:
        try:
            self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
            self.wfile.flush()
        except OSError as exc:  # broken pipe, reset, or a client that stopped reading past the socket timeout
            raise ClientGone(str(exc)) from None

    def _send_event(self, payload: Any) -> None:
        data = payload if isinstance(payload, str) else json.dumps(payload)
        self._write_chunk(f"data: {data}\n\n".encode())

    def _end_sse(self) -> None:
        self._send_event("[DONE]")
        self._write_chunk(b"")  # the zero-length chunk ends the chunked body

    # --- reading ---------------------------------------------------------------------------------------

    def _read_body(self) -> bytes:
        encoding = self.headers.get("Transfer-Encoding")
        lengths = self.headers.get_all("Content-Length") or []
        if encoding is not None:
            if lengths:
                raise HttpError(400, "both Transfer-Encoding and Content-Length are set; send one", close=True)
            if encoding.strip().lower() != "chunked":
                raise HttpError(400, f"Transfer-Encoding {encoding[:40]!r} is not supported; send chunked or a Content-Length", close=True)
            return self._read_chunked()
        if not lengths:
            return b""
        length = parse_content_length(lengths)
        limit = self.server.max_body_bytes
        if length > limit:
            raise HttpError(413, f"the body ({length} bytes) is larger than this server's limit of {limit} bytes", close=True, drain=length)
        return self._read_exact(length, time.monotonic() + self.server.request_timeout)

    def _read_exact(self, length: int, deadline: float) -> bytes:
        data = bytearray()
        while len(data) < length:
            if time.monotonic() > deadline:
                raise self._timeout(len(data), length)
            try:
                chunk = self.rfile.read1(min(length - len(data), 1 << 16))
            except TimeoutError:
                raise self._timeout(len(data), length) from None
            if not chunk:
                ended = f"the connection ended after {len(data)} of {length} body bytes"
                raise HttpError(400, ended, close=True, dropped=f"closed the connection mid-body: {ended}")
            data += chunk
        return bytes(data)

    def _timeout(self, received: int, expected: int | str) -> HttpError:
        late = f"the body did not arrive within {self.server.request_timeout:g} s ({received} of {expected} bytes received)"
        return HttpError(408, late, close=True, dropped=f"closed with 408: {late}")

    def _read_chunked(self) -> bytes:
        deadline = time.monotonic() + self.server.request_timeout
        body = bytearray()
        while True:
            size = self._chunk_size(len(body))
            if size == 0:
                break
            if len(body) + size > self.server.max_body_bytes:
                raise HttpError(413, f"the chunked body exceeds this server's limit of {self.server.max_body_bytes} bytes", close=True)
            body += self._read_exact(size, deadline)
            if self._readline(len(body)) not in (b"\r\n", b"\n"):
                raise HttpError(400, "a chunk of the body is not followed by CRLF", close=True)
        for _ in range(64):  # trailer fields, ignored, up to the blank line
            if self._readline(len(body)) in (b"\r\n", b"\n", b""):
                break
        return bytes(body)

    def _readline(self, received: int) -> bytes:
        try:
            return self.rfile.readline(1026)
        except TimeoutError:
            raise self._timeout(received, "chunked") from None

    def _chunk_size(self, received: int) -> int:
        line = self._readline(received)
        size = line.split(b";")[0].strip()
        if not line.endswith(b"\n") or not re.fullmatch(rb"[0-9a-fA-F]{1,15}", size):
            raise HttpError(400, f"malformed chunk size line {line[:40]!r}", close=True)
        return int(size, 16)

    def _drain(self, length: int) -> None:
        """Read and drop an unread body (bounded) so closing does not reset the connection before the client reads the reply."""
        remaining, deadline = min(length, DRAIN_LIMIT_BYTES), time.monotonic() + 2.0
        try:
            self.connection.settimeout(1.0)
            while remaining > 0 and time.monotonic() < deadline:
                chunk = self.rfile.read1(min(remaining, 1 << 16))
                if not chunk:
                    break
                remaining -= len(chunk)
        except OSError:
            pass

    # --- dispatch --------------------------------------------------------------------------------------

    def do_GET(self) -> None:
        self._dispatch()

    do_POST = do_PUT = do_DELETE = do_PATCH = do_HEAD = do_OPTIONS = do_GET

    def _dispatch(self) -> None:
        self.responded = False
        try:
            self.phase = "sending its request body"
            raw = self._read_body()
            self.phase = "waiting for its reply"
            self._route(urlsplit(self.path).path)(raw)
        except HttpError as exc:
            self._refuse(exc)
        except ClientGone as exc:
            self._dropped(f"went away mid-stream ({exc}); the generation was abandoned")
            self.close_connection = True
        except (ConnectionError, TimeoutError) as exc:  # the client reset, or stalled past request_timeout
            self._dropped(f"went away while {self.phase} ({exc})")
            self.close_connection = True
        except Exception:  # a bug must cost one request, never the server
            log(f"{self.command} {self.path} failed:\n{traceback.format_exc()}")
            self._refuse(HttpError(500, "internal error in the reference engine (traceback in its log)", err_type="InternalServerError", close=True))

    def _refuse(self, exc: HttpError) -> None:
        if self.responded:  # mid-stream: the status line is gone, only closing is left
            self.close_connection = True
            return
        if exc.dropped:
            self._dropped(exc.dropped)
        try:
            self._send_json(exc.status, exc.payload, close=exc.close, headers=exc.headers)
        except OSError as error:
            self._dropped(f"went away before its {exc.status} reply was sent ({error})")
            self.close_connection = True
            return
        if exc.drain:
            self._drain(exc.drain)

    def _route(self, path: str) -> Callable[[bytes], None]:
        methods = ROUTES.get(path) or ({"GET": "model"} if path.startswith("/v1/models/") else None)
        if path == "/metrics" and self.server.metrics is None:
            methods = None  # SGLang mounts /metrics only with --enable-metrics
        if methods is None:
            raise HttpError(404, payload=dict(NOT_FOUND))
        name = methods.get(self.command)
        if name is None:
            raise HttpError(405, payload=dict(METHOD_NOT_ALLOWED), headers={"Allow": ", ".join(methods)})
        return getattr(self, f"route_{name}")

    def _engine(self) -> Engine:
        engine = self.server.engine
        if engine is None:
            raise HttpError(503, "the model is still loading; retry when /health_generate answers 200")
        return engine

    # --- native routes ---------------------------------------------------------------------------------

    def route_health(self, _raw: bytes) -> None:
        self._send_empty(HTTPStatus.OK if self.server.engine is not None else HTTPStatus.SERVICE_UNAVAILABLE)

    def route_metrics(self, _raw: bytes) -> None:
        metrics, engine = self.server.metrics, self.server.engine
        assert metrics is not None  # _route answers 404 without --enable-metrics
        self._send_bytes(HTTPStatus.OK, metrics.render(metric_gauges(self.server.info, engine)).encode(), serving_metrics.CONTENT_TYPE)

    def route_server_info(self, _raw: bytes) -> None:
        engine = self.server.engine
        info = dict(self.server.info)
        info["status"] = "ready" if engine is not None else "loading"
        info["internal_states"] = [engine.internal_state()] if engine is not None else []
        self._send_json(HTTPStatus.OK, info)

    def route_model_info(self, _raw: bytes) -> None:
        info, engine = self.server.info, self.server.engine
        model_type = getattr(getattr(engine.target.model, "config", None), "model_type", None) if engine else None
        self._send_json(
            HTTPStatus.OK,
            {
                "model_path": info["model_path"],
                "tokenizer_path": info["tokenizer_path"],
                "is_generation": True,
                "preferred_sampling_params": None,
                "weight_version": WEIGHT_VERSION,
                "has_image_understanding": False,
                "has_audio_understanding": False,
                "model_type": model_type,
                "architectures": [info["architecture"]],
                "served_model_name": info["served_model_name"],
            },
        )

    def route_flush_cache(self, _raw: bytes) -> None:
        flushed = self._engine().try_flush()
        self._send_bytes(HTTPStatus.OK if flushed else HTTPStatus.BAD_REQUEST, FLUSH_BODY.encode(), "text/plain; charset=utf-8")

    def route_generate(self, raw: bytes) -> None:
        engine = self._engine()
        body = parse_json(raw)
        try:
            request = parse_generate(body, engine)
        except RequestError as exc:
            self._send_json(HTTPStatus.BAD_REQUEST, {"error": {"message": str(exc)}})
            return
        if request.stream:
            self._stream(engine, request, lambda out: [out], native_errors=True)
            return
        gen = self._run(engine, request)
        self._send_json(HTTPStatus.OK, self._output(engine, request, gen))

    def _output(self, engine: Engine, request: NativeRequest, gen: Generation) -> dict[str, Any]:
        """The engine's {text, output_ids, meta_info}, plus SGLang's top-level prompt_token_ids when asked for."""
        out = engine.output(gen)
        if request.return_prompt_token_ids:
            out["prompt_token_ids"] = list(request.spec.input_ids)
        return out

    def _run(self, engine: Engine, request: NativeRequest, on_progress=None) -> Generation:
        gen = engine.run(request.spec, request.rid, on_progress)
        engine.log_generation(gen)
        if self.server.metrics is not None:
            self.server.metrics.finished(len(request.spec.input_ids), len(gen.output_ids), gen.verify_ct, gen.latency or 0.0, request.stream)
        return gen

    def _stream(
        self, engine: Engine, request: NativeRequest, to_events: Callable[[dict], list], trailer: Callable[[], list] = list, native_errors: bool = False
    ) -> None:
        """SSE: one event group per emission, the final state exactly once, then [DONE]."""
        self._start_sse()
        sent_final = False

        def on_progress(gen: Generation) -> None:
            nonlocal sent_final
            for event in to_events(self._output(engine, request, gen)):
                self._send_event(event)
            sent_final = gen.finish is not None

        try:
            gen = self._run(engine, request, on_progress)
            if not sent_final:  # nothing was emitted (max_new_tokens 0): the final state still goes out once
                on_progress(gen)
            for event in trailer():
                self._send_event(event)
        except ClientGone:
            if self.server.metrics is not None:
                self.server.metrics.abandoned()
            raise
        except Exception as exc:  # mid-stream there is no status code left: SGLang sends an error event
            log(f"generate {request.rid} failed mid-stream:\n{traceback.format_exc()}")
            message = str(exc) or type(exc).__name__
            self._send_event({"error": {"message": message}} if native_errors else error_body(500, message, "InternalServerError"))
        self._end_sse()

    # --- OpenAI routes ---------------------------------------------------------------------------------

    def _openai_body(self, raw: bytes) -> Any:
        media_type = (self.headers.get("Content-Type") or "").split(";", 1)[0].strip().lower()
        if media_type != "application/json":
            raise HttpError(400, "Unsupported Media Type: Only 'application/json' is allowed")
        return parse_json(raw)

    def _openai_request(self, engine: Engine, convert: Callable[[], tuple[dict, dict]]) -> tuple[NativeRequest, dict] | None:
        try:
            native, options = convert()
            return parse_generate(native, engine), options
        except OpenAIRequestError as exc:
            self._send_json(HTTPStatus.BAD_REQUEST, error_body(400, str(exc), exc.err_type))
        except RequestError as exc:
            self._send_json(HTTPStatus.BAD_REQUEST, error_body(400, str(exc), "BadRequestError"))
        return None

    def route_models(self, _raw: bytes) -> None:
        engine = self._engine()
        self._send_json(HTTPStatus.OK, openai_api.model_list(self.server.info["served_model_name"], engine.context_len))

    def route_model(self, _raw: bytes) -> None:
        engine, name = self._engine(), self.server.info["served_model_name"]
        wanted = unquote(urlsplit(self.path).path[len("/v1/models/") :])  # clients quote the id (a path: %2F for /)
        if wanted != name:
            self._send_json(HTTPStatus.NOT_FOUND, openai_api.model_not_found(wanted))
            return
        self._send_json(HTTPStatus.OK, openai_api.model_card(name, engine.context_len))

    def route_completions(self, raw: bytes) -> None:
        engine = self._engine()
        body = self._openai_body(raw)
        parsed = self._openai_request(engine, lambda: openai_api.completion_to_native(body))
        if parsed is None:
            return
        request, options = parsed
        echo = engine.decode(request.spec.input_ids) if options["echo"] else ""
        if request.stream:
            formatter = openai_api.StreamFormatter(options, chat=False, echo_text=echo)
            self._stream(engine, request, formatter.chunks, formatter.trailer)
            return
        gen = self._run(engine, request)
        self._send_json(HTTPStatus.OK, openai_api.completion_response(self._output(engine, request, gen), options, echo))

    def route_chat(self, raw: bytes) -> None:
        engine = self._engine()
        body = self._openai_body(raw)
        parsed = self._openai_request(engine, lambda: openai_api.chat_to_native(body, engine.chat_prompt))
        if parsed is None:
            return
        request, options = parsed
        if request.stream:
            formatter = openai_api.StreamFormatter(options, chat=True)
            self._stream(engine, request, formatter.chunks, formatter.trailer)
            return
        gen = self._run(engine, request)
        self._send_json(HTTPStatus.OK, openai_api.chat_response(self._output(engine, request, gen), options))


def metric_gauges(info: dict[str, Any], engine: Engine | None) -> dict[str, tuple[str, float | None]]:
    """SGLang's gauges this engine has values for: speculative settings and the accept length/rate since the last flush."""
    gauges: dict[str, tuple[str, float | None]] = {
        "sglang:num_running_reqs": ("The number of running requests.", float(engine is not None and engine.lock.locked())),
    }
    if info.get("speculative_algorithm"):
        average = engine.avg_accept_length() if engine is not None else None
        steps = info["speculative_num_steps"]
        gauges["sglang:spec_accept_length"] = ("Mean acceptance length of speculative decoding (accepted drafts + bonus token per forward).", average)
        rate = (average - 1) / steps if average is not None and steps else None
        gauges["sglang:spec_accept_rate"] = ("Speculative acceptance rate (`accepted drafts / proposed drafts` in batch).", rate)
        gauges["sglang:spec_num_steps"] = ("Currently active speculative_num_steps.", float(steps))
        gauges["sglang:spec_num_draft_tokens"] = ("Currently active speculative_num_draft_tokens (decouples from steps under topk>1).", float(steps + 1))
    return gauges


# --------------------------------------------------------------------------- main


def server_info(profile, args, engine_path: str) -> dict[str, Any]:
    speculative = not args.no_speculation
    steps = args.num_steps or profile.serve.num_steps
    return {
        "engine": "reference",
        "model_path": profile.target.path,
        # SGLang's default served name is the model path; here the resolved dir (builtin:tiny names no directory),
        # set once the target has loaded, like tokenizer_path: where AutoTokenizer loads the served tokenizer from.
        "served_model_name": args.served_model_name or profile.target.path,
        "tokenizer_path": None,
        "resolved_model_path": engine_path,
        "architecture": profile.target.architecture,
        "speculative_algorithm": "EAGLE3" if speculative else None,
        "speculative_num_steps": steps if speculative else None,
        "speculative_eagle_topk": 1 if speculative else None,
        "speculative_num_draft_tokens": steps + 1 if speculative else None,
        "speculative_draft_model_path": args.draft if speculative else None,
        "feed": args.feed if speculative else None,
        "dtype": profile.target.dtype,
        "tp_size": 1,
        "host": args.host,
        "port": args.port,
        "weight_version": WEIGHT_VERSION,
        "max_body_bytes": args.max_body_bytes,
        "request_timeout": args.request_timeout,
        "header_timeout": args.header_timeout,
        "max_connections": args.max_connections,
        "max_waiting": args.max_waiting,
        "enable_metrics": args.enable_metrics,
        "version": "eagle3-console-reference",
    }


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m backend.serve.reference.server", description="SGLang-compatible HTTP server over the project's speculative decoder"
    )
    parser.add_argument("--profile", required=True)
    parser.add_argument("--draft", help="draft checkpoint dir (required unless --no-speculation)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument(
        "--feed",
        choices=["aux", "last_hidden"],
        default="aux",
        help="last_hidden: hand the draft the final hidden state and skip fc, as SGLang's silent failure does",
    )
    parser.add_argument("--num-steps", type=int, help="draft steps per verify (default: the profile's)")
    parser.add_argument("--served-model-name", help="the model id /v1/models reports (default: the target's directory)")
    parser.add_argument("--no-speculation", action="store_true", help="plain target decoding (benchmark baseline)")
    parser.add_argument(
        "--device",
        default="auto",
        help="auto (cuda:0 when CUDA is available, else cpu), cpu, cuda or cuda:N; on CUDA: the [serve] dtype, static KV cache, CUDA graphs",
    )
    parser.add_argument("--static-cache", action="store_true", help="decode through the static-cache decoder on CPU too (on CUDA it always is)")
    parser.add_argument("--compile-steps", action="store_true", help="torch.compile the static decoder's steps before capturing them (CUDA)")
    parser.add_argument("--max-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES, help="larger request bodies are refused with 413 (default %(default)s)")
    parser.add_argument(
        "--request-timeout",
        type=float,
        default=DEFAULT_REQUEST_TIMEOUT_S,
        help="seconds a client may stall while sending a request or reading a reply (default %(default)s)",
    )
    parser.add_argument(
        "--header-timeout",
        type=float,
        default=DEFAULT_HEADER_TIMEOUT_S,
        help="seconds a client has to send a whole request head (request line and headers) before it gets 408 (default %(default)s)",
    )
    parser.add_argument(
        "--max-connections",
        type=int,
        default=DEFAULT_MAX_CONNECTIONS,
        help="requests served at once (worker threads); 4x as many complete requests may queue, more get 503 (default %(default)s)",
    )
    parser.add_argument(
        "--max-waiting",
        type=int,
        default=DEFAULT_MAX_WAITING,
        help="open connections still sending a request head (no thread each); past it the oldest is dropped (default %(default)s)",
    )
    parser.add_argument("--enable-metrics", action="store_true", help="serve Prometheus metrics at GET /metrics (SGLang's flag and metric names)")
    args = parser.parse_args(argv)
    if not 0 < args.header_timeout < 86400 or not 1 <= args.max_connections <= 4096 or not 1 <= args.max_waiting <= 1_000_000:
        parser.error("--header-timeout must be in (0, 86400), --max-connections in 1..4096 and --max-waiting in 1..1000000")
    if not args.no_speculation and not args.draft:
        parser.error("--draft is required unless --no-speculation is given")
    if args.max_body_bytes < 1 or not 0 < args.request_timeout < 86400:
        parser.error("--max-body-bytes must be >= 1 and --request-timeout in (0, 86400)")
    return args


def fit_descriptors(limits: ConnectionLimits) -> ConnectionLimits:
    """Raise the soft open-files limit to what the limits can hold; where the hard limit is lower, fewer may wait."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    needed = limits.descriptors()
    if soft != resource.RLIM_INFINITY and soft < needed:
        target = needed if hard == resource.RLIM_INFINITY else min(needed, hard)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass
    if soft != resource.RLIM_INFINITY and soft < needed:
        waiting = max(16, limits.max_waiting - (needed - soft))
        log(f"open-files limit {soft} is below the {needed} the limits need: at most {waiting} connections may wait for a head (not {limits.max_waiting})")
        limits.max_waiting = waiting
    return limits


def main(argv: list[str] | None = None) -> int:
    from backend.profiles import ProfileError, load_profile
    from backend.serve.preflight import resolve_draft_dir

    args = parse_args(argv)
    try:
        profile = load_profile(args.profile)
    except ProfileError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.draft:
        from pathlib import Path

        args.draft = str(resolve_draft_dir(Path(args.draft).expanduser()))
    limits = fit_descriptors(ConnectionLimits(header_timeout=args.header_timeout, max_connections=args.max_connections, max_waiting=args.max_waiting))
    args.max_waiting = limits.max_waiting
    server = ReferenceHTTPServer(
        (args.host, args.port),
        server_info(profile, args, profile.target.path),
        max_body_bytes=args.max_body_bytes,
        request_timeout=args.request_timeout,
        limits=limits,
    )
    if args.enable_metrics:
        server.metrics = serving_metrics.ServingMetrics(server.info["served_model_name"])
    outcome = {"code": 0}

    def stop(signum, _frame) -> None:
        log(f"signal {signum}: shutting down")
        threading.Thread(target=server.shutdown, daemon=True).start()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)

    def load() -> None:
        started = time.monotonic()
        try:
            engine = Engine(
                profile,
                args.draft,
                args.feed,
                args.num_steps,
                speculative=not args.no_speculation,
                device=args.device,
                static_cache=True if args.static_cache else None,
                compile_steps=args.compile_steps,
            )
        except Exception:  # any load failure ends the server with the traceback in its log
            log("loading failed:\n" + traceback.format_exc())
            outcome["code"] = 1
            server.shutdown()
            return
        server.info["resolved_model_path"] = engine.target.path
        server.info["served_model_name"] = args.served_model_name or engine.target.path
        server.info["tokenizer_path"] = engine.tokenizer_path
        if server.metrics is not None:
            server.metrics.model_name = server.info["served_model_name"]
        server.engine = engine
        server.loading = False
        mode = f"EAGLE3, {engine.num_steps} steps, feed {args.feed}" if engine.speculative else "no speculation"
        mode += f"; {engine.device}, {engine.decoder_kind} decoder"
        log(f"ready in {time.monotonic() - started:.1f} s on http://{args.host}:{args.port} ({mode})")

    log(f"listening on http://{args.host}:{args.port}; loading {profile.name} target" + ("" if args.no_speculation else f" and draft {args.draft}"))
    threading.Thread(target=load, daemon=True, name="load").start()
    try:
        server.serve_forever(poll_interval=0.2)
    finally:
        server.server_close()
    log(f"exited (code {outcome['code']})")
    return outcome["code"]


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # A request thread may still be inside a torch op after shutdown; a normal interpreter exit then
    # aborts in C++ ("terminate called without an active exception", exit -6). Everything is flushed
    # and the socket closed, so end the process directly with the real exit code.
    os._exit(code)
