"""Alerts shown: each host's state changes through console/alerts.py to toasts (with --notify the terminal), and exit reasons.

The reason of each job that exited non-zero (its last stderr line) is asked of its host once."""

from __future__ import annotations

from functools import partial

from backend.protocol import Request
from backend.safetext import visible
from console.alerts import ENDED_STATES, AlertMemory, new_alerts
from console.client import AgentError
from console.flows.base import FlowHost
from console.session import HostSession, Severity
from console.state import Section

EXIT_REASON_LINES = 20  # stderr lines read back from a job that exited non-zero; the last non-empty one is its reason
EXIT_REASON_CHARS = 200


class Alerting:
    """Every host's alerts, each raised once; `alerts` and `terminal_writes` keep what was shown, newest last."""

    def __init__(self, app: FlowHost, notify_terminal: bool = False):
        self.app = app
        self.notify_terminal = notify_terminal  # --notify: bell + OSC 9 / OSC 777 desktop notifications on alerts
        self.alerts: list[str] = []  # every alert raised, newest last
        self.terminal_writes: list[str] = []  # notifications sent to the terminal (--notify), newest last
        self._memory: dict[str, AlertMemory] = {}  # per host: what its alerts have seen
        self._exit_reasons_asked: set[tuple[str, str]] = set()  # (host, job) whose exit reason was asked for

    def check(self, sections: set[str], session: HostSession) -> None:
        """Called with each state change of a host: each alert is raised once (a toast); with --notify also on the terminal."""
        if Section.JOBS in sections:
            self._fetch_exit_reasons(session)
        where = f" on {session.name}" if self.app.multi_host else ""
        memory, alerts = new_alerts(self._memory.get(session.name, AlertMemory()), session.state, sections, where)
        self._memory[session.name] = memory
        for alert in alerts:
            self.alert(alert.text, severity=alert.severity)

    def alert(self, text: str, *, severity: Severity = "warning") -> None:
        """A toast (not an Actions line: those are the operator's actions and their outcomes); with --notify also the terminal."""
        self.alerts.append(text)
        self.app.notify(visible(text), severity=severity, timeout=10, markup=False)  # host text in it: inert, never markup
        if self.notify_terminal:
            self.write_terminal(terminal_notification(text))

    def write_terminal(self, data: str) -> None:
        self.terminal_writes.append(data)
        driver = getattr(self.app, "_driver", None)
        if driver is not None:
            driver.write(data)
            driver.flush()

    def _fetch_exit_reasons(self, session: HostSession) -> None:
        """A job that exited non-zero: its last stderr line is the reason ("exited 1" alone says nothing), asked once."""
        state = session.state
        for name, job in state.jobs.items():
            key = (session.name, name)
            if job.state in ENDED_STATES and job.exit_code not in (None, 0) and key not in self._exit_reasons_asked and not state.is_external(name):
                self._exit_reasons_asked.add(key)
                if session.connected:
                    self.app.run_worker(partial(self._exit_reason, session, name), group=f"exit-reason:{session.name}", exit_on_error=False)

    async def _exit_reason(self, session: HostSession, name: str) -> None:
        try:
            result = await session.request(Request.TAIL_LOG, name=name, stream="stderr", lines=EXIT_REASON_LINES)
        except AgentError:
            self._exit_reasons_asked.discard((session.name, name))  # asked again with the next jobs list
            return
        lines = [str(line).strip() for line in result.get("lines") or [] if str(line).strip()]
        if not lines:
            return
        session.state.exit_reasons[name] = lines[-1][:EXIT_REASON_CHARS]
        job = session.state.jobs.get(name)
        where = f" on {session.name}" if self.app.multi_host else ""
        code = f" {job.exit_code}" if job is not None else ""
        self.app.note(f"{name}{where} exited{code}: {visible(lines[-1][:EXIT_REASON_CHARS])}", severity="error")
        session.changed({Section.JOBS})


def terminal_notification(text: str) -> str:
    """Bell, then the same line as an OSC 9 (iTerm2, WezTerm, kitty, Windows Terminal) and an OSC 777 (VTE, foot,
    urxvt) desktop notification. Control characters are dropped; ';' would end OSC 777's fields."""
    clean = "".join(ch if ch.isprintable() else " " for ch in text)[:240]
    return f"\a\x1b]9;eagle3: {clean}\x07\x1b]777;notify;eagle3-console;{clean.replace(';', ',')}\x07"
