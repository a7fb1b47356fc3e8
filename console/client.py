"""Typed requests and an event stream over a transport: request ids, replies matched to callers, timeouts.

`await client.request(Request.STOP_PLAN, name="train-1")` returns the reply's result or raises
AgentError with the agent's code and message. Everything else the agent says (events, stderr lines,
connection status changes) comes out of `await client.next_event()` in order.
"""

from __future__ import annotations

import asyncio
import itertools
import re
import time
from dataclasses import dataclass
from typing import Any, Union

from backend.protocol import (
    NUMBER,
    OPTIONAL,
    Event,
    InvalidMessage,
    JobInfo,
    Limits,
    MalformedMessage,
    ProcessVerdict,
    Request,
    bounded,
    check_fields,
    decode,
    parse,
    type_name,
)

from console.state import ConnectionStatus
from console.transport import AgentLine, AgentStderr, LineTooLong, NotConnected, StatusChanged, Transport

BIG_LINE = 256 << 10  # decode lines above this size off the UI thread
EVENT_LINE_CAP = 16 << 20  # an event line longer than this is dropped undecoded (the agent's are < 8 MiB); replies go to LINE_CAP
DEFAULT_TIMEOUT_S = 30.0
EVENTS_MAX = 1000  # decoded events waiting for the session's fold before the reader waits
SLICE_S = 0.02  # the reader yields to the UI at least this often, however fast the host writes
REPLY_HEAD = re.compile(rb'^\s*\{\s*"type"\s*:\s*"reply"\s*,\s*"id"\s*:\s*(\d{1,18})\b')


REPLY_LIMITS = Limits(string=4096, items=20_000, depth=10)  # what a reply the console keeps may hold
PID_ENTRY = {"pid": (int,), "job": (str, OPTIONAL), "cmdline": (str, OPTIONAL), "role": (str,), "user": (str, OPTIONAL)}
PID_ENTRY_FIELDS = PID_ENTRY | {"reason": (str, OPTIONAL), "used_memory_mib": NUMBER + (OPTIONAL,), "state": (str, OPTIONAL)}
CHECKPOINT_FIELDS = {"path": (str,), "epoch": (int, OPTIONAL), "step": (int, OPTIONAL), "latest": (bool, OPTIONAL)}


def _entries(result: dict[str, Any], key: str, check: Any) -> list:
    value = result.get(key)
    if value is None:
        return []
    if not isinstance(value, list):
        raise InvalidMessage(f"{key}: expected an array, got {type_name(value)}")
    return [check(entry, f"{key}[{i}]") for i, entry in enumerate(value[: REPLY_LIMITS.items])]


def _stop_plan(result: dict[str, Any]) -> dict[str, Any]:
    if not isinstance(result.get("checkpoint_first", False), bool):
        raise InvalidMessage(f"checkpoint_first: expected a boolean, got {type_name(result.get('checkpoint_first'))}")
    if not isinstance(result.get("checkpoint_note", ""), str):
        raise InvalidMessage(f"checkpoint_note: expected a string, got {type_name(result.get('checkpoint_note'))}")
    checked = dict(result)
    for key in ("will_signal", "stale", "foreign_gpu_holders"):
        checked[key] = _entries(result, key, lambda e, where: check_fields(e, PID_ENTRY_FIELDS, where, REPLY_LIMITS))
    checked["jobs"] = _entries(result, "jobs", lambda e, where: e if isinstance(e, str) else _bad(where, "a string", e))
    return bounded(checked, REPLY_LIMITS)


def _stop_job(result: dict[str, Any]) -> dict[str, Any]:
    verdicts = _entries(result, "verdicts", lambda e, where: (parse(ProcessVerdict, e, REPLY_LIMITS, where), e)[1])
    return bounded({**result, "verdicts": verdicts}, REPLY_LIMITS)


def _job_reply(result: dict[str, Any]) -> dict[str, Any]:
    parse(JobInfo, result.get("job"), REPLY_LIMITS, "job")
    return bounded(result, REPLY_LIMITS)


def _checkpoints(result: dict[str, Any]) -> dict[str, Any]:
    return {**result, "checkpoints": _entries(result, "checkpoints", lambda e, where: check_fields(e, CHECKPOINT_FIELDS, where, REPLY_LIMITS))}


def _bad(where: str, expected: str, value: Any) -> Any:
    raise InvalidMessage(f"{where}: expected {expected}, got {type_name(value)}")


# Replies checked here before any caller sees them. The state checks what it folds (snapshot, holders, metrics_*,
# stages_history, tail_log) item by item, so those only need to be objects; any other reply is bounded as a whole.
REPLY_CHECKS: dict[str, Any] = {
    Request.STOP_PLAN: _stop_plan,
    Request.STOP_JOB: _stop_job,
    Request.START_JOB: _job_reply,
    Request.ADOPT_JOB: _job_reply,
    Request.LIST_CHECKPOINTS: _checkpoints,
    **{
        kind: lambda result: result
        for kind in (Request.SNAPSHOT, Request.HOLDERS, Request.METRICS_HISTORY, Request.METRICS_SERIES, Request.METRICS_WINDOW, Request.STAGES_HISTORY)
    },
}


def check_reply(kind: str, result: Any) -> dict[str, Any]:
    """A reply's result as callers may use it, or InvalidMessage saying what did not fit the contract."""
    if not isinstance(result, dict):
        raise InvalidMessage(f"result: expected an object, got {type_name(result)}")
    check = REPLY_CHECKS.get(kind)
    return check(result) if check else bounded(result, REPLY_LIMITS)


@dataclass
class ClientNote:
    """Something the host sent that the console refused (a malformed or oversized line): shown, never applied."""

    text: str


ClientEvent = Union[dict, ConnectionStatus, AgentStderr, ClientNote]


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
        self._events_room = asyncio.Event()
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
        event = await self._events.get()
        if self._events.qsize() < EVENTS_MAX:
            self._events_room.set()
        return event

    # -- reading -----------------------------------------------------------------------------

    async def _read_loop(self) -> None:
        slice_start = time.monotonic()
        while True:
            item = await self.transport.next_item()
            if isinstance(item, AgentLine):
                await self._on_line(item.data)
            elif isinstance(item, LineTooLong):
                self._on_too_long(item)
            elif isinstance(item, StatusChanged):
                self.status = item.status
                if not item.status.connected:
                    self._fail_pending(
                        "disconnected", f"the connection to {self.label} dropped before a reply; the request may or may not have taken effect on the host"
                    )
                self._events.put_nowait(item.status)
            elif isinstance(item, AgentStderr):
                self._events.put_nowait(item)
            if self._events.qsize() >= EVENTS_MAX:
                self._events_room.clear()  # the fold is behind: wait for it (the transport then waits for us)
                await self._events_room.wait()
                slice_start = time.monotonic()
            elif time.monotonic() - slice_start > SLICE_S:
                await asyncio.sleep(0)
                slice_start = time.monotonic()

    def _awaited_reply(self, data: bytes) -> bool:
        match = REPLY_HEAD.match(data[:256])
        return match is not None and int(match.group(1)) in self._pending

    def _on_too_long(self, item: LineTooLong) -> None:
        """An agent line over the transport's cap was dropped: fail the request it answered (named in its first bytes)."""
        self.malformed_lines += 1
        size = f"{item.size / 2**20:.1f} MiB" if item.size >= 1 << 20 else f"{item.size} bytes"
        cap = f"{item.cap / 2**20:g} MiB" if item.cap >= 1 << 20 else f"{item.cap} bytes"
        match = REPLY_HEAD.match(item.head)
        pending = self._pending.get(int(match.group(1))) if match else None
        if pending and not pending[1].done():
            what = f"the reply to '{pending[0]}'"
            pending[1].set_exception(AgentError("reply_too_large", f"{what} was {size}, over the console's {cap} line cap; it was discarded"))
        else:
            what = "an agent line"
        self._events.put_nowait(ClientNote(f"(console) dropped {what} of {size}: longer than the {cap} line cap"))

    async def _on_line(self, data: bytes) -> None:
        if len(data) > EVENT_LINE_CAP and not self._awaited_reply(data):
            # Decoding holds the GIL for the whole line (a thread does not help): only a reply someone waits for may be big.
            self.malformed_lines += 1
            self._events.put_nowait(
                ClientNote(f"(console) dropped an agent line of {len(data) / 2**20:.1f} MiB: only a reply may exceed {EVENT_LINE_CAP >> 20} MiB")
            )
            return
        try:
            message = await asyncio.to_thread(decode, data) if len(data) > BIG_LINE else decode(data)
        except MalformedMessage as exc:
            self.malformed_lines += 1
            self._events.put_nowait(ClientNote(f"(console) skipped a malformed agent line: {str(exc)[:300]}"))
            return
        if message["type"] == Event.REPLY:
            request_id = message.get("id")
            pending = self._pending.get(request_id) if isinstance(request_id, int) and not isinstance(request_id, bool) else None
            if pending and not pending[1].done():
                await self._answer(pending[0], pending[1], message, big=len(data) > BIG_LINE)
            return
        if message["type"] == Event.HELLO:
            self.hello = message
        self._events.put_nowait(message)

    async def _answer(self, kind: str, future: asyncio.Future, message: dict[str, Any], *, big: bool) -> None:
        """Resolve a request: its checked result, the agent's error, or a bad_reply error saying what did not fit."""
        try:
            if message.get("ok") is True:
                result = message.get("result")
                result = result if isinstance(result, dict) else {"value": result}
                checked = await asyncio.to_thread(check_reply, kind, result) if big else check_reply(kind, result)
                outcome: Any = {"ok": True, "result": checked}
            else:
                error = message.get("error")
                error = error if isinstance(error, dict) else {}
                outcome = {"ok": False, "error": {k: str(error.get(k, d))[:2000] for k, d in (("code", "internal"), ("message", "the agent gave no reason"))}}
        except InvalidMessage as exc:
            what = f"the reply to '{kind}' does not fit the protocol ({exc}); the console used none of it (the request itself may have taken effect)"
            outcome = AgentError("bad_reply", what)
        if future.done():
            return
        if isinstance(outcome, AgentError):
            future.set_exception(outcome)
        else:
            future.set_result(outcome)

    def _fail_pending(self, code: str, message: str) -> None:
        for kind, future, _ in list(self._pending.values()):
            if not future.done():
                future.set_exception(AgentError(code, f"'{kind}': {message}"))
