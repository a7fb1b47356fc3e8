"""Small HTTP helpers for talking to an SGLang-compatible server: sync JSON calls, SSE parsing, free ports."""

from __future__ import annotations

import json
import socket
from dataclasses import dataclass
from typing import Any, AsyncIterator

import httpx


@dataclass
class HttpReply:
    status: int | None  # None when no HTTP answer came (refused, timed out, reset)
    body: Any = None  # parsed JSON when the body was JSON
    text: str = ""
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.status == 200


def client(timeout: float = 30.0) -> httpx.Client:
    # trust_env=False: a proxy from the environment must never see requests meant for 127.0.0.1.
    return httpx.Client(timeout=timeout, trust_env=False)


def async_client(timeout: float = 600.0, connections: int = 64) -> httpx.AsyncClient:
    limits = httpx.Limits(max_connections=connections, max_keepalive_connections=connections)
    return httpx.AsyncClient(timeout=timeout, trust_env=False, limits=limits)


def _reply(response: httpx.Response) -> HttpReply:
    try:
        body = response.json()
    except (json.JSONDecodeError, UnicodeDecodeError, ValueError):
        body = None
    return HttpReply(status=response.status_code, body=body, text=response.text[:2000])


def get(url: str, timeout: float = 30.0) -> HttpReply:
    try:
        with client(timeout) as http:
            return _reply(http.get(url))
    except httpx.HTTPError as exc:
        return HttpReply(status=None, error=f"{type(exc).__name__}: {exc}")


def post_json(url: str, payload: dict[str, Any] | None = None, timeout: float = 600.0) -> HttpReply:
    try:
        with client(timeout) as http:
            return _reply(http.post(url, json=payload or {}))
    except httpx.HTTPError as exc:
        return HttpReply(status=None, error=f"{type(exc).__name__}: {exc}")


def describe(reply: HttpReply) -> str:
    if reply.status is None:
        return f"no answer ({reply.error})"
    return f"HTTP {reply.status}: {reply.text[:300]!r}"


async def sse_events(response: httpx.Response) -> AsyncIterator[dict[str, Any]]:
    """`data: {...}` events of a streaming /generate reply until `data: [DONE]` (SGLang's framing)."""
    async for line in response.aiter_lines():
        if not line.startswith("data:"):
            continue
        data = line[len("data:") :].strip()
        if data == "[DONE]":
            return
        if data:
            yield json.loads(data)


def free_port(host: str = "127.0.0.1") -> int:
    """A port nobody listens on right now (the server binds it moments later)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def base_url(host: str, port: int) -> str:
    return f"http://{host}:{port}"
