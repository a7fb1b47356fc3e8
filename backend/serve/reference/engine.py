"""Reference engine: the target and an optional draft behind one lock, greedy generation, and what SGLang reports for it.

Engine runs one GenerationSpec at a time through the project's speculative decoder (spec_decode.py, or the
static-cache one in static_decode.py) and reports SGLang's /generate object, meta_info and internal state. Logprobs
come from a separate target pass (LogprobTracker), so greedy output is unchanged. No HTTP here: server.py serves it.
"""

from __future__ import annotations

import math
import os
import sys
import threading
import time
import traceback
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any, Callable

from backend.serve.reference import hf_tokenizer
from backend.serve.spec_setting import verify_width
from backend.train.compile_cache import cache_file, load_artifacts, save_artifacts
from backend.train.target import load_target

WEIGHT_VERSION = "default"


def log(message: str) -> None:
    """One line of the reference server's log on stderr (the HTTP side logs through it too)."""
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
    # False: decode this request without speculation even on a speculative engine (the reference-only
    # "speculative" body field, for a same-engine baseline); a plain engine decodes plainly either way.
    speculative: bool = True


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
    first_emission: float | None = None  # seconds from the request's start to its first token (the server's side of TTFT)

    def copy(self) -> Generation:
        """This state as it is now, for another thread to report while decoding goes on (the lists copied)."""
        return replace(
            self,
            output_ids=list(self.output_ids),
            accepted_per_round=list(self.accepted_per_round),
            output_logprobs=list(self.output_logprobs),
            output_top_logprobs=list(self.output_top_logprobs),
        )


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
    """Target + optional draft on one decode thread behind one lock, with SGLang-style cumulative acceptance counters."""

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
        attention: str = "auto",
        linear: str = "auto",
        branches: int = 1,
        topk: int = 1,
        num_draft_tokens: int | None = None,
    ):
        """device: "auto"/None picks cuda:0 when CUDA is available, else cpu. On CUDA the target loads in the profile's
        [serve] dtype and decodes through the static-cache decoder under CUDA graphs; on CPU it loads as it always
        did (the profile's target dtype) and decodes eagerly, unless static_cache=True asks for the static decoder.
        attention: how the static decoder's target attends (static_decode.ATTENTION_CHOICES; auto: the Triton
        kernels on CUDA where they run, else SDPA); linear: how its steps multiply by the weights
        (static_decode.LINEAR_CHOICES; auto: the Triton kernel on CUDA where it runs, else F.linear); branches: the
        static decoder's first-step branches (1: a chain; K > 1 needs the static decoder); topk > 1: SGLang's EAGLE tree
        of num_draft_tokens (static decoder too)."""
        import torch

        if speculative and draft_dir is None:
            raise ValueError("a speculative engine needs a draft checkpoint directory; none was given, nothing was loaded")
        # One thread loads, warms up and runs every generation. A CUDA call from a thread that never made one costs
        # 45-90 ms more to the first token on an H200 (benchmarks/probe_first_token.py: 60-108 ms from a new thread,
        # 14-32 ms from the loading one, whatever the prompt width), and the HTTP server gives each connection a thread.
        self._decode_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine-decode")

        def load() -> None:
            with torch.no_grad():  # loading and the warm-up decode
                kernels = {"attention": attention, "linear": linear, "branches": branches, "topk": topk, "num_draft_tokens": num_draft_tokens}
                self._load(profile, draft_dir, feed, num_steps, speculative, device, static_cache, compile_steps, kernels)

        try:
            self._decode_thread.submit(load).result()
        except BaseException:
            self._decode_thread.shutdown(wait=False)
            raise

    def _load(self, profile, draft_dir, feed, num_steps, speculative, device, static_cache, compile_steps, kernels: dict[str, Any]) -> None:
        import torch

        from backend.serve.reference.static_decode import ATTENTION_CHOICES, LINEAR_CHOICES

        for name, choices in (("attention", ATTENTION_CHOICES), ("linear", LINEAR_CHOICES)):
            if kernels[name] not in choices:
                raise ValueError(f"{name} {kernels[name]!r}: expected one of {', '.join(choices)}; nothing was loaded")
        if kernels["branches"] < 1:
            raise ValueError(f"branches must be >= 1, got {kernels['branches']}; nothing was loaded")

        self.profile = profile
        self.speculative = speculative
        self.draft_dir = draft_dir
        self.device = self.resolve_device(device)
        on_cuda = self.device.type == "cuda"
        static_cache = on_cuda if static_cache is None else static_cache
        self.branches = kernels["branches"]
        if self.branches > 1 and not static_cache:  # before the target loads
            raise ValueError(f"branches {self.branches} needs the static-cache decoder (on CPU: static_cache / --static-cache); nothing was loaded")
        if kernels["topk"] > 1 and not static_cache:
            raise ValueError(
                f"an EAGLE tree (topk {kernels['topk']}) needs the static-cache decoder (on CPU: static_cache / --static-cache); nothing was loaded"
            )
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
        self.decoder = self._build_decoder(draft, kwargs, static_cache, compile_steps, kernels)
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

    def _build_decoder(self, draft, kwargs: dict[str, Any], static_cache: bool, compile_steps: bool, kernels: dict[str, Any]):
        """The static-cache decoder when asked (the default on CUDA) and the target is one it runs; else the eager one."""
        self.decoder_kind = "eager"
        if static_cache:
            from backend.serve.reference.static_decode import KernelUnavailable, StaticDecoder, StaticUnsupported

            # EAGLE3_COMPILE_CACHE: compiled steps from an earlier machine, and this one's for the next (a file of its own)
            compile_cache = cache_file(os.environ, "serve") if compile_steps else None
            try:
                if compile_cache is not None:
                    load_artifacts(compile_cache, log)
                # + one verify's width: the server admits prompt + max_new_tokens <= context_len, a verify writes its rows past it
                width = verify_width(self.num_steps, kernels["topk"], kernels["num_draft_tokens"], kernels["branches"])
                decoder = streaming_decoder_class(StaticDecoder)(
                    self.target.model, draft, max_len=self.context_len + width, compile=compile_steps, **kernels, **kwargs
                )
                self._warm(decoder)
                if compile_cache is not None:
                    save_artifacts(compile_cache, log)
                self.decoder_kind = "static-cuda-graphs" if decoder.use_graphs else "static"
                return decoder
            except KernelUnavailable as exc:  # asked for by name: an error, not a quiet fallback to eager decoding
                raise KernelUnavailable(f"{exc}; nothing is served") from None
            except Exception as exc:
                if kernels["branches"] > 1 or kernels["topk"] > 1:  # only the static decoder branches: a quiet chain would serve what was not asked
                    shape = f"topk {kernels['topk']}" if kernels["topk"] > 1 else f"branches {kernels['branches']}"
                    raise RuntimeError(f"{shape} needs the static decoder, which failed: {exc}; nothing is served") from exc
                if isinstance(exc, StaticUnsupported):
                    log(f"{exc}; decoding eagerly instead")
                else:  # a capture that fails here would fail every request: serve eagerly, say why
                    log("the static-cache decoder failed its warm-up; decoding eagerly instead:\n" + traceback.format_exc(limit=6))
        return streaming_decoder_class()(self.target.model, draft, **kwargs)

    def _warm(self, decoder) -> None:
        """Every padded prompt width and every step at every cache prefix once (static decoder on CUDA: their graphs are
        captured now, not by the first request that reaches them), then one short plain (and speculative) decode."""
        prompt = [0, 1, 2, 3]
        decoder.warm_prefill()
        started = time.perf_counter()
        if steps := decoder.warm_steps():
            log(f"captured {steps} decode steps at cache prefixes {decoder.buckets} in {time.perf_counter() - started:.1f} s")
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
        return self.submit(spec, rid, on_progress).result()

    def submit(self, spec: GenerationSpec, rid: str, on_progress: Callable[[Generation], None] | None = None) -> Future[Generation]:
        """run() without waiting: on_progress is called on the decode thread, between the steps, so it should only hand
        the state over (Generation.copy); an exception it raises ends the generation."""
        gen = Generation(spec=spec, rid=rid, started=time.perf_counter())  # waiting for the decode thread counts
        return self._decode_thread.submit(self._run, gen, on_progress)

    def _run(self, gen: Generation, on_progress: Callable[[Generation], None] | None) -> Generation:
        spec = gen.spec
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
        self._count(spec, result)
        return gen

    def speculates(self, spec: GenerationSpec) -> bool:
        """Whether this request runs speculatively: on a speculative engine, unless it asked for plain decoding."""
        return self.speculative and spec.speculative

    def _decode(self, spec: GenerationSpec, emitted: Callable[[Any], None]):
        decoder = self.decoder
        decoder.eos, decoder.on_emit = set(spec.stop_token_ids), emitted
        decoder.stop_string_hit = (lambda ids: self._stop_string(spec, ids) is not None) if spec.stop_strings else None
        try:
            if self.speculates(spec):
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
        if new and not gen.output_ids:
            gen.first_emission = time.perf_counter() - gen.started
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

    def _count(self, spec: GenerationSpec, result) -> None:
        """Every request counts in requests_since_flush; only speculative ones in the acceptance counters."""
        with self.counters_lock:
            self.requests += 1
            if not self.speculates(spec):
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
        if not self.speculates(gen.spec) or gen.verify_ct == 0:
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
        spec = f", verify {gen.verify_ct}, accept len {meta.get('spec_accept_length', 0):.2f}" if self.speculates(gen.spec) else ""
        if self.speculative and not gen.spec.speculative:
            spec = ", plain decode (asked per request)"
        first = f", first token after {1000 * gen.first_emission:.1f} ms" if gen.first_emission is not None else ""
        log(f"generate {gen.rid}: prompt {len(gen.spec.input_ids)} tokens, completion {len(gen.output_ids)}{spec}, {gen.latency or 0:.2f} s{first}")
