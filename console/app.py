"""The Textual app: modes, keys, the hosts' sessions folded into the state, workers that load data, coalesced redraws.

Built by `build_app()` so tests can hand it a transport (or none) and fixed data. The keys and their guards are the table
in console/actions.py; each multi-step action is a flow (console/flows/) that holds this app. Agent I/O runs in async
workers; state changes are folded in at once and screen redraws are coalesced (at most one per `refresh_throttle`
seconds) and held back while a modal is open.
"""

from __future__ import annotations

import asyncio
import time
from functools import partial
from pathlib import Path
from typing import Any, Awaitable, Callable

from platformdirs import user_downloads_path  # Textual's own dependency: where its screenshots go
from textual import work
from textual.app import App, ScreenStackError
from textual.notifications import SeverityLevel
from textual.screen import ModalScreen, Screen
from textual.widgets import Footer
from textual.worker import Worker, WorkerState

from backend.commands import ProfileFacts, job_profile, profile_facts
from backend.protocol import Event, InvalidMessage, JobInfo, Request, parse
from backend.safetext import visible
from console.actions import ACTIONS, ACTIONS_BY_NAME, SCREEN_NAMES, ConsoleCommands, app_bindings, disabled_reason, offered
from console.client import AgentClient, AgentError
from console.flows.alerting import Alerting
from console.flows.chain import ChainFlow
from console.flows.grok import GrokFlow
from console.flows.multinode import MultiNodeFlow
from console.flows.resume import ResumeFlow
from console.flows.signals import SIGNALS_INTERVAL_S, SignalsFeed
from console.flows.start import StartFlow
from console.flows.stop import StopFlow
from console.flows.watch import AdoptFlow, UnwatchFlow, WatchFlow
from console.screens.base import ConsoleScreen, ConsoleView
from console.screens.chain import ChainScreen
from console.screens.dashboard import DashboardScreen
from console.screens.help import HelpModal, keys_text
from console.screens.hosts import HostsScreen
from console.screens.logs import LogsScreen
from console.session import STREAMS, HostSession, Severity
from console.state import CONNECTED, LIMITS, ConnectionStatus, ConsoleState, Section
from console.transport import Transport
from console.nodes import Node, nodes_of
from console.widgets.panels import ConsoleFooter

GUARDED_REQUESTS = (Request.STOP_JOB, Request.ADOPT_JOB, Request.START_JOB)
QUIT_CONFIRM_S = 10.0
REDRAW_SHARE = 4.0
# What a change of the active host redraws: everything the screens draw of one host.
ACTIVE_HOST_SECTIONS = frozenset(
    {
        Section.HOSTS,
        Section.SELECTION,
        Section.GPUS,
        Section.HOLDERS,
        Section.DISKS,
        Section.JOBS,
        Section.CONNECTION,
        Section.METRICS,
        Section.LOGS,
        Section.HELLO,
    }
)
# What a host other than the active one may redraw: its row in the Hosts view and its jobs in the jobs table.
CROSS_HOST_SECTIONS = frozenset({Section.CONNECTION, Section.HELLO, Section.GPUS, Section.HOLDERS, Section.JOBS, Section.DISKS, Section.HOSTS})


def _with_console_footer(cls: type[ConsoleScreen]) -> type[ConsoleScreen]:
    """`cls` with its stock Footer replaced by the ConsoleFooter (it wraps and abbreviates instead of cutting keys off)."""

    class WithConsoleFooter(cls):  # type: ignore[valid-type, misc]
        def compose(self):  # type: ignore[no-untyped-def]
            for widget in super().compose():
                yield ConsoleFooter() if type(widget) is Footer else widget

    WithConsoleFooter.__name__ = WithConsoleFooter.__qualname__ = cls.__name__
    return WithConsoleFooter


STDERR_KINDS = ("train", "serve")  # jobs that write their log to stderr (print to stdout is for results)


class ConsoleApp(App):
    TITLE = "eagle3-console"
    CSS_PATH = "console.tcss"
    MODES = {
        "dashboard": DashboardScreen,
        "logs": LogsScreen,
        "chain": _with_console_footer(ChainScreen),
        "hosts": HostsScreen,
    }  # "training", "grokking" added per instance
    DEFAULT_MODE = "dashboard"
    COMMANDS = App.COMMANDS | {ConsoleCommands}
    BINDINGS = app_bindings()

    def __init__(
        self,
        hosts: list[tuple[AgentClient | None, ConsoleState]],
        *,
        profile: str = "tiny",
        refresh_throttle: float = 0.2,
        poll_interval: float | None = 5.0,
        stop_grace: float = 30.0,
        raw_plots: bool = False,
        chain_args: list[str] | tuple[str, ...] = (),
        signals_interval: float = SIGNALS_INTERVAL_S,
        readonly: bool = False,
        notify_terminal: bool = False,
        rdzv_endpoint: str | None = None,
    ):
        super().__init__()
        self.rdzv_endpoint = rdzv_endpoint  # HOST:PORT of a multi-node run's rendezvous (default: the first host, a port from the run id)
        self.readonly = readonly
        self.holders_expanded = False
        self.table_order: list[tuple[str, str]] = []  # the jobs table sets it as it draws (console/screens/dashboard.py)
        self.sessions = [HostSession(client, state, self) for client, state in hosts]
        self.active = self.sessions[0]
        self.profile = profile
        self.refresh_throttle = refresh_throttle
        self.poll_interval = poll_interval
        self.stop_grace = stop_grace
        self.selected_job: str | None = None
        self.sub_title = self.active.name
        self._pending_sections: set[str] = set()
        self._refresh_scheduled = False
        self._last_refresh = 0.0
        self._redraw_cost = 0.0  # seconds the last redraw took (state -> widgets, plus plot paint)
        self._paint_cost = 0.0
        self._state_cost = 0.0
        self._log_streams: dict[str, str] = {}  # job -> the stream the operator chose to follow live (key o)
        self._quit_warned_at = float("-inf")
        self._summary_timers: dict[tuple[str, str, bool], Any] = {}  # (host, job, log_x) -> the timer of a deferred summary ask
        self._modes["training"] = partial(_training_screen, raw_plots=raw_plots)
        self._modes["grokking"] = _grokking_screen
        self._profiles: dict[str, ProfileFacts] = {}
        self.resume_target: dict[str, Any] | None = None  # {"job", "checkpoint", "profile", "host", "options"}: what the last stop wrote
        self.alerting = Alerting(self, notify_terminal)
        self.signals = SignalsFeed(self, signals_interval)
        self.resume_flow = ResumeFlow(self)
        self.stop_flow = StopFlow(self, self.resume_flow)
        self.chain_flow = ChainFlow(self, self.stop_flow, self.resume_flow, chain_args)
        self.start_flow = StartFlow(self)
        self.multinode_flow = MultiNodeFlow(self)
        self.grok_flow = GrokFlow(self)
        self.watch_flow = WatchFlow(self)
        self.unwatch_flow = UnwatchFlow(self)
        self.adopt_flow = AdoptFlow(self)

    # -- hosts and their sessions ------------------------------------------------------------------

    @property
    def state(self) -> ConsoleState:
        """The active host's state: what the screens draw (the selected job's host)."""
        return self.active.state

    @property
    def client(self) -> AgentClient | None:
        return self.active.client

    @client.setter
    def client(self, client: AgentClient | None) -> None:
        self.active.client = client

    @property
    def multi_host(self) -> bool:
        return len(self.sessions) > 1

    def nodes_of(self, name: str | None) -> list[Node]:
        """The nodes of the active host's job `name` across every host (one for a one-node job)."""
        return nodes_of(self.sessions, self.active.name, name)

    @property
    def events_seen(self) -> int:
        return sum(session.events_seen for session in self.sessions)

    def session_named(self, host: str | None) -> HostSession:
        return next((s for s in self.sessions if s.name == host), self.active)

    def set_active(self, session: HostSession) -> None:
        if session is self.active:
            return
        self.active = session
        self.sub_title = session.name
        self.refresh_bindings()
        self.state_changed(set(ACTIVE_HOST_SECTIONS))

    # -- lifecycle ------------------------------------------------------------------------------

    def on_mount(self) -> None:
        for session in self.sessions:
            if session.client is not None:
                self._start(session.run, name=f"agent events {session.name}", group=f"agent:{session.name}")
        if self.poll_interval:
            self.set_interval(self.poll_interval, self._poll_tick)

    async def on_unmount(self) -> None:
        await asyncio.gather(*(session.close() for session in self.sessions), return_exceptions=True)

    # SessionListener: what a host's session reports

    def session_changed(self, session: HostSession, sections: set[str]) -> None:
        if session is self.active:
            self.state_changed(sections | ({Section.HOSTS} if self.multi_host else set()))
            return
        self.alerting.check(sections, session)
        shown = {s for s in sections if s in CROSS_HOST_SECTIONS}  # other hosts only feed the Hosts view and the jobs table
        if shown:
            self._schedule_redraw(shown | {Section.HOSTS})

    def session_note(self, session: HostSession, text: str, severity: Severity) -> None:
        self.note(text, severity=severity)

    def session_event(self, session: HostSession, event: Any, changed: set[str]) -> None:
        if isinstance(event, ConnectionStatus):
            self._connection_changed(session, event)
            return
        if not isinstance(event, dict):
            return
        if Section.METRICS_GAP in changed and session.client is not None:
            self.catch_up_metrics(session)
        if Section.STAGES_GAP in changed and session.client is not None:
            self._start(self._catch_up_stages, session, str(event.get("job")), group=f"stages:{session.name}")
        if session is not self.active:
            return
        kind, job = event.get("type"), event.get("job")
        if kind == Event.METRICS and job == self.selected_job:
            self.signals.request(self.selected_job)
            self._history_grew()
        if kind == Event.INDEX_PROGRESS and job == self.selected_job:
            session.summary_at.clear()  # the index grew by a chunk (or finished): redraw from it
            self._history_grew()
        if kind == Event.STAGES and Section.STAGES in changed:
            self.chain_flow.progressed(str(job))
        if kind == Event.JOBS and self.selected_job is None:
            self._select_default_job()

    def handle_event(self, event: Any, host: str | None = None) -> None:
        """Fold one client event into a host's state (the active host's by default) and schedule a redraw."""
        self.session_named(host).fold(event)

    def _history_grew(self) -> None:
        """New records for the selected job: keep its whole-history buckets fresh and a following zoom on the newest step."""
        screen = self.shown_screen
        log_x = bool(getattr(screen, "view_is_log", lambda: False)())
        self.ensure_summary(self.selected_job, log_x=False)
        if log_x:
            self.ensure_summary(self.selected_job, log_x=True)
        follow = getattr(screen, "follow_run", None)
        if follow is not None:
            follow()

    def set_connection(self, status: ConnectionStatus, host: str | None = None) -> None:
        self.session_named(host).fold(status)

    def _connection_changed(self, session: HostSession, status: ConnectionStatus) -> None:
        self.refresh_bindings()
        if status.state == CONNECTED and session.client is not None:
            self.resync(session)

    # -- coalesced redraws ---------------------------------------------------------------------

    def state_changed(self, sections: set[str]) -> None:
        if not sections:
            return
        self.alerting.check(sections, self.active)
        self._schedule_redraw(sections)

    def _schedule_redraw(self, sections: set[str]) -> None:
        """Redraw these sections of the shown screen soon, coalesced with any redraw already due."""
        self._pending_sections |= sections
        if self._refresh_scheduled:
            return
        self._refresh_scheduled = True
        # Redraws may take at most ~1/REDRAW_SHARE of the time: a 150 ms plot frame waits >= 600 ms.
        spacing = max(self.refresh_throttle, REDRAW_SHARE * self._redraw_cost) if self.refresh_throttle else 0.0
        wait = spacing - (time.monotonic() - self._last_refresh)
        if wait > 0:
            self.set_timer(wait, self._redraw)
        else:
            self.call_later(self._redraw)

    @property
    def shown_screen(self) -> Screen[object] | None:
        """The screen on top, or None while there is none: Textual's `screen` raises then. At shutdown Textual empties
        the screen stacks before it stops the app's timers and workers, so a poll tick, a redraw or an agent's event
        that comes in between finds no screen (and must not raise: that fails the app, and the test that ran it)."""
        try:
            return self.screen
        except ScreenStackError:
            return None

    @property
    def modal_open(self) -> bool:
        return isinstance(self.shown_screen, ModalScreen)

    def _redraw(self) -> None:
        self._refresh_scheduled = False
        screen = self.shown_screen
        if screen is None or isinstance(screen, ModalScreen):
            return  # kept in _pending_sections; drawn when the modal closes (on_screen_resume), never at shutdown
        sections, self._pending_sections = self._pending_sections, set()
        started = time.perf_counter()
        self._paint_cost = 0.0
        if isinstance(screen, ConsoleScreen):
            screen.show_state(sections)
        self._state_cost = time.perf_counter() - started
        self._redraw_cost = self._state_cost
        self._last_refresh = time.monotonic()

    def note_paint_cost(self, seconds: float) -> None:
        """Plots report their render time (it happens at paint, after _redraw) so the next wait accounts for it."""
        self._paint_cost += seconds
        self._redraw_cost = self._state_cost + self._paint_cost

    def redraw_now(self) -> None:
        """Draw everything at once (tests and the benchmark push data, then call this)."""
        self._pending_sections = set()
        screen = self.shown_screen
        if isinstance(screen, ConsoleScreen):
            screen.show_state(None)

    # -- selection ------------------------------------------------------------------------------

    def _select_default_job(self) -> None:
        jobs = list(self.state.jobs.values())
        if not jobs:
            return
        running = [j for j in jobs if j.state == "running"]
        self.select_job((running or jobs)[-1].name)

    def select_job(self, name: str | None, host: str | None = None) -> None:
        """Select a job (on `host`, which becomes the active host; the active host when None)."""
        session = self.session_named(host) if host is not None else self.active
        if name == self.selected_job and session is self.active:
            return
        self.set_active(session)
        self.selected_job = name
        self.refresh_bindings()
        self.state_changed({Section.SELECTION})
        self.signals.cancel_timer()
        if name and session.connected:
            self.load_job(name)
            self.signals.grokking_shown()

    def select_host(self, host: str) -> None:
        """Make `host` the active one (the Hosts view): its GPUs and holders on the Dashboard, its newest job selected."""
        session = self.session_named(host)
        if session is self.active:
            return
        self.set_active(session)
        self.selected_job = None
        self._select_default_job()

    def select_started_job(self, name: str, wire: dict[str, Any] | None, host: HostSession | None = None) -> None:
        """Select a job the console just started on `host` (the active one by default, else it becomes active): listed and
        drawn at once, so a jobs-table highlight that a redraw posted for the previous selection (the agent's jobs event
        races with the reply) cannot take it back."""
        self.set_active(host or self.active)
        if name not in self.state.jobs and isinstance(wire, dict):
            try:
                self.state.jobs[name] = parse(JobInfo, wire, LIMITS, "the started job")
            except InvalidMessage as exc:
                self.state.refuse(f"refused the started job's record: {exc}; it is listed with the next jobs event")
        self.selected_job = None
        self.select_job(name)
        self.redraw_now()

    def job_rows(self) -> list[tuple[HostSession, str]]:
        """Every host's jobs, newest first per host, hosts in the order given (the jobs table's order)."""
        return [(session, name) for session in self.sessions for name in reversed(list(session.state.jobs))]

    def _cycle_job(self, step: int) -> None:
        """[ and ]: the previous or next job in the jobs table's order as last drawn (its sort and filter), else listed."""
        by_name = {(session.name, name): (session, name) for session, name in self.job_rows()}
        shown = [by_name[key] for key in self.table_order if key in by_name]
        rows = shown or self.job_rows()
        if not rows:
            return
        current = (self.active, self.selected_job)
        if current not in rows:
            self.select_job(rows[0][1], rows[0][0].name)
            return
        session, name = rows[(rows.index(current) + step) % len(rows)]
        self.select_job(name, session.name)

    # -- agent conversations (workers; one group per host so one host's work never cancels another's) ------------

    def _start(self, work: Callable[..., Awaitable[object]], *args: Any, group: str, name: str = "", exclusive: bool = False) -> None:
        """WORK(*ARGS) in a worker of GROUP (exclusive: it replaces the group's running one). The worker makes the
        coroutine when it starts, so one cancelled before it ran (replaced, or at shutdown) leaves no coroutine that was
        never awaited (a RuntimeWarning at garbage collection)."""
        self.run_worker(partial(work, *args), name=name, group=group, exclusive=exclusive, exit_on_error=False)

    def resync(self, session: HostSession | None = None) -> None:
        session = session or self.active
        self._start(self._resync, session, name=f"resync {session.name}", group=f"resync:{session.name}", exclusive=True)

    async def _resync(self, session: HostSession) -> None:
        """After (re)connecting: snapshot, watched runs, holders, and (on the active host) the selected job's metrics and logs."""
        try:
            await session.resync()
            await self._reload_stages(session)
            if session is not self.active:
                return
            if self.selected_job not in self.state.jobs:
                self.selected_job = None
                self._select_default_job()
            if self.selected_job:
                await self._load_job(self.selected_job)
            if isinstance(self.shown_screen, ChainScreen):
                self.chain_flow.attach(self.chain_flow.current_job())
            self.signals.grokking_shown(force=True)
        except AgentError as exc:
            self.note(f"resync of {session.name} failed: {exc}")

    def load_job(self, name: str) -> None:
        session = self.active
        self._start(self._load_job_reporting, session, name, name=f"load {name}", group=f"job:{session.name}", exclusive=True)

    async def _load_job_reporting(self, session: HostSession, name: str) -> None:
        try:
            await self._load_job(name, session)
        except AgentError as exc:
            self.note(f"loading {name} failed: {exc}")

    async def _load_job(self, name: str, session: HostSession | None = None) -> None:
        session = session or self.active
        screen = self.shown_screen
        log_x_too = isinstance(screen, ConsoleScreen) and bool(getattr(screen, "LOG_X_DEFAULT", False))
        for pending in await session.load_metrics(name, log_x_too=log_x_too):
            self.refresh_summary(*pending)
        if not session.state.is_external(name):  # a watched run has no logs of ours
            await session.follow_logs(name, self.log_stream)

    def refresh_summary(self, name: str, log_x: bool) -> None:
        session = self.active
        self._start(self._refresh_summary, session, name, log_x, name=f"summary {name}", group=f"summary:{session.name}")

    async def _refresh_summary(self, session: HostSession, name: str, log_x: bool) -> None:
        try:
            await session.fetch_summary(name, log_x=log_x)
        except AgentError as exc:
            if exc.code not in ("disconnected", "timeout", "unknown_request"):
                self.note(f"history of {name}: {exc}", severity="warning")

    def ensure_summary(self, name: str | None, *, log_x: bool) -> None:
        """Ask for the whole-history buckets of `name` (log-spaced or not) when missing or older than SUMMARY_REFRESH_S;
        when they are too fresh to ask again, ask once they are due: records that came meanwhile (a freshly watched run's
        whole history comes in the first seconds, then nothing) would otherwise wait for the next record, or for r."""
        if not name:
            return
        if self.active.summary_due(name, log_x=log_x):
            self.refresh_summary(name, log_x)
            return
        wait = self.active.summary_wait(name, log_x=log_x)
        key = (self.active.name, name, log_x)
        if wait is not None and key not in self._summary_timers:
            self._summary_timers[key] = self.set_timer(wait + 0.05, partial(self._summary_timer_fired, key))

    def _summary_timer_fired(self, key: tuple[str, str, bool]) -> None:
        self._summary_timers.pop(key, None)
        host, name, log_x = key
        if self.active.name == host and self.selected_job == name:
            self.ensure_summary(name, log_x=log_x)

    def request_zoom(self, name: str, step_from: int, step_to: int, points: int, log_x: bool) -> None:
        """Buckets of the zoomed range (the plot's width of them), for every series the screens plot."""
        session = self.active
        self._start(self._zoom, session, name, step_from, step_to, points, log_x, name=f"zoom {name}", group=f"zoom:{session.name}", exclusive=True)

    async def _zoom(self, session: HostSession, name: str, step_from: int, step_to: int, points: int, log_x: bool) -> None:
        try:
            result = await session.zoom(name, step_from, step_to, points, log_x)
        except AgentError as exc:
            self.note(f"zoom into {name}: {exc}", severity="warning")
            return
        if self.selected_job == name and session is self.active:
            self.state_changed(session.state.apply_series(name, result, zoom=True))

    def catch_up_metrics(self, session: HostSession | None = None) -> None:
        session = session or self.active
        self._start(session.catch_up_metrics, name=f"catch up {session.name}", group=f"catchup:{session.name}", exclusive=True)

    async def _reload_stages(self, session: HostSession) -> None:
        """Every chain whose stages this console holds, read again: lines written while the link was down came in no
        event (a new agent follows each file from its end)."""
        for job in [name for name in session.state.stages if name in session.state.jobs]:
            await self._catch_up_stages(session, job)

    async def _catch_up_stages(self, session: HostSession, job: str) -> None:
        try:
            await session.load_stages(job)
        except AgentError:
            pass  # disconnected or timed out: the next stages event finds the gap again and asks again

    def _poll_tick(self) -> None:
        """Slow poll of what the agents do not push (GPU holders), every connected host; paused while a modal is open,
        and over once no screen is left (the app is shutting down: its timers tick until they are stopped)."""
        screen = self.shown_screen
        if screen is None or isinstance(screen, ModalScreen):
            return
        for session in self.sessions:
            if session.connected:
                self._start(self._poll, session, name=f"poll {session.name}", group=f"poll:{session.name}", exclusive=True)
        self.state_changed({Section.CONNECTION, Section.HOSTS})  # keeps "N s ago" in the banners moving

    async def _poll(self, session: HostSession) -> None:
        try:
            await session.refresh_holders()
            if session is self.active and isinstance(self.shown_screen, LogsScreen) and self.selected_job:
                other = tuple(s for s in STREAMS if s != self.log_stream)
                await session.tail_logs(self.selected_job, other)
        except AgentError:
            pass  # the banner shows the disconnect; the next tick tries again

    @property
    def log_stream(self) -> str:
        """The stream the agent follows live for the selected job (the other is re-tailed each poll): the one chosen with
        o, else the one the job writes to (the trainer and the servers log to stderr; other jobs print to stdout)."""
        job = self.selected_job
        if job in self._log_streams:
            return self._log_streams[job]
        info = self.state.jobs.get(job) if job else None
        return "stderr" if info is not None and info.kind in STDERR_KINDS else "stdout"

    def set_log_stream(self, stream: str) -> None:
        """Which stream the agent follows live (Logs screen, key o)."""
        if self.selected_job:
            self._log_streams[self.selected_job] = stream
        if self.selected_job and self.client is not None and self.state.connection.connected:
            self.load_job(self.selected_job)

    def profile_of(self, job: str | None, host: HostSession | None = None) -> str:
        """The profile `job` (on `host`, the active one by default) was started with; the console's own when unknown."""
        info = (host or self.active).state.jobs.get(job) if job else None
        return job_profile(info.argv, self.profile) if info and info.argv else self.profile

    def profile_facts(self, name: str, run_dir: str | None = None) -> ProfileFacts:
        """The profile's facts; its data dir moved with `run_dir` (a job's --run-dir, else its host's run dir)."""
        key = f"{name}\x1f{run_dir or ''}"
        if key not in self._profiles:
            self._profiles[key] = profile_facts(name, run_dir)
        return self._profiles[key]

    # -- what the screens ask of the flows ---------------------------------------------------------

    def grokking_shown(self, force: bool = False) -> None:
        self.signals.grokking_shown(force)

    def current_chain_job(self) -> str | None:
        return self.chain_flow.current_job()

    def attach_chain(self, chain: str | None) -> None:
        self.chain_flow.attach(chain)

    # -- guarded actions --------------------------------------------------------------------------

    def disabled_reason(self, action: str) -> str | None:
        return disabled_reason(self, action)

    def refusal(self, action: str, host: HostSession) -> str | None:
        """Why `action`, just confirmed in a modal, must not go to `host` now: its key's own guard, or that host's link."""
        return self.disabled_reason(action) or (None if host.connected else f"disconnected from {host.name}")

    def footer_short_label(self, action: str) -> str | None:
        spec = ACTIONS_BY_NAME.get(action)
        return spec.short or None if spec else None

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        if action in ACTIONS_BY_NAME and self.modal_open:
            return False  # the modal's own keys only: a second "s" must not stack another stop
        spec = ACTIONS_BY_NAME.get(action)
        if spec is not None and not offered(spec, self):
            return False  # --readonly or one host: hidden from the footer, not merely greyed
        return None if self.disabled_reason(action) else True

    def on_key(self, event) -> None:
        """A key whose action is disabled says why, instead of doing nothing silently."""
        active = self.screen.active_bindings.get(event.key)
        if active is not None and active.node is not self and active.enabled:
            return  # the screen's own key for now (n on Logs while a search is on), not the app's action
        for action in ACTIONS:
            if action.key == event.key or (event.character and action.key == event.character):
                reason = self.disabled_reason(action.name)
                if reason:
                    self.note(f"{action.label} is disabled: {reason}")
                    event.stop()
                return

    async def run_console_action(self, name: str, screen: Any = None) -> None:
        """Palette entry point: same guard as the keys (run_action honours check_action)."""
        reason = self.disabled_reason(name)
        if reason:
            self.note(f"{ACTIONS_BY_NAME[name].label} is disabled: {reason}")
            return
        spec = ACTIONS_BY_NAME[name]
        if spec.screen is not None and screen is not None:
            await self.run_action(name, screen)
        else:
            await self.run_action(name)

    def note(self, text: str, *, severity: SeverityLevel = "information") -> None:
        self.state.note_action(text)
        self.state_changed({Section.ACTIONS})
        self.notify(visible(text), severity=severity, timeout=6, markup=False)  # host text in it: inert, never markup

    async def action_quit(self) -> None:
        """Quit; with a stop or adopt in flight, the first press only warns (quitting then waits for it)."""
        in_flight = [k for k in (self.client.pending_kinds() if self.client else []) if k in GUARDED_REQUESTS]
        now = time.monotonic()
        if in_flight and now - self._quit_warned_at > QUIT_CONFIRM_S:
            self._quit_warned_at = now
            self.note(f"{', '.join(in_flight)} in flight on the host: press q again to quit; quitting waits for it to finish", severity="warning")
            return
        self.exit()

    def action_help(self) -> None:
        if isinstance(self.shown_screen, HelpModal):
            return
        shown = [a for a in ACTIONS if offered(a, self)]
        disabled = {a.name: reason for a in shown if (reason := self.disabled_reason(a.name))}
        self.push_screen(HelpModal(keys_text(shown, SCREEN_NAMES, disabled)))

    def action_show_dashboard(self) -> None:
        self.switch_mode("dashboard")

    def action_show_training(self) -> None:
        self.switch_mode("training")

    def action_show_logs(self) -> None:
        self.switch_mode("logs")

    def action_show_grokking(self) -> None:
        self.switch_mode("grokking")

    def action_show_chain(self) -> None:
        self.switch_mode("chain")

    def action_show_hosts(self) -> None:
        self.switch_mode("hosts")

    def action_next_job(self) -> None:
        self._cycle_job(+1)

    def action_prev_job(self) -> None:
        self._cycle_job(-1)

    def action_resync(self) -> None:
        if not self.active.connected:  # disconnected: r cuts the reconnect backoff short
            hurried = self.active.retry_now()
            self.note(f"reconnecting to {self.active.name} now" if hurried else f"a reconnect to {self.active.name} is already under way")
            return
        self.note("resyncing: snapshot, holders, the selected job's history and logs")
        self.resync()

    @work(group="actions", exit_on_error=False)
    async def action_start_training(self) -> None:
        await self.start_flow.run()

    @work(group="actions", exit_on_error=False)
    async def action_start_multinode(self) -> None:
        await self.multinode_flow.run()

    @work(group="actions", exit_on_error=False)
    async def action_stop_job(self) -> None:
        await self.stop_flow.run()

    @work(group="actions", exit_on_error=False)
    async def action_stop_and_bench(self) -> None:
        await self.chain_flow.run()

    @work(group="actions", exit_on_error=False)
    async def action_resume(self) -> None:
        await self.resume_flow.run()

    @work(group="actions", exit_on_error=False)
    async def action_grok(self) -> None:
        await self.grok_flow.run()

    @work(group="actions", exit_on_error=False)
    async def action_watch_external(self) -> None:
        await self.watch_flow.run()

    @work(group="actions", exit_on_error=False)
    async def action_unwatch_external(self) -> None:
        await self.unwatch_flow.run()

    @work(group="actions", exit_on_error=False)
    async def action_adopt(self) -> None:
        await self.adopt_flow.run()

    def deliver_screenshot(self, filename: str | None = None, path: str | None = None, time_format: str | None = None) -> str | None:
        """The palette's Screenshot: into ~/Downloads when there is one, else the home directory (Textual's default
        failed outright on a host or laptop without ~/Downloads); the note names the file."""
        if path is None:
            downloads = user_downloads_path()
            path = str(downloads if downloads.is_dir() else Path.home())
        return super().deliver_screenshot(filename, path, time_format)

    def on_worker_state_changed(self, event: Worker.StateChanged) -> None:
        error = event.worker.error
        if event.state != WorkerState.ERROR or error is None or isinstance(error, asyncio.CancelledError):
            return  # a cancelled worker (an exclusive one replaced by the next poll or resync) did not fail
        if not event.worker.group.startswith("agent"):
            self.note(f"{event.worker.name or event.worker.group} failed: {error_text(error)}", severity="error")


_SCREENS_VIEW: type[ConsoleView] = ConsoleApp  # mypy checks here that the app is the ConsoleView its screens are typed against


def error_text(error: BaseException) -> str:
    """An exception as a toast line: its message, or its type when it has none (a bare TimeoutError says nothing)."""
    message = str(error).strip()
    if not message:
        return f"{type(error).__name__} (no message)"
    return message if isinstance(error, AgentError) else f"{type(error).__name__}: {message}"


def _training_screen(**kwargs: Any) -> ConsoleScreen:
    """Imported on first use: plotext costs ~0.15 s at start-up, before the first frame."""
    from console.screens.training import TrainingScreen

    return _with_console_footer(TrainingScreen)(**kwargs)


def _grokking_screen() -> ConsoleScreen:
    from console.screens.grokking import GrokkingScreen

    return _with_console_footer(GrokkingScreen)()


def build_app(
    transport: Transport | list[Transport] | None = None,
    *,
    state: ConsoleState | list[ConsoleState] | None = None,
    target: str | None = None,
    profile: str = "tiny",
    clock: Callable[[], float] | None = None,
    refresh_throttle: float = 0.2,
    poll_interval: float | None = 5.0,
    request_timeout: float = 30.0,
    stop_grace: float = 30.0,
    raw_plots: bool = False,
    chain_args: list[str] | tuple[str, ...] = (),
    signals_interval: float = SIGNALS_INTERVAL_S,
    readonly: bool = False,
    notify_terminal: bool = False,
    rdzv_endpoint: str | None = None,
) -> ConsoleApp:
    """The console app over one transport per host (a list for several hosts), else showing only the (fixed) state(s)
    handed in. Hosts are told apart by their transport's label, which must be unique."""
    transports: list[Transport | None] = list(transport) if isinstance(transport, list) else [transport]
    if isinstance(state, list):
        states = state
        if transports == [None]:
            transports = [None] * len(states)
    else:
        states = [state] if state is not None else [ConsoleState() for _ in transports]
    if len(states) != len(transports):
        raise ValueError(f"{len(transports)} transports but {len(states)} states")
    hosts: list[tuple[AgentClient | None, ConsoleState]] = []
    for one_transport, one_state in zip(transports, states):
        if one_transport is not None:
            one_state.target = one_transport.label
        if clock is not None:
            one_state.clock = clock
        client = AgentClient(one_transport, timeout=request_timeout) if one_transport is not None else None
        hosts.append((client, one_state))
    if target is not None:
        hosts[0][1].target = target
    labels = [s.target for _, s in hosts]
    if len(set(labels)) != len(labels):
        raise ValueError(f"two hosts share a name: {labels}; give each --host once")
    return ConsoleApp(
        hosts,
        profile=profile,
        refresh_throttle=refresh_throttle,
        poll_interval=poll_interval,
        stop_grace=stop_grace,
        raw_plots=raw_plots,
        chain_args=chain_args,
        signals_interval=signals_interval,
        readonly=readonly,
        notify_terminal=notify_terminal,
        rdzv_endpoint=rdzv_endpoint,
    )
