"""The ? key: every key of the console on one screen, the app's and each screen's, with what it does."""

from __future__ import annotations

from typing import Any, Sequence

from rich.console import Group, RenderableType
from rich.table import Table
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


def keys_text(actions: Sequence[Any], screen_names: dict[str, str], disabled: dict[str, str]) -> RenderableType:
    """The keys as tables: app-wide first, then per screen; `disabled` maps an action name to why it is off now. A long
    description wraps inside its own column, under itself, on a narrow terminal."""
    sections: list[RenderableType] = [Text("Everywhere", style="bold underline")]
    sections.append(_table([(a.key, a.label, a.help, disabled.get(a.name)) for a in actions if a.screen is None]))
    for mode, name in screen_names.items():
        own = [a for a in actions if a.screen == mode]
        if own:
            sections += [Text(f"\n{name}", style="bold underline"), _table([(a.key, a.label, a.help, disabled.get(a.name)) for a in own])]
    sections += [Text("\nAlso", style="bold underline"), _table([(key, label, what, None) for key, label, what in EXTRA_KEYS])]
    return Group(*sections)


def _table(rows: list[tuple[str, str, str, str | None]]) -> Table:
    table = Table.grid(padding=(0, 1))
    table.add_column(width=11, justify="right", style="bold cyan", no_wrap=True)
    table.add_column(width=14, no_wrap=True)
    table.add_column(ratio=1)
    for key, label, what, reason in rows:
        description = Text(what, style="" if reason is None else "dim")
        if reason:
            description.append(f"  (off: {reason})", style="dim yellow")
        table.add_row(key, Text(label, style="bold" if reason is None else "dim"), description)
    return table


class HelpModal(ModalScreen[None]):
    """Every key; ? or esc closes it."""

    BINDINGS = [Binding("escape", "close", "Close"), Binding("question_mark", "close", "Close"), Binding("q", "close", "Close")]

    def __init__(self, text: RenderableType):
        super().__init__()
        self.text = text

    def compose(self) -> ComposeResult:
        with Vertical(id="dialog", classes="modal-dialog"):
            yield Static("Keys (? or esc closes)", classes="modal-title")
            with VerticalScroll(id="help-scroll"):
                yield Static(self.text, id="help-keys")

    def action_close(self) -> None:
        self.dismiss(None)
