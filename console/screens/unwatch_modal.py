"""The u key's question: stop watching an ext: run? Says that nothing on the host is touched."""

from __future__ import annotations

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.widgets import Button, Static

from backend.safetext import visible
from console.format import inert_text
from console.screens.modals import ConfirmModal


class UnwatchModal(ConfirmModal):
    """True only on y (or the Unwatch button); esc, Cancel (the default) keep watching."""

    BINDINGS = [Binding("escape", "cancel", "Cancel"), Binding("y", "confirm", "Unwatch")]

    def __init__(self, job: str, path: str):
        super().__init__()
        self.job = job
        self.path = path

    def compose(self) -> ComposeResult:
        with Vertical(id="dialog", classes="modal-dialog"):
            yield Static(Text(f"Stop watching {visible(self.job)}?"), classes="modal-title")
            yield Static(unwatch_text(self.job, self.path), id="unwatch-plan")
            with Horizontal(classes="modal-buttons"):
                yield Button("Unwatch (y)", id="confirm", variant="warning")
                yield Button("Cancel (esc)", id="cancel", variant="primary")

    def action_confirm(self) -> None:
        self.dismiss(True)


@inert_text
def unwatch_text(job: str, path: str) -> Text:
    text = Text()
    text.append("watched path  ", style="bold")
    text.append(f"{path}\n\n")
    text.append("Nothing on the host is touched: ", style="bold green")
    text.append("no process is signalled and no file is changed or deleted; the run goes on as it was. ")
    text.append("The agent only stops reading it, and its curves leave this console.\n\n")
    text.append(f"w watches it again (read from its beginning); the config file stops listing {job}.", style="dim")
    return text
