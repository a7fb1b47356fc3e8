"""The ? key: every key of the console on one screen, the app's and each screen's, with what it does."""

from __future__ import annotations

from typing import Any, Sequence

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical, VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Static

# Keys that are no console action of their own: the plots' zoom, the jobs table, every modal.
EXTRA_KEYS: tuple[tuple[str, str, str], ...] = (
    ("+ - , . 0", "Zoom", "Training, Grokking: zoom in / out, pan left / right, whole run"),
    ("↑ ↓", "Pick a job", "Dashboard: move through the jobs table (the selection follows)"),
    ("ctrl+p", "Palette", "every action by name; a disabled one says why"),
    ("y / esc", "Confirm / cancel", "in every modal: nothing is sent before y (or enter in a form)"),
)


def keys_text(actions: Sequence[Any], screen_names: dict[str, str], disabled: dict[str, str]) -> Text:
    """The keys as a table: app-wide first, then per screen; `disabled` maps an action name to why it is off now."""
    text = Text()
    text.append("Everywhere\n", style="bold underline")
    for action in actions:
        if action.screen is None:
            _row(text, action.key, action.label, action.help, disabled.get(action.name))
    for mode, name in screen_names.items():
        own = [a for a in actions if a.screen == mode]
        if own:
            text.append(f"\n{name}\n", style="bold underline")
            for action in own:
                _row(text, action.key, action.label, action.help, disabled.get(action.name))
    text.append("\nAlso\n", style="bold underline")
    for key, label, what in EXTRA_KEYS:
        _row(text, key, label, what, None)
    return text


def _row(text: Text, key: str, label: str, what: str, reason: str | None) -> None:
    text.append(f"  {key:>9}  ", style="bold cyan")
    text.append(f"{label:<14} ", style="bold" if reason is None else "dim")
    text.append(what, style="" if reason is None else "dim")
    if reason:
        text.append(f"  (off: {reason})", style="dim yellow")
    text.append("\n")


class HelpModal(ModalScreen[None]):
    """Every key; ? or esc closes it."""

    BINDINGS = [Binding("escape", "close", "Close"), Binding("question_mark", "close", "Close"), Binding("q", "close", "Close")]

    def __init__(self, text: Text):
        super().__init__()
        self.text = text

    def compose(self) -> ComposeResult:
        with Vertical(id="dialog", classes="modal-dialog"):
            yield Static("Keys (? or esc closes)", classes="modal-title")
            with VerticalScroll(id="help-scroll"):
                yield Static(self.text, id="help-keys")

    def action_close(self) -> None:
        self.dismiss(None)
