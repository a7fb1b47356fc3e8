"""What every main screen shares: the connection banner, and redrawing from the app's state when shown."""

from __future__ import annotations

from typing import TYPE_CHECKING

from textual.screen import Screen

from console.widgets.banner import ConnectionBanner

if TYPE_CHECKING:
    from console.app import ConsoleApp


class ConsoleScreen(Screen):
    """A main screen: `show_state(changed)` redraws the parts whose state sections changed."""

    MODE = ""  # the app mode that shows this screen

    @property
    def console(self) -> "ConsoleApp":
        return self.app  # type: ignore[return-value]

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


def no_job_text(console: "ConsoleApp") -> str:
    """What to press when no job is selected: n when the host has none yet, ] or [ when it has some."""
    if not console.state.jobs:
        return "no jobs yet: n starts a training run, w watches a run, a adopts a running process"
    return "no job selected (press ] or [ to pick one)"


def touches(changed: set[str] | None, *sections: str) -> bool:
    return changed is None or bool(changed.intersection(sections))
