"""Watch (key w) a run this console did not start, read-only, and unwatch it (key u); adopt (key a) a process as a job it may stop."""

from __future__ import annotations

from backend.protocol import Request
from backend.safetext import visible
from console.client import AgentError
from console.flows.base import FlowHost
from console.screens.modals import AdoptModal, WatchModal
from console.screens.unwatch_modal import UnwatchModal
from console.state import EXTERNAL_PREFIX, Section


class WatchFlow:
    """Watch a TensorBoard dir or a SpecForge log as ext:<name>: its records are read by the agent, nothing is signalled."""

    def __init__(self, app: FlowHost):
        self.app = app

    async def run(self) -> None:
        app, host = self.app, self.app.active
        choice = await app.push_screen_wait(WatchModal())
        if not choice:
            app.note("watch cancelled; nothing is watched")
            return
        reason = app.refusal("watch_external", host)
        if reason:
            app.note(f"watch not sent: {reason}", severity="error")
            return
        line_format = choice.get("line_format")
        try:
            extra = {"line_format": line_format} if line_format else {}
            result = await host.request(Request.WATCH_EXTERNAL, name=choice["name"], path=choice["path"], **extra)
        except AgentError as exc:
            app.note(f"cannot watch {choice['path']}: {exc}", severity="error")
            return
        app.set_active(host)
        state = app.state
        job = str(result.get("job") or EXTERNAL_PREFIX + choice["name"])
        state.metrics.pop(job, None)  # the agent's reader starts from the beginning of the run
        state.signals.pop(job, None)
        app.active.externals_agent = state.hello.agent_pid if state.hello else None
        fmt, warning = result.get("format"), result.get("warning")
        app.state_changed(state.add_external(job, choice["path"], line_format=line_format, fmt=fmt if isinstance(fmt, str) else None))
        read_as = f"read as {fmt}" if isinstance(fmt, str) else "format not known yet"
        app.note(f"watching {choice['path']} as {job} ({read_as}; read-only: no stop or adopt)")
        if isinstance(warning, str) and warning:
            app.note(f"{job}: {visible(warning)}", severity="warning")
        app.select_started_job(job, None)


class UnwatchFlow:
    """Stop watching the selected ext: run, after a confirmation: the agent drops its reader; nothing on the host is touched."""

    def __init__(self, app: FlowHost):
        self.app = app

    async def run(self) -> None:
        app, host, job = self.app, self.app.active, self.app.selected_job
        if not job or not host.state.is_external(job):
            app.note(f"unwatch: {job or 'no job'} is not a watched run")
            return
        path = host.state.externals.get(job, "?")
        if not await app.push_screen_wait(UnwatchModal(job, path)):
            app.note(f"unwatch cancelled; still watching {job}")
            return
        reason = app.refusal("unwatch_external", host)
        if reason:
            app.note(f"unwatch not sent: {reason}", severity="error")
            return
        try:
            await host.request(Request.UNWATCH_EXTERNAL, name=job)
        except AgentError as exc:
            if exc.code != "not_found":  # not_found: this agent had no such watch (a re-watch failed); forget it here too
                app.note(f"cannot unwatch {job}: {exc}", severity="error")
                return
        app.state_changed(host.state.remove_external(job))
        app.note(f"stopped watching {path} as {job}; nothing on the host was touched")
        remaining = list(host.state.jobs.values())
        running = [j for j in remaining if j.state == "running"]
        if remaining:
            app.select_started_job((running or remaining)[-1].name, None, host)
        else:
            app.selected_job = None
            app.state_changed({Section.SELECTION})


class AdoptFlow:
    """Adopt a foreign GPU holder as a job (its PID typed to confirm), so the next s plans its stop."""

    def __init__(self, app: FlowHost):
        self.app = app

    async def run(self) -> None:
        app, host = self.app, self.app.active
        foreign = [h for h in host.state.holders if not h.owned]
        choice = await app.push_screen_wait(AdoptModal(foreign, foreign[0].pid if len(foreign) == 1 else None))
        if not choice:
            app.note("adopt cancelled; nothing adopted")
            return
        reason = app.refusal("adopt", host)
        if reason:
            app.note(f"adopt not sent: {reason}", severity="error")
            return
        try:
            result = await host.request(Request.ADOPT_JOB, **choice)
        except AgentError as exc:
            app.note(f"adopt {choice['pid']} refused: {exc}", severity="error")
            return
        name = str((result.get("job") or {}).get("name") or choice["name"])
        app.note(f"adopted pid {choice['pid']} as {name}")
        app.select_started_job(name, result.get("job"), host)  # the next s plans the stop of the job just adopted
        app.resync(host)
