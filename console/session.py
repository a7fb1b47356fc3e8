"""One host's agent conversation without Textual: connect, fold events into that host's ConsoleState, resync, load a
job's metrics and logs, poll holders, re-register watched runs.

The app composes one HostSession per host and tells it nothing about screens; the session tells its listener which
state sections changed and what the operator should read (notes). Tests drive it over a real agent with no UI.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, Literal, Protocol

from backend.protocol import Request, cut_text
from console.client import AgentClient, AgentError, ClientNote
from console.state import EXTERNAL_PREFIX, FAILED, STRING_CAP, SUMMARY_KEYS, ConnectionStatus, ConsoleState, Section
from console.transport import AgentStderr, TransportError

LOG_TAIL_LINES = 500
HISTORY_BATCHES_MAX = 1000
SUMMARY_POINTS = 512  # whole-history buckets per series (a wide terminal's plot is ~250 columns)
TAIL_RECORDS = 500  # raw records fetched for the live tail on attach (the buckets hold the rest)
VAL_ROWS = 8
SUMMARY_REFRESH_S = 5.0
STREAMS = ("stdout", "stderr")
Severity = Literal["information", "warning", "error"]  # a note's weight (Textual's toast severities)
FOLD_SLICE_S = 0.02  # the event pump yields to the UI at least this often, however fast the host sends
REFUSED_NOTE_INTERVAL_S = 5.0  # at most one toast per host for refused data in this time; every refusal is in state.notes


class SessionListener(Protocol):
    """What a session reports to whoever shows it (the app, or a test)."""

    def session_changed(self, session: "HostSession", sections: set[str]) -> None: ...

    def session_event(self, session: "HostSession", event: Any, sections: set[str]) -> None: ...

    def session_note(self, session: "HostSession", text: str, severity: Severity) -> None: ...


class HostSession:
    """The conversation with one host's agent and the state it fills."""

    def __init__(self, client: AgentClient | None, state: ConsoleState, listener: SessionListener):
        self.client = client
        self.state = state
        self.listener = listener
        self.events_seen = 0
        self.externals_agent: int | None = None  # agent pid the external watches were registered with
        self._metrics_locks: dict[str, asyncio.Lock] = {}
        self._stages_locks: dict[str, asyncio.Lock] = {}
        self.summary_at: dict[tuple[str, bool], float] = {}
        self.summary_pending: set[tuple[str, bool]] = set()
        self._refusals_told = 0  # state.notes_added when the operator was last told
        self._refusal_told_at = -REFUSED_NOTE_INTERVAL_S
        self._refusal_timer: asyncio.TimerHandle | None = None

    @property
    def name(self) -> str:
        """The host as the operator named it (the transport's label)."""
        return self.state.target

    @property
    def connected(self) -> bool:
        return self.client is not None and self.state.connection.connected

    def retry_now(self) -> bool:
        """Reconnect at once with the backoff reset (key r while disconnected); False when no reconnect is waiting."""
        return self.client is not None and self.client.transport.retry_now()

    def changed(self, sections: set[str]) -> None:
        if sections:
            self.listener.session_changed(self, sections)

    def note(self, text: str, severity: Severity = "information") -> None:
        self.listener.session_note(self, text, severity)

    # -- the event pump ---------------------------------------------------------------------------

    async def run(self) -> None:
        """Connect (retrying), then fold every event into the state for as long as the app lives."""
        assert self.client is not None
        try:
            await self.client.start(retry=True)
        except TransportError as exc:
            self.fold(ConnectionStatus(state=FAILED, detail=str(exc), since=time.time()))
            return
        added = getattr(self.client.transport, "host_key_added", None)
        if added:
            self.note(added)
        slice_start = time.monotonic()
        while True:
            event = await self.client.next_event()  # returns at once while events are queued: yield by time below
            self.fold(event)
            if time.monotonic() - slice_start > FOLD_SLICE_S:
                await asyncio.sleep(0)  # keys (q) and redraws run between slices even while a host floods events
                slice_start = time.monotonic()

    def fold(self, event: Any) -> set[str]:
        """One client event into the state; the listener hears the sections that changed and the event itself.

        Never raises for what a host sent: a refused event is one of the host's notes and the pump goes on."""
        self.events_seen += 1
        try:
            changed = self._fold(event)
        except Exception as exc:  # a bug met by data the checks let through: told, and the next event is folded
            kind = event.get("type") if isinstance(event, dict) else type(event).__name__
            self.state.refuse(f"internal error folding a {cut_text(str(kind), 40)!r} event: {type(exc).__name__}: {cut_text(str(exc), 200)}")
            changed = set()
        self._tell_refusals()
        if changed is None:
            return set()
        self.changed(changed)
        self.listener.session_event(self, event, changed)
        return changed

    def _fold(self, event: Any) -> set[str] | None:
        if isinstance(event, ConnectionStatus):
            return self.state.set_connection(event)
        if isinstance(event, AgentStderr):
            self.state.agent_stderr.append(cut_text(event.text, STRING_CAP))
            return {Section.AGENT_STDERR}
        if isinstance(event, ClientNote):
            self.state.refuse(event.text)
            return {Section.NOTES}
        if isinstance(event, dict):
            return self.state.apply(event)
        return None

    def _tell_refusals(self) -> None:
        """New entries in state.notes become a toast: at once, then at most one per REFUSED_NOTE_INTERVAL_S (a host
        sending bad data many times a second must not flood the screen); a timer tells the last of a burst."""
        new = self.state.notes_added - self._refusals_told
        if new <= 0:
            return
        wait = self._refusal_told_at + REFUSED_NOTE_INTERVAL_S - time.monotonic()
        if wait > 0:
            if self._refusal_timer is None:
                try:
                    self._refusal_timer = asyncio.get_running_loop().call_later(wait, self._refusal_due)
                except RuntimeError:  # folded outside a loop (a test): told on the next fold
                    pass
            return
        self._refusals_told, self._refusal_told_at = self.state.notes_added, time.monotonic()
        latest = self.state.notes[-1][1] if self.state.notes else "data refused"
        more = f" (and {new - 1} more refused since the last note; all in the host's notes)" if new > 1 else ""
        self.note(f"{self.name}: {latest}{more}", "warning")
        self.changed({Section.NOTES})

    def _refusal_due(self) -> None:
        self._refusal_timer = None
        self._tell_refusals()

    # -- requests ---------------------------------------------------------------------------------

    async def request(self, kind: str, /, **params: Any) -> dict[str, Any]:
        if self.client is None:
            raise AgentError("disconnected", f"no host connection; '{kind}' was not sent")
        return await self.client.request(kind, **params)

    async def resync(self) -> None:
        """After (re)connecting: the snapshot, the watched runs again (a new agent knows none), the GPU holders."""
        snapshot = await self.request(Request.SNAPSHOT)
        self.changed(self.state.apply_snapshot(snapshot))
        await self.rewatch_externals()
        await self.refresh_holders()

    async def refresh_holders(self) -> None:
        result = await self.request(Request.HOLDERS)
        self.changed(self.state.apply_holders(result.get("holders") or []))

    async def rewatch_externals(self) -> None:
        """A new agent (after a reconnect) knows no watches: register them again; their records restart from 0."""
        agent = self.state.hello.agent_pid if self.state.hello else None
        if not self.state.externals or agent == self.externals_agent:
            return
        for job, path in list(self.state.externals.items()):
            try:
                line_format = self.state.external_formats.get(job)
                extra = {"line_format": line_format} if line_format else {}
                await self.request(Request.WATCH_EXTERNAL, name=job.removeprefix(EXTERNAL_PREFIX), path=path, **extra)
            except AgentError as exc:
                self.note(f"re-watching {path} as {job} failed: {exc}", "warning")
            self.state.metrics.pop(job, None)
        self.externals_agent = agent

    # -- a chain's stages -------------------------------------------------------------------------------

    async def load_stages(self, job: str, attempts: int = 3) -> None:
        """A chain job's whole stages.jsonl (on attach, or after a gap in its events). One load per job at a time: a
        caller that finds one running leaves it to that one, which reads again while events reported lines beyond what
        its reply held (its request may have been answered before the gap's lines were written)."""
        lock = self._stages_locks.setdefault(job, asyncio.Lock())
        if lock.locked():
            return
        async with lock:
            for _ in range(attempts):
                history = await self.request(Request.STAGES_HISTORY, name=job)
                self.changed(self.state.apply_stages_history(job, history.get("records") or [], history.get("offset")))
                if self.state.stages_offset.get(job, 0) >= self.state.stages_seen_end.get(job, 0):
                    return

    def forget_stages(self, job: str) -> None:
        """A new chain of that name starts a new stages.jsonl: the records and offsets of the earlier one go."""
        for table in (self.state.stages, self.state.stages_offset, self.state.stages_seen_end):
            table.pop(job, None)

    # -- a job's metrics: whole-history buckets, the live tail, catch-up after a gap -------------------

    async def load_metrics(self, name: str, *, log_x_too: bool = False) -> list[tuple[str, bool]]:
        """The whole-history summary from the host's index, then the live tail (the last records) and the latest
        val records; never the whole file. One load per job at a time; events that arrive meanwhile are held
        back and anything they reported beyond the tail is read right after, so no record is lost or doubled.
        Returns the summary refreshes asked for while it loaded (the caller runs them)."""
        lock = self._metrics_locks.setdefault(name, asyncio.Lock())
        async with lock:
            metrics = self.state.job_metrics(name)
            metrics.loading, metrics.seen_end = True, 0
            try:
                await self.fetch_summary(name, log_x=False)
                window = await self.request(Request.METRICS_WINDOW, name=name, last=TAIL_RECORDS, val=VAL_ROWS, timeout=60)
                self.changed(self.state.apply_window(name, window))
                if log_x_too:
                    await self.fetch_summary(name, log_x=True)
                # Events held back during any await above (the window's, the pages', the summary's) are read now; no
                # await lies between the last check and `loading = False`, so none can slip in between.
                while self.state.job_metrics(name).seen_end > self.state.job_metrics(name).offset:
                    before = self.state.job_metrics(name).offset
                    await self.load_history_pages(name)
                    if self.state.job_metrics(name).offset == before:
                        break  # the host has nothing past our offset (a truncated file): the next event resyncs
            finally:
                self.state.job_metrics(name).loading = False
            pending = [p for p in self.summary_pending if p[0] == name]
            self.summary_pending.difference_update(pending)
            return pending

    async def fetch_summary(self, name: str, *, log_x: bool) -> None:
        result = await self.request(Request.METRICS_SERIES, name=name, keys=SUMMARY_KEYS, points=SUMMARY_POINTS, log_x=log_x, timeout=60)
        self.summary_at[(name, log_x)] = time.monotonic()
        self.changed(self.state.apply_series(name, result))

    def summary_due(self, name: str, *, log_x: bool) -> bool:
        """Whether the whole-history buckets of `name` should be asked for now (missing or older than SUMMARY_REFRESH_S);
        while a load of `name` is in flight the ask is remembered and answered after it."""
        if not self.connected:
            return False
        metrics = self.state.metrics.get(name)
        if metrics is not None and metrics.loading:
            self.summary_pending.add((name, log_x))
            return False
        at = self.summary_at.get((name, log_x))
        if at is None or time.monotonic() - at >= SUMMARY_REFRESH_S:
            self.summary_at[(name, log_x)] = time.monotonic()
            return True
        return False

    def summary_wait(self, name: str, *, log_x: bool) -> float | None:
        """Seconds until the held buckets of `name` may be asked for again; None when none are held or a load is on."""
        at = self.summary_at.get((name, log_x))
        metrics = self.state.metrics.get(name)
        if at is None or not self.connected or (metrics is not None and metrics.loading):
            return None
        return max(0.0, SUMMARY_REFRESH_S - (time.monotonic() - at))

    async def zoom(self, name: str, step_from: int, step_to: int, points: int, log_x: bool) -> dict[str, Any]:
        return await self.request(
            Request.METRICS_SERIES,
            name=name,
            keys=SUMMARY_KEYS,
            points=max(16, min(points, 1024)),
            log_x=log_x,
            timeout=60,
            **{"from": step_from, "to": step_to},
        )

    async def load_history_pages(self, name: str) -> None:
        """metrics_history pages from our offset (from 0 the first time) while the agent says `more`: the catch-up
        after a gap in the live events."""
        for _ in range(HISTORY_BATCHES_MAX):
            metrics = self.state.job_metrics(name)
            reset = not metrics.history_loaded
            offset = 0 if reset else metrics.offset
            result = await self.request(Request.METRICS_HISTORY, name=name, offset=offset, timeout=120)
            self.changed(self.state.apply_metrics_history(name, result, reset=reset))
            metrics = self.state.job_metrics(name)
            if not result.get("more") and not metrics.needs_catchup:
                return
            if result.get("offset") == offset and not result.get("records"):
                return

    async def catch_up_metrics(self) -> None:
        for name, metrics in list(self.state.metrics.items()):
            if metrics.needs_catchup:
                try:
                    await self.load_metrics(name)
                except AgentError as exc:
                    self.note(f"re-reading metrics of {name} on {self.name} failed: {exc}")
                    return

    # -- logs -----------------------------------------------------------------------------------------

    async def follow_logs(self, name: str, live_stream: str) -> None:
        """Tail both streams, then follow one live (the agent follows one log at a time)."""
        await self.tail_logs(name, STREAMS)
        await self.request(Request.FOLLOW_LOG, name=name, stream=live_stream)

    async def tail_logs(self, name: str, streams: tuple[str, ...]) -> None:
        for stream in streams:
            try:
                result = await self.request(Request.TAIL_LOG, name=name, stream=stream, lines=LOG_TAIL_LINES)
            except AgentError as exc:
                if exc.code in ("disconnected", "timeout"):
                    raise
                result = {"lines": [f"(no {stream} to show: {exc.message})"]}  # e.g. an adopted process's log
            self.state.log(name, stream).replace([str(line) for line in result.get("lines") or []])
        self.changed({Section.LOGS})

    async def close(self) -> None:
        if self.client is not None:
            await self.client.close()
