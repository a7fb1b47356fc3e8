"""The Grokking screen's host-computed numbers: the selected job's signals (throttled) and its data scaling."""

from __future__ import annotations

import time
from functools import partial
from typing import Any

from backend.commands import option_value
from backend.protocol import Request
from console.client import AgentError
from console.flows.base import FlowHost
from console.state import Section

SIGNALS_INTERVAL_S = 5.0  # at most one `signals` request per job this often (the host computes them on request)
DATA_SCALING_EVERY_S = 60.0


class SignalsFeed:
    """Asks for the selected job's signals while the Grokking screen shows it: at most once per `interval`, later asks
    folded into one timer; its data scaling when the screen comes up and the last reply is older than a minute."""

    def __init__(self, app: FlowHost, interval: float = SIGNALS_INTERVAL_S):
        self.app = app
        self.interval = interval
        self.fetches = 0
        self._next: dict[str, float] = {}
        self._timer: Any = None
        self._data_scaling_at: dict[str, float] = {}

    def _shown(self) -> bool:
        return getattr(self.app.shown_screen, "MODE", None) == "grokking" and self.app.active.connected

    def grokking_shown(self, force: bool = False) -> None:
        """The Grokking screen came up (or its job changed): signals now (throttled), data scaling when old."""
        job = self.app.selected_job
        if not job or not self._shown():
            return
        self.request(job)
        last = self._data_scaling_at.get(job)
        if force or last is None or time.monotonic() - last > DATA_SCALING_EVERY_S:
            self._data_scaling_at[job] = time.monotonic()
            self.app.run_worker(partial(self._fetch_data_scaling, job), name="fetch_data_scaling", group="data_scaling", exclusive=True, exit_on_error=False)

    def request(self, job: str | None) -> None:
        """Ask for signals of the selected job at most once per `interval`; later asks are folded into one timer."""
        if not job or job != self.app.selected_job or not self._shown():
            return
        if self._timer is not None:
            return  # one fetch is already scheduled: it will see these metrics too
        wait = self._next.get(job, 0.0) - time.monotonic()
        if wait <= 0:
            self.app.run_worker(partial(self._fetch_signals, job), name="fetch_signals", group="signals", exclusive=True, exit_on_error=False)
        else:
            self._timer = self.app.set_timer(wait, self._timer_fired)

    def cancel_timer(self) -> None:
        if self._timer is not None:  # it was scheduled for the previously selected job
            self._timer.stop()
            self._timer = None

    def _timer_fired(self) -> None:
        self._timer = None
        self.request(self.app.selected_job)

    async def _fetch_signals(self, job: str) -> None:
        app = self.app
        self._next[job] = time.monotonic() + self.interval
        self.fetches += 1
        try:
            result = await app.active.request(Request.SIGNALS, name=job, timeout=120)
        except AgentError as exc:
            if exc.code not in ("disconnected", "timeout"):
                app.note(f"signals of {job}: {exc}", severity="warning")
            return
        app.state.signals[job] = result
        app.state.signals_at[job] = app.state.clock()
        app.state_changed({Section.SIGNALS})

    async def _fetch_data_scaling(self, job: str) -> None:
        """Measured from the run's --data dir; else estimated from the profile's shapes (the agent says which)."""
        app, state = self.app, self.app.state
        info = state.jobs.get(job)
        if state.is_external(job):  # neither its data dir nor its shapes are known: the console's profile is not its
            state.data_scaling[job] = {"error": f"{job} is a watched run: its data dir and sample shapes are not known here"}
            app.state_changed({Section.DATA_SCALING})
            return
        data_dir = option_value(info.argv, "--data") if info and info.argv else None
        params: dict[str, Any] = {"data_dir": data_dir} if data_dir else {}
        if not data_dir:
            facts = app.profile_facts(app.profile_of(job), self._run_dir_of(job))
            if facts.error:
                state.data_scaling[job] = {"error": f"{job} has no --data dir and its profile cannot be read here: {facts.error}"}
                app.state_changed({Section.DATA_SCALING})
                return
            params = {"data_dir": facts.data_dir, "shape": facts.shape}
        try:
            result = await app.active.request(Request.DATA_SCALING, **params, timeout=60)
        except AgentError as exc:
            if exc.code in ("disconnected", "timeout"):
                return
            result = {"error": exc.message}
        app.state.data_scaling[job] = result
        app.state_changed({Section.DATA_SCALING})

    def _run_dir_of(self, job: str) -> str | None:
        """The run dir `job` ran under: its --run-dir, else its host's (hello.run_dir); None when neither is known."""
        state = self.app.state
        info = state.jobs.get(job)
        given = option_value(info.argv, "--run-dir") if info and info.argv else None
        return given or (state.hello.run_dir if state.hello else None)
