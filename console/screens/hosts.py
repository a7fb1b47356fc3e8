"""Hosts: every host at a glance (link, GPU memory and utilization, holders owned/foreign, jobs, disk), and the nodes of the
selected multi-node job; choosing a host makes it the one the other screens show."""

from __future__ import annotations

from rich.text import Text
from textual.app import ComposeResult
from textual.containers import Vertical
from textual.widgets import DataTable, Header, Static

from backend.safetext import visible
from console.screens.base import ConsoleScreen, touches
from console.widgets.banner import ConnectionBanner
from console.widgets.hosts import HOST_COLUMNS, host_cells, nodes_text
from console.widgets.panels import ConsoleFooter
from console.state import Section


class HostsScreen(ConsoleScreen):
    MODE = "hosts"
    TITLE = "eagle3-console · Hosts (6)"  # the header names the screen
    _drawn_active: str | None = None  # the active host the hosts table was last drawn for

    def compose(self) -> ComposeResult:
        yield Header()
        yield ConnectionBanner(id="banner")
        with Vertical(id="hosts-body"):
            yield Static("Hosts (enter or arrows: show that host on every screen)", classes="section-title")
            yield DataTable(id="hosts", cursor_type="row", zebra_stripes=True)
            yield Static("Nodes of the selected job", classes="section-title")
            yield Static(id="hosts-nodes")
        yield ConsoleFooter()

    def on_mount(self) -> None:
        self.query_one("#hosts", DataTable).add_columns(*HOST_COLUMNS)
        self.show_state(None)

    def draw(self, changed: set[str] | None) -> None:
        if touches(changed, Section.HOSTS, Section.CONNECTION, Section.GPUS, Section.HOLDERS, Section.JOBS, Section.DISKS, Section.HELLO, Section.SELECTION):
            table = self.query_one("#hosts", DataTable)
            table.clear()
            for session in self.console.sessions:
                table.add_row(*host_cells(session), key=session.name)
            table.move_cursor(row=table.get_row_index(self.console.active.name), animate=False)
            self._drawn_active = self.console.active.name
            nodes = self.console.nodes_of(self.console.selected_job)
            job = self.console.selected_job
            text = nodes_text(nodes) if len(nodes) > 1 else Text(visible(f"{job or 'no job'} on {self.console.active.name}: a one-node job"))
            self.query_one("#hosts-nodes", Static).update(text)

    def on_data_table_row_highlighted(self, event: DataTable.RowHighlighted) -> None:
        if event.data_table.id != "hosts" or event.row_key is None or not event.row_key.value:
            return
        if event.cursor_row != event.data_table.cursor_row:
            return
        if self._drawn_active != self.console.active.name:
            return  # stale: the active host changed elsewhere and this table has not been redrawn for it yet
        self.console.select_host(str(event.row_key.value))
