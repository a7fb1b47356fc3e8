"""Reference server: HTTP speaking SGLang 0.5.23's wire format over the reference engine (engine.py).

python -m backend.serve.reference.server --profile P --draft DIR --port N [--host 127.0.0.1]
       [--feed aux|last_hidden] [--num-steps K] [--no-speculation] [--served-model-name NAME]
       [--device auto|cpu|cuda[:N]] [--static-cache] [--compile-steps] [--attention auto|sdpa|efficient|math|triton]
       [--linear auto|torch|triton|triton-rows|triton-all]
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
from concurrent import futures
from dataclasses import dataclass, field
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler
from typing import Any, Callable
from urllib.parse import unquote, urlsplit

from backend.serve.reference import openai_api, serving_metrics
from backend.serve.reference.engine import WEIGHT_VERSION, Engine, Generation, log
from backend.serve.reference.native_api import PLAIN_SWITCH_INFO, NativeRequest, RequestError, parse_generate
from backend.serve.reference.openai_api import OpenAIRequestError
from backend.serve.spec_setting import TreeSetting, verify_width

DEFAULT_MAX_BODY_BYTES = 16 * 1024 * 1024
DEFAULT_REQUEST_TIMEOUT_S = 30.0
DEFAULT_HEADER_TIMEOUT_S = 10.0  # the whole request head (request line and headers), however it is dripped
DEFAULT_MAX_CONNECTIONS = 64  # requests served at once; complete requests past that queue (4x), then get 503
DEFAULT_MAX_WAITING = 1024  # connections still sending a request head; past that, the oldest is dropped
MAX_HEAD_BYTES = 64 * 1024  # request line and headers together; more is 431
MAX_HEADER_LINES = 100  # what http.client allows; more is 431
FLUSH_BODY = "Cache flushed.\nPlease check backend logs for more details. (When there are running or waiting requests, the operation will not be performed.)\n"
DRAIN_LIMIT_BYTES = 64 * 1024 * 1024


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

    def _run(self, engine: Engine, request: NativeRequest) -> Generation:
        return self._finished(engine, request, engine.run(request.spec, request.rid))

    def _finished(self, engine: Engine, request: NativeRequest, gen: Generation) -> Generation:
        engine.log_generation(gen)
        if self.server.metrics is not None:
            self.server.metrics.finished(len(request.spec.input_ids), len(gen.output_ids), gen.verify_ct, gen.latency or 0.0, request.stream)
        return gen

    def _stream(
        self, engine: Engine, request: NativeRequest, to_events: Callable[[dict], list], trailer: Callable[[], list] = list, native_errors: bool = False
    ) -> None:
        """SSE: an event group per emission, the final state exactly once, then [DONE]. The decode thread only hands a
        copy of each state over; this thread renders and writes them, in order, while the next steps run (rendering the
        whole text took ~0.1 ms a 128-token emission on one core: on the decode thread it delayed the next step)."""
        self._start_sse()
        updates: queue.SimpleQueue[Generation | None] = queue.SimpleQueue()
        stopped = threading.Event()

        def hand_over(gen: Generation) -> None:  # on the decode thread
            if stopped.is_set():
                raise ClientGone("nothing reads this stream any more")
            updates.put(gen.copy())

        try:
            future = engine.submit(request.spec, request.rid, hand_over)
            future.add_done_callback(lambda _: updates.put(None))
            try:
                sent_final = self._send_updates(engine, request, updates, to_events)
            except BaseException:  # the client left, or a state failed to render: the generation ends at its next emission
                stopped.set()
                futures.wait([future])
                raise
            gen = self._finished(engine, request, future.result())
            if not sent_final:  # nothing was emitted (max_new_tokens 0), or the last state came after the last emission
                self._send_events(to_events(self._output(engine, request, gen)))
            self._send_events(trailer())
        except ClientGone:
            if self.server.metrics is not None:
                self.server.metrics.abandoned()
            raise
        except Exception as exc:  # mid-stream there is no status code left: SGLang sends an error event
            log(f"generate {request.rid} failed mid-stream:\n{traceback.format_exc()}")
            message = str(exc) or type(exc).__name__
            self._send_event({"error": {"message": message}} if native_errors else error_body(500, message, "InternalServerError"))
        self._end_sse()

    def _send_updates(self, engine: Engine, request: NativeRequest, updates: queue.SimpleQueue, to_events: Callable[[dict], list]) -> bool:
        """Writes each handed-over state, in order, until the generation ends (None); whether the last was final."""
        sent_final = False
        while (state := updates.get()) is not None:
            self._send_events(to_events(self._output(engine, request, state)))
            sent_final = state.finish is not None
        return sent_final

    def _send_events(self, events: list) -> None:
        for event in events:
            self._send_event(event)

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
        tokens = info["speculative_num_draft_tokens"]
        gauges["sglang:spec_num_draft_tokens"] = ("Currently active speculative_num_draft_tokens (decouples from steps under topk>1).", float(tokens))
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
        "speculative_eagle_topk": args.eagle_topk if speculative else None,
        "speculative_num_draft_tokens": verify_width(steps, args.eagle_topk, args.num_draft_tokens, args.branches) if speculative else None,
        "first_step_branches": args.branches if speculative else None,  # reference-only: the draft's K best first tokens, each chained
        "speculative_draft_model_path": args.draft if speculative else None,
        "feed": args.feed if speculative else None,
        # reference-only: a /generate body may say "speculative": false to be decoded plainly (a same-engine baseline)
        PLAIN_SWITCH_INFO: True,
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
    parser.add_argument(
        "--branches",
        type=int,
        default=1,
        help="the draft's first-step branches: its K best first tokens, each chained --num-steps deep, verified in one step "
        "(static-cache decoder; default 1: a chain)",
    )
    parser.add_argument(
        "--eagle-topk",
        type=int,
        default=1,
        help="SGLang's EAGLE tree: the draft's top-k beams at every step, --num-draft-tokens verified (static-cache decoder; default 1: a chain)",
    )
    parser.add_argument("--num-draft-tokens", type=int, help="tokens a tree's verify holds, the root included (SGLang's --speculative-num-draft-tokens)")
    parser.add_argument("--served-model-name", help="the model id /v1/models reports (default: the target's directory)")
    parser.add_argument("--no-speculation", action="store_true", help="plain target decoding (benchmark baseline)")
    parser.add_argument(
        "--device",
        default="auto",
        help="auto (cuda:0 when CUDA is available, else cpu), cpu, cuda or cuda:N; on CUDA: the [serve] dtype, static KV cache, CUDA graphs",
    )
    parser.add_argument("--static-cache", action="store_true", help="decode through the static-cache decoder on CPU too (on CUDA it always is)")
    parser.add_argument("--compile-steps", action="store_true", help="torch.compile the static decoder's steps before capturing them (CUDA)")
    parser.add_argument(
        "--attention",
        default="auto",
        help="how the static decoder's target attends: auto (triton on CUDA where it runs, else sdpa), sdpa, efficient, math, "
        "or triton (reads only the keys a step needs)",
    )
    parser.add_argument(
        "--linear",
        default="auto",
        help="how the static decoder's steps multiply by the target's weights: auto (triton-rows on CUDA where it runs, "
        "else torch), torch (F.linear), triton (one kernel with the norm, gate and residual inside, for one row), "
        "triton-rows (that kernel for each of up to 4 rows: a verify's rows equal plain decoding's bit for bit) or triton-all",
    )
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
    if args.branches < 1:
        parser.error("--branches must be >= 1")
    if args.eagle_topk > 1 or args.num_draft_tokens is not None:
        steps = args.num_steps or 0
        try:
            if args.branches > 1:
                raise ValueError("--branches and --eagle-topk do not combine: choose one")
            if steps:
                TreeSetting.served(steps, args.eagle_topk, args.num_draft_tokens)
        except ValueError as error:
            parser.error(str(error))
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
                attention=args.attention,
                linear=args.linear,
                branches=args.branches,
                topk=args.eagle_topk,
                num_draft_tokens=args.num_draft_tokens,
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
        shape = f"top-{args.eagle_topk} tree, {server.info['speculative_num_draft_tokens']} tokens" if args.eagle_topk > 1 else f"{engine.branches} branches"
        mode = f"EAGLE3, {engine.num_steps} steps x {shape}, feed {args.feed}" if engine.speculative else "no speculation"
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
