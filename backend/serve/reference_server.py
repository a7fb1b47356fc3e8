"""Reference engine: an HTTP server speaking SGLang's wire format over the project's own speculative decoder.

python -m backend.serve.reference_server --profile P --draft DIR --port N [--host 127.0.0.1]
       [--feed aux|last_hidden] [--num-steps K] [--no-speculation]

Greedy only (temperature 0). One generation at a time (a lock around the model); HTTP handling is threaded so
/health and /get_server_info answer while a generation runs. Outputs equal plain greedy decoding of the target.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time
import traceback
import uuid
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable

DEFAULT_MAX_NEW_TOKENS = 128  # SGLang's default
# Sampling parameters that would change greedy output; refused unless left at their neutral value.
NEUTRAL_SAMPLING = {"top_k": (-1, 1, None), "top_p": (1.0, 1, None), "min_p": (0.0, 0, None),
                    "repetition_penalty": (1.0, 1, None), "frequency_penalty": (0.0, 0, None),
                    "presence_penalty": (0.0, 0, None), "n": (1, None), "stop": (None, [], ""),
                    "stop_token_ids": (None, []), "min_new_tokens": (0, None)}
IGNORED_SAMPLING = ("ignore_eos", "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim")


class RequestError(ValueError):
    """A /generate body this engine will not serve; the message goes back with HTTP 400."""


def log(message: str) -> None:
    print(f"[reference_server {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------- the engine

def streaming_decoder_class():
    """SpecDecoder that reports each verify round's emitted tokens to a per-call callback (for SSE streaming)."""
    import torch

    from backend.serve.spec_decode import SpecDecoder

    class StreamingDecoder(SpecDecoder):
        on_tokens: Callable[[list[int]], None] | None = None

        def _emit(self, result, tokens, max_new_tokens=None):
            before = len(result.output_ids)
            super()._emit(result, tokens, max_new_tokens)
            if self.on_tokens is not None and len(result.output_ids) > before:
                self.on_tokens(result.output_ids[before:])

        @torch.no_grad()
        def stream_plain(self, input_ids, max_new_tokens: int, on_tokens: Callable[[list[int]], None]) -> list[int]:
            """Plain greedy decoding, one callback per token (the same loop as plain_generate)."""
            ids = self._prompt(input_ids)
            logits, _, cache = self.target.forward(ids, None, hidden_states=False)
            output: list[int] = []
            while len(output) < max_new_tokens:
                token = int(logits[0, -1].argmax())
                output.append(token)
                on_tokens([token])
                if token in self.eos or len(output) == max_new_tokens:
                    break
                logits, _, cache = self.target.forward(torch.tensor([[token]], device=ids.device), cache, hidden_states=False)
            return output

    return StreamingDecoder


class Engine:
    """Target + optional draft behind one lock, with SGLang-style cumulative acceptance counters."""

    def __init__(self, profile, draft_dir: str | None, feed: str, num_steps: int | None, speculative: bool):
        import torch

        from backend.train.target import load_target

        torch.set_grad_enabled(False)
        self.profile = profile
        self.speculative = speculative
        self.draft_dir = draft_dir
        self.target = load_target(profile)
        self.tokenizer = self.target.tokenizer
        self.num_steps = num_steps or profile.serve.num_steps
        self.feed = feed
        self.expected_feature_width = None
        draft = None
        aux_ids = list(profile.target.aux_layer_ids)
        if speculative:
            from backend.train.checkpoint import load_checkpoint

            draft, config, _meta, _state = load_checkpoint(draft_dir, target_embedding=self.target.embed_weight())
            draft.eval()
            self.expected_feature_width = config.aux_width
            aux_ids = list(config.aux_layer_ids)
        self.decoder = streaming_decoder_class()(self.target.model, draft, aux_layer_ids=aux_ids,
                                                 num_steps=self.num_steps, feed=feed,
                                                 eos_token_id=getattr(self.tokenizer, "eos_token_id", None))
        self.lock = threading.Lock()
        self.counters_lock = threading.Lock()
        self.last_features: dict[str, Any] = {}
        self.flush()

    def flush(self) -> None:
        with self.counters_lock:
            self.verify_tokens = 0  # tokens emitted by verify rounds (accepted drafts + the bonus token)
            self.verify_ct = 0
            self.requests = 0

    def avg_accept_length(self) -> float | None:
        with self.counters_lock:
            return self.verify_tokens / self.verify_ct if self.verify_ct else None

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text))

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def generate(self, input_ids: list[int], max_new_tokens: int,
                 on_tokens: Callable[[list[int]], None] | None = None) -> dict[str, Any]:
        """Greedy continuation; on_tokens(new_ids) is called as tokens are produced (per verify round)."""
        with self.lock:
            if not self.speculative:
                if on_tokens is None:
                    output = self.decoder.plain_generate(input_ids, max_new_tokens)
                else:
                    output = self.decoder.stream_plain(input_ids, max_new_tokens, on_tokens)
                with self.counters_lock:
                    self.requests += 1
                return {"output_ids": [int(t) for t in output], "verify_ct": 0}
            self.decoder.on_tokens = on_tokens
            try:
                result = self.decoder.generate(input_ids, max_new_tokens)
            finally:
                self.decoder.on_tokens = None
        self._count(result)
        return {"output_ids": [int(t) for t in result.output_ids], "verify_ct": result.verify_ct}

    def _count(self, result) -> None:
        with self.counters_lock:
            self.requests += 1
            self.verify_ct += result.verify_ct
            self.verify_tokens += sum(int(a) + 1 for a in result.accepted_per_round)
            self.last_features = {"feature_width": result.feature_width, "fc_applied": result.fc_applied,
                                  "feature_detail": result.feature_source}

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


# --------------------------------------------------------------------------- request parsing

def parse_generate(body: Any, engine: Engine) -> tuple[list[int], int, bool]:
    if not isinstance(body, dict):
        raise RequestError("the body must be a JSON object")
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
        if not isinstance(input_ids, list) or not all(isinstance(i, int) for i in input_ids):
            raise RequestError("'input_ids' must be a list of ints")
        vocab = engine.target.vocab_size
        if any(not 0 <= i < vocab for i in input_ids):
            raise RequestError(f"'input_ids' holds ids outside the target vocab 0..{vocab - 1}")
        ids = list(input_ids)
    if not ids:
        raise RequestError("the prompt is empty")
    params = body.get("sampling_params") or {}
    if not isinstance(params, dict):
        raise RequestError("'sampling_params' must be an object")
    temperature = params.get("temperature", 1.0)  # SGLang's default is 1.0, i.e. sampling
    if temperature != 0:
        raise RequestError(f"sampling_params.temperature is {temperature!r}: the reference engine decodes greedily only; "
                           "send temperature 0")
    for key, value in params.items():
        if key in NEUTRAL_SAMPLING and value not in NEUTRAL_SAMPLING[key]:
            raise RequestError(f"sampling_params.{key}={value!r} is not supported by the reference engine (greedy only)")
        if key not in NEUTRAL_SAMPLING and key not in IGNORED_SAMPLING and key not in ("temperature", "max_new_tokens"):
            raise RequestError(f"sampling_params.{key} is not supported by the reference engine")
    max_new = params.get("max_new_tokens", DEFAULT_MAX_NEW_TOKENS)
    if not isinstance(max_new, int) or max_new < 1:
        raise RequestError(f"sampling_params.max_new_tokens must be a positive int, got {max_new!r}")
    limit = engine.profile.draft.max_position_embeddings
    if len(ids) + max_new > limit:
        raise RequestError(f"prompt ({len(ids)}) + max_new_tokens ({max_new}) exceeds the context length {limit}")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise RequestError("'stream' must be true or false")
    return ids, max_new, stream


# --------------------------------------------------------------------------- HTTP

class ReferenceHTTPServer(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, address, info: dict[str, Any]):
        super().__init__(address, Handler)
        self.engine: Engine | None = None
        self.info = info
        self.loading = True


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: ReferenceHTTPServer

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - stdlib signature
        pass  # one line per request would drown the job log; generate() logs its own summary

    def _send_json(self, status: int, payload: Any) -> None:
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _send_empty(self, status: int) -> None:
        self.send_response(status)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def _error(self, status: int, message: str) -> None:
        self._send_json(status, {"error": {"message": message, "code": status}})

    def _read_body(self) -> Any:
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length else b""
        if not raw:
            return {}
        try:
            return json.loads(raw)
        except json.JSONDecodeError as exc:
            raise RequestError(f"the body is not JSON: {exc.msg}") from None

    def do_GET(self) -> None:  # noqa: N802 - stdlib name
        path = self.path.split("?")[0]
        engine = self.server.engine
        if path in ("/health", "/health_generate"):
            self._send_empty(HTTPStatus.OK if engine is not None else HTTPStatus.SERVICE_UNAVAILABLE)
        elif path in ("/get_server_info", "/server_info"):
            info = dict(self.server.info)
            info["status"] = "ready" if engine is not None else "loading"
            info["internal_states"] = [engine.internal_state()] if engine is not None else []
            self._send_json(HTTPStatus.OK, info)
        elif path in ("/get_model_info", "/model_info"):
            self._send_json(HTTPStatus.OK, {"model_path": self.server.info["model_path"], "is_generation": True,
                                            "architectures": [self.server.info["architecture"]]})
        else:
            self._error(HTTPStatus.NOT_FOUND, f"no route GET {path}")

    def do_POST(self) -> None:  # noqa: N802 - stdlib name
        path = self.path.split("?")[0]
        engine = self.server.engine
        try:
            body = self._read_body()
        except RequestError as exc:
            self._error(HTTPStatus.BAD_REQUEST, str(exc))
            return
        if path not in ("/generate", "/flush_cache"):
            self._error(HTTPStatus.NOT_FOUND, f"no route POST {path}")
        elif engine is None:
            self._error(HTTPStatus.SERVICE_UNAVAILABLE, "the model is still loading")
        elif path == "/flush_cache":
            engine.flush()
            self._send_json(HTTPStatus.OK, {"success": True, "message": "counters reset"})
        else:
            self._generate(engine, body)

    def _generate(self, engine: Engine, body: Any) -> None:
        try:
            ids, max_new, stream = parse_generate(body, engine)
        except RequestError as exc:
            self._error(HTTPStatus.BAD_REQUEST, str(exc))
            return
        rid = uuid.uuid4().hex
        if stream:
            self._generate_stream(engine, rid, ids, max_new)
            return
        started = time.perf_counter()
        result = engine.generate(ids, max_new)
        self._send_json(HTTPStatus.OK, self._response(engine, rid, ids, result, max_new, started))

    def _response(self, engine: Engine, rid: str, ids: list[int], result: dict[str, Any], max_new: int,
                  started: float) -> dict[str, Any]:
        output = result["output_ids"]
        meta: dict[str, Any] = {
            "id": rid, "prompt_tokens": len(ids), "completion_tokens": len(output),
            "e2e_latency": time.perf_counter() - started,
            "finish_reason": {"type": "length", "length": len(output)} if len(output) >= max_new else {"type": "stop"},
        }
        if engine.speculative:
            verify = result["verify_ct"]
            meta["spec_verify_ct"] = verify
            meta["spec_accept_length"] = len(output) / verify if verify else None
        log(f"generate: prompt {len(ids)} tokens, completion {len(output)}"
            + (f", verify {meta['spec_verify_ct']}, accept len {meta['spec_accept_length'] or 0:.2f}" if engine.speculative else "")
            + f", {meta['e2e_latency']:.2f} s")
        return {"text": engine.decode(output), "output_ids": output, "meta_info": meta}

    def _generate_stream(self, engine: Engine, rid: str, ids: list[int], max_new: int) -> None:
        self.send_response(HTTPStatus.OK)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        produced: list[int] = []
        started = time.perf_counter()

        def send(payload: str) -> None:
            data = payload.encode()
            self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
            self.wfile.flush()

        def on_tokens(new_ids: list[int]) -> None:
            produced.extend(int(i) for i in new_ids)
            meta = {"id": rid, "prompt_tokens": len(ids), "completion_tokens": len(produced)}
            chunk = {"text": engine.decode(produced), "output_ids": list(produced), "meta_info": meta}
            send(f"data: {json.dumps(chunk)}\n\n")

        try:
            result = engine.generate(ids, max_new, on_tokens=on_tokens)
            final = self._response(engine, rid, ids, result, max_new, started)
            send(f"data: {json.dumps(final)}\n\n")
            send("data: [DONE]\n\n")
            self.wfile.write(b"0\r\n\r\n")
            self.wfile.flush()
        except (BrokenPipeError, ConnectionResetError):
            log(f"generate {rid}: the client went away mid-stream")
            self.close_connection = True


# --------------------------------------------------------------------------- main

def server_info(profile, args, engine_path: str) -> dict[str, Any]:
    speculative = not args.no_speculation
    steps = args.num_steps or profile.serve.num_steps
    return {
        "engine": "reference",
        "model_path": profile.target.path,
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
        "version": "eagle3-console-reference",
    }


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m backend.serve.reference_server",
                                     description="SGLang-compatible HTTP server over the project's speculative decoder")
    parser.add_argument("--profile", required=True)
    parser.add_argument("--draft", help="draft checkpoint dir (required unless --no-speculation)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--feed", choices=["aux", "last_hidden"], default="aux",
                        help="last_hidden: hand the draft the final hidden state and skip fc, as SGLang's silent failure does")
    parser.add_argument("--num-steps", type=int, help="draft steps per verify (default: the profile's)")
    parser.add_argument("--no-speculation", action="store_true", help="plain target decoding (benchmark baseline)")
    args = parser.parse_args(argv)
    if not args.no_speculation and not args.draft:
        parser.error("--draft is required unless --no-speculation is given")
    return args


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
    server = ReferenceHTTPServer((args.host, args.port), server_info(profile, args, profile.target.path))
    outcome = {"code": 0}

    def stop(signum, _frame) -> None:
        log(f"signal {signum}: shutting down")
        threading.Thread(target=server.shutdown, daemon=True).start()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)

    def load() -> None:
        started = time.monotonic()
        try:
            engine = Engine(profile, args.draft, args.feed, args.num_steps, speculative=not args.no_speculation)
        except Exception:  # any load failure ends the server with the traceback in its log
            log("loading failed:\n" + traceback.format_exc())
            outcome["code"] = 1
            server.shutdown()
            return
        server.info["resolved_model_path"] = engine.target.path
        server.engine = engine
        server.loading = False
        mode = f"EAGLE3, {engine.num_steps} steps, feed {args.feed}" if engine.speculative else "no speculation"
        log(f"ready in {time.monotonic() - started:.1f} s on http://{args.host}:{args.port} ({mode})")

    log(f"listening on http://{args.host}:{args.port}; loading {profile.name} target"
        + ("" if args.no_speculation else f" and draft {args.draft}"))
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
