"""Typed requests and an event stream over a transport: request ids, replies matched to callers, timeouts.

`await client.request(Request.STOP_PLAN, name="train-1")` returns the reply's result or raises
AgentError with the agent's code and message. Everything else the agent says (events, stderr lines,
connection status changes) comes out of `await client.next_event()` in order.
"""

from __future__ import annotations

import asyncio
import itertools
from typing import Any, Union

from backend.protocol import Event, MalformedMessage, Request, decode

from console.state import ConnectionStatus
from console.transport import AgentLine, AgentStderr, NotConnected, StatusChanged, Transport

BIG_LINE = 256 << 10  # decode lines above this size off the UI thread
DEFAULT_TIMEOUT_S = 30.0

ClientEvent = Union[dict, ConnectionStatus, AgentStderr]


class AgentError(Exception):
    """The agent refused or failed a request, or no reply came (code 'disconnected' / 'timeout')."""

    def __init__(self, code: str, message: str):
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


class AgentClient:
    """One agent conversation: send requests, await their replies, read pushed events."""

    def __init__(self, transport: Transport, *, timeout: float = DEFAULT_TIMEOUT_S):
        self.transport = transport
        self.timeout = timeout
        self.status = ConnectionStatus()
        self.hello: dict[str, Any] | None = None
        self.malformed_lines = 0
        self._ids = itertools.count(1)
        self._pending: dict[int, tuple[str, asyncio.Future, float]] = {}  # id -> (kind, reply, deadline)
        self._events: asyncio.Queue = asyncio.Queue()
        self._reader: asyncio.Task | None = None

    @property
    def label(self) -> str:
        return self.transport.label

    async def start(self, *, retry: bool = False) -> None:
        """Connect (raises TransportError with the reason when the first connect fails; see Transport.start)."""
        self._reader = asyncio.create_task(self._read_loop(), name="agent client reader")
        try:
            await self.transport.start(retry=retry)
        except BaseException:
            self._reader.cancel()
            raise

    def pending_kinds(self) -> list[str]:
        return [kind for kind, _, _ in self._pending.values()]

    async def close(self) -> None:
        """Disconnect; a local agent gets as long as the longest pending request (a stop in its grace period) to finish."""
        loop = asyncio.get_running_loop()
        wait = max([3.0] + [deadline - loop.time() for _, _, deadline in self._pending.values()])
        await self.transport.close(wait=wait)
        await asyncio.sleep(0)
        if self._reader:
            self._reader.cancel()
            await asyncio.gather(self._reader, return_exceptions=True)
        self._fail_pending("closed", "the console closed the connection")

    async def request(self, kind: str, /, *, timeout: float | None = None, **params: Any) -> dict[str, Any]:
        """Send one request and wait for its reply; returns `result` or raises AgentError."""
        if not self.status.connected:
            raise AgentError("disconnected", f"not connected to {self.label}; '{kind}' was not sent")
        request_id = next(self._ids)
        loop = asyncio.get_running_loop()
        future: asyncio.Future = loop.create_future()
        limit = self.timeout if timeout is None else timeout
        self._pending[request_id] = (kind, future, loop.time() + limit)
        try:
            try:
                await self.transport.send({"type": kind, "id": request_id, **params})
            except NotConnected as exc:
                raise AgentError("disconnected", f"{exc}; '{kind}' was not sent") from None
            try:
                reply = await asyncio.wait_for(future, limit)
            except asyncio.TimeoutError:
                raise AgentError("timeout", f"no reply to '{kind}' within {limit:g}s; it may still take effect on the host") from None
        finally:
            self._pending.pop(request_id, None)
        if reply.get("ok"):
            result = reply.get("result")
            return result if isinstance(result, dict) else {"value": result}
        error = reply.get("error") or {}
        raise AgentError(str(error.get("code", "internal")), str(error.get("message", "the agent gave no reason")))

    async def ping(self) -> dict[str, Any]:
        return await self.request(Request.PING, timeout=10)

    async def next_event(self) -> ClientEvent:
        return await self._events.get()

    def pending_events(self) -> int:
        return self._events.qsize()

    # -- reading -----------------------------------------------------------------------------

    async def _read_loop(self) -> None:
        while True:
            item = await self.transport.items.get()
            if isinstance(item, AgentLine):
                await self._on_line(item.data)
            elif isinstance(item, StatusChanged):
                self.status = item.status
                if not item.status.connected:
                    self._fail_pending(
                        "disconnected", f"the connection to {self.label} dropped before a reply; the request may or may not have taken effect on the host"
                    )
                self._events.put_nowait(item.status)
            elif isinstance(item, AgentStderr):
                self._events.put_nowait(item)

    async def _on_line(self, data: bytes) -> None:
        try:
            message = await asyncio.to_thread(decode, data) if len(data) > BIG_LINE else decode(data)
        except MalformedMessage as exc:
            self.malformed_lines += 1
            self._events.put_nowait(AgentStderr(f"(console) skipped a malformed agent line: {exc}"))
            return
        if message["type"] == Event.REPLY:
            request_id = message.get("id")
            pending = self._pending.get(request_id) if isinstance(request_id, int) else None
            if pending and not pending[1].done():
                pending[1].set_result(message)
            return
        if message["type"] == Event.HELLO:
            self.hello = message
        self._events.put_nowait(message)

    def _fail_pending(self, code: str, message: str) -> None:
        for kind, future, _ in list(self._pending.values()):
            if not future.done():
                future.set_exception(AgentError(code, f"'{kind}': {message}"))
