"""Dashboard: GPUs with owned/foreign holders, jobs and their state, latest metrics of the selected job, disks."""

from __future__ import annotations

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.widgets import DataTable, Header, Input, Static

from console.screens.base import ConsoleScreen, touches
from console.widgets.banner import ConnectionBanner
from console.widgets.panels import ConsoleFooter
from console.widgets.gpu_panel import GpuPanel
from textual import events

from console.nodes import JOB_COLUMNS
from console.widgets.hosts import (
    DEFAULT_SORT,
    NARROW_HOSTS_JOB_COLUMNS,
    NARROW_JOB_COLUMNS,
    NARROW_WIDTH,
    SORT_KEYS,
    column_label,
    job_table_rows,
    nodes_text,
    row_key,
    sort_label,
    sort_rows,
    split_row_key,
)
from console.widgets.panels import ActionLog, DiskPanel, LatestMetrics
from console.state import Section


class DashboardScreen(ConsoleScreen):
    MODE = "dashboard"
    TITLE = "eagle3-console · Dashboard (1)"  # the header names the screen
    _drawn_selection: str | None = None  # the selection the jobs table was last drawn for
    _columns: tuple[str, ...] = ()  # the jobs table's columns as drawn (fewer on a narrow terminal)

    BINDINGS = [
        Binding("h", "toggle_workers", "Workers"),
        Binding("slash", "filter_jobs", "Filter"),
        Binding("greater_than_sign", "sort_jobs", "Sort"),
        Binding("less_than_sign", "reverse_sort", "Reverse"),
        Binding("u", "unwatch_external", "Unwatch"),
    ]
    AUTO_FOCUS = "#jobs"  # not the hidden filter box
    job_filter = ""  # the jobs table and the GPU holders show only rows holding this text (any case); "" shows all
    job_sort = DEFAULT_SORT  # the jobs table's sort key (console/widgets/hosts.py SORT_KEYS)
    sort_reversed = False

    def action_toggle_workers(self) -> None:
        """Show or hide each job's helper processes (compile workers...) under its GPU holder row."""
        self.console.holders_expanded = not self.console.holders_expanded
        self._draw_gpus()

    def action_sort_jobs(self) -> None:
        """> : sort the jobs table by the next of SORT_KEYS (htop's < >, k9s's sort keys); the header marks it."""
        self.job_sort = SORT_KEYS[(SORT_KEYS.index(self.job_sort) + 1) % len(SORT_KEYS)]
        self.sort_reversed = False
        self._set_columns()
        self._draw_jobs()

    def action_reverse_sort(self) -> None:
        """< : the same sort, the other way round (htop's I)."""
        self.sort_reversed = not self.sort_reversed
        self._set_columns()
        self._draw_jobs()

    async def action_unwatch_external(self) -> None:
        """u : stop watching the selected ext: run (the app's flow asks first)."""
        await self.app.run_action("unwatch_external")

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        if action == "unwatch_external":
            return self.app.check_action(action, parameters)  # the app's guard: greyed in the footer when off
        return True

    def compose(self) -> ComposeResult:
        yield Header()
        yield ConnectionBanner(id="banner")
        with Horizontal(id="dash-body"):
            with Vertical(id="dash-left"):
                yield Static("GPUs", classes="section-title", id="gpus-title")
                yield GpuPanel(id="gpus")
                yield Static("Jobs", classes="section-title", id="jobs-title")
                yield Input(placeholder="filter jobs and GPU holders: name, state, pid, user, command (enter keeps, esc clears)", id="jobs-filter")
                yield DataTable(id="jobs", cursor_type="row", zebra_stripes=True)
            with Vertical(id="dash-right"):
                yield Static("Latest metrics", classes="section-title")
                yield LatestMetrics(id="latest")
                yield Static("Nodes", classes="section-title", id="nodes-title")
                yield Static(id="nodes")
                yield Static("Disks", classes="section-title")
                yield DiskPanel(id="disks")
                yield Static("Actions", classes="section-title")
                yield ActionLog(id="actions")
        yield ConsoleFooter()

    def on_mount(self) -> None:
        self._set_columns()
        self.show_state(None)

    def action_filter_jobs(self) -> None:
        """/ : type to narrow the jobs table and the GPU holders at once (k9s, htop); enter keeps the filter, esc clears it."""
        box = self.query_one("#jobs-filter", Input)
        box.display = True
        box.focus()

    def on_input_changed(self, event: Input.Changed) -> None:
        if event.input.id == "jobs-filter":
            self.job_filter = event.value.strip()
            self._draw_jobs()
            self._draw_gpus()

    def on_input_submitted(self, event: Input.Submitted) -> None:
        if event.input.id == "jobs-filter":
            event.input.display = bool(self.job_filter)
            self.query_one("#jobs", DataTable).focus()

    def on_key(self, event: events.Key) -> None:
        box = self.query_one("#jobs-filter", Input)
        if event.key == "escape" and box.display:
            box.value = ""
            box.display = False
            self.query_one("#jobs", DataTable).focus()
            event.stop()

    def on_resize(self, event: events.Resize) -> None:
        if self._columns != self._columns_for(event.size.width):
            self._set_columns()
            self._draw_jobs()

    def _columns_for(self, width: int) -> tuple[str, ...]:
        if width >= NARROW_WIDTH:
            return JOB_COLUMNS
        return NARROW_HOSTS_JOB_COLUMNS if self.console.multi_host else NARROW_JOB_COLUMNS

    def _set_columns(self) -> None:
        table = self.query_one("#jobs", DataTable)
        table.clear(columns=True)
        self._columns = self._columns_for(self.app.size.width)
        narrow = self._columns != JOB_COLUMNS
        labels = [column_label(name, narrow=narrow, sort=self.job_sort, reverse=self.sort_reversed) for name in self._columns]
        table.header_height = max(label.count("\n") + 1 for label in labels)
        table.add_columns(*(("host",) if self.console.multi_host else ()), *labels)

    def draw(self, changed: set[str] | None) -> None:
        state = self.console.state
        if touches(changed, Section.GPUS, Section.HOLDERS, Section.HELLO, Section.JOBS):
            self._draw_gpus()
        if touches(changed, Section.JOBS, Section.METRICS, Section.SELECTION, Section.CONNECTION, Section.HOSTS):
            self._draw_jobs()
        if touches(changed, Section.METRICS, Section.JOBS, Section.SELECTION, Section.HOSTS):
            self.query_one(LatestMetrics).show_state(state, self.console.selected_job)
            self._draw_nodes()
        if touches(changed, Section.DISKS):
            self.query_one(DiskPanel).show_state(state)
        if touches(changed, Section.ACTIONS):
            self.query_one(ActionLog).show_state(state)

    def _draw_gpus(self) -> None:
        panel = self.query_one(GpuPanel)
        panel.holder_filter = self.job_filter
        panel.show_state(self.console.state, self.console.holders_expanded)
        shown, total = panel.holders_shown
        title = f"GPUs · filter '{self.job_filter}': {shown} of {total} holders" if self.job_filter else "GPUs"
        self.query_one("#gpus-title", Static).update(Text(title))

    def _draw_nodes(self) -> None:
        """The selected multi-node job's nodes and ranks (hidden for a one-node job)."""
        nodes = self.console.nodes_of(self.console.selected_job)
        panel = self.query_one("#nodes", Static)
        panel.display = len(nodes) > 1
        self.query_one("#nodes-title", Static).display = len(nodes) > 1
        if len(nodes) > 1:
            panel.update(nodes_text(nodes))

    def _selection_key(self) -> str | None:
        return row_key(self.console.active.name, self.console.selected_job) if self.console.selected_job else None

    def _draw_jobs(self) -> None:
        table = self.query_one("#jobs", DataTable)
        table.clear()
        multi = self.console.multi_host
        rows = job_table_rows(self.console.job_rows(), self.console.sessions)
        wanted = self.job_filter.lower()
        shown = [row for row in rows if not wanted or any(wanted in str(cell).lower() for cell in row.cells)]
        ordered = sort_rows(shown, self.job_sort, self.sort_reversed)
        for row in ordered:
            table.add_row(*row.pick(self._columns, host=multi), key=row.key)
        self.console.table_order = [split_row_key(row.key) for row in ordered]  # what [ and ] walk
        parts = ["Jobs"]
        if self.job_sort != DEFAULT_SORT or self.sort_reversed:
            parts.append(f"by {sort_label(self.job_sort, self.sort_reversed)}")
        if wanted:
            parts.append(f"filter '{self.job_filter}': {len(shown)} of {len(rows)} (/ edits, esc clears)")
        self.query_one("#jobs-title", Static).update(Text(" · ".join(parts)))
        selected = self._selection_key()
        self._drawn_selection = selected
        if selected is not None and selected in table.rows:
            table.move_cursor(row=table.get_row_index(selected), animate=False)

    def on_data_table_row_highlighted(self, event: DataTable.RowHighlighted) -> None:
        if event.data_table.id != "jobs" or event.row_key is None or not event.row_key.value:
            return
        table = event.data_table
        if event.cursor_row != table.cursor_row or event.row_key not in table.rows or table.get_row_index(event.row_key) != table.cursor_row:
            return  # stale: posted by a rebuild before the cursor was put back on the selected job (row or key moved since)
        if self._selection_key() != self._drawn_selection:
            return  # stale: the selection changed (a key, a click elsewhere) and this table has not been redrawn for it yet
        host, name = split_row_key(event.row_key.value)
        self.console.select_job(name, host)
