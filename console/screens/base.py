"""What every main screen shares: the banner, redrawing when shown, and ConsoleView, what a screen may use of the app."""

from __future__ import annotations

from typing import Protocol, cast, runtime_checkable

from textual.screen import Screen

from console.nodes import Node
from console.session import HostSession, Severity
from console.state import ConsoleState
from console.widgets.banner import ConnectionBanner


@runtime_checkable
class ConsoleView(Protocol):
    """The console app as its screens see it: the hosts and the selection, what to load, and the keys' effects."""

    sessions: list[HostSession]
    active: HostSession
    selected_job: str | None
    holders_expanded: bool
    table_order: list[tuple[str, str]]  # (host, job) as the jobs table last drew them: sorted and filtered

    @property
    def state(self) -> ConsoleState: ...

    @property
    def multi_host(self) -> bool: ...

    @property
    def log_stream(self) -> str: ...

    def job_rows(self) -> list[tuple[HostSession, str]]: ...

    def nodes_of(self, name: str | None) -> list[Node]: ...

    def select_job(self, name: str | None, host: str | None = None) -> None: ...

    def select_host(self, host: str) -> None: ...

    def set_log_stream(self, stream: str) -> None: ...

    def ensure_summary(self, name: str | None, *, log_x: bool) -> None: ...

    def request_zoom(self, name: str, step_from: int, step_to: int, points: int, log_x: bool) -> None: ...

    def profile_of(self, job: str | None, host: HostSession | None = None) -> str: ...

    def grokking_shown(self, force: bool = False) -> None: ...

    def current_chain_job(self) -> str | None: ...

    def attach_chain(self, chain: str | None) -> None: ...

    def note(self, text: str, *, severity: Severity = "information") -> None: ...


class ConsoleScreen(Screen):
    """A main screen: `show_state(changed)` redraws the parts whose state sections changed."""

    MODE = ""  # the app mode that shows this screen

    @property
    def console(self) -> ConsoleView:
        return cast(ConsoleView, self.app)

    def on_screen_resume(self) -> None:
        self.show_state(None)

    def show_state(self, changed: set[str] | None) -> None:
        """Redraw from `self.console.state`; changed=None means everything."""
        banners = self.query(ConnectionBanner)
        if not self.is_mounted or not banners:
            return  # not composed yet: on_mount draws everything
        state = self.console.state
        banners.first().show_state(state)
        self.set_class(state.stale, "-stale")  # the tcss dims what is no longer live
        self.draw(changed)

    def draw(self, changed: set[str] | None) -> None:
        raise NotImplementedError


def no_job_text(console: ConsoleView) -> str:
    """What to press when no job is selected: n when the host has none yet, ] or [ when it has some."""
    if not console.state.jobs:
        return "no jobs yet: n starts a training run, w watches a run, a adopts a running process"
    return "no job selected (press ] or [ to pick one)"


def touches(changed: set[str] | None, *sections: str) -> bool:
    return changed is None or bool(changed.intersection(sections))
