"""What a flow uses of the console app: a narrow protocol, so that no flow imports the app."""

from __future__ import annotations

from typing import Any, Callable, Coroutine, Protocol, TypeVar

from textual.notifications import SeverityLevel
from textual.screen import Screen

from backend.commands import ProfileFacts
from console.session import HostSession
from console.state import ConsoleState
from console.nodes import Node

ResultT = TypeVar("ResultT")


class FlowHost(Protocol):
    """The console app as its flows see it: the hosts, the selection, notes, redraws, modals and workers."""

    sessions: list[HostSession]
    active: HostSession
    selected_job: str | None
    profile: str
    stop_grace: float
    rdzv_endpoint: str | None
    resume_target: dict[str, Any] | None

    @property
    def state(self) -> ConsoleState: ...

    @property
    def shown_screen(self) -> Screen[object] | None: ...

    @property
    def multi_host(self) -> bool: ...

    def note(self, text: str, *, severity: SeverityLevel = "information") -> None: ...

    def notify(self, message: str, *, title: str = "", severity: SeverityLevel = "information", timeout: float | None = None, markup: bool = True) -> None: ...

    def state_changed(self, sections: set[str]) -> None: ...

    def set_active(self, session: HostSession) -> None: ...

    def session_named(self, host: str | None) -> HostSession: ...

    def select_started_job(self, name: str, wire: dict[str, Any] | None, host: HostSession | None = None) -> None: ...

    def nodes_of(self, name: str | None) -> list[Node]: ...

    def disabled_reason(self, action: str) -> str | None: ...

    def refusal(self, action: str, host: HostSession) -> str | None: ...

    def resync(self, session: HostSession | None = None) -> None: ...

    def profile_of(self, job: str | None, host: HostSession | None = None) -> str: ...

    def profile_facts(self, name: str, run_dir: str | None = None) -> ProfileFacts: ...

    def refresh_bindings(self) -> None: ...

    def switch_mode(self, mode: str) -> Any: ...

    async def push_screen_wait(self, screen: Screen[ResultT]) -> ResultT: ...

    def run_worker(
        self,
        work: Coroutine[Any, Any, Any] | Callable[[], Coroutine[Any, Any, Any]],
        name: str | None = "",
        group: str = "default",
        description: str = "",
        exit_on_error: bool = True,
        start: bool = True,
        exclusive: bool = False,
    ) -> Any: ...

    def set_timer(self, delay: float, callback: Callable[[], Any] | None = None) -> Any: ...


def started_note(name: str, result: dict[str, Any], argv: list[str]) -> str:
    """The Actions line of a job the host just started: its name, its pid and its command line."""
    return f"started {name} (pid {(result.get('job') or {}).get('pid', '?')}): {' '.join(argv)}"
