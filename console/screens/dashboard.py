"""Dashboard: GPUs with owned/foreign holders, jobs and their state, latest metrics of the selected job, disks."""
from __future__ import annotations

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.widgets import DataTable, Header, Static

from console.screens.base import ConsoleScreen, touches
from console.widgets.banner import ConnectionBanner
from console.widgets.panels import ConsoleFooter
from console.widgets.format import duration, number
from console.widgets.gpu_panel import GpuPanel
from console.widgets.panels import ActionLog, DiskPanel, LatestMetrics

JOB_COLUMNS = ("job", "kind", "state", "pid", "pgid", "runtime", "exit", "step", "loss", "detail")
STATE_STYLES = {"running": "green", "exited": "dim", "stopped": "yellow", "stale": "red", "unknown": "red"}


class DashboardScreen(ConsoleScreen):
    MODE = "dashboard"

    BINDINGS = [Binding("h", "toggle_workers", "Workers")]

    def action_toggle_workers(self) -> None:
        """Show or hide each job's helper processes (compile workers...) under its GPU holder row."""
        self.console.holders_expanded = not self.console.holders_expanded
        self.query_one(GpuPanel).show_state(self.console.state, self.console.holders_expanded)

    def compose(self) -> ComposeResult:
        yield Header()
        yield ConnectionBanner(id="banner")
        with Horizontal(id="dash-body"):
            with Vertical(id="dash-left"):
                yield Static("GPUs", classes="section-title")
                yield GpuPanel(id="gpus")
                yield Static("Jobs", classes="section-title")
                yield DataTable(id="jobs", cursor_type="row", zebra_stripes=True)
            with Vertical(id="dash-right"):
                yield Static("Latest metrics", classes="section-title")
                yield LatestMetrics(id="latest")
                yield Static("Disks", classes="section-title")
                yield DiskPanel(id="disks")
                yield Static("Actions", classes="section-title")
                yield ActionLog(id="actions")
        yield ConsoleFooter()

    def on_mount(self) -> None:
        table = self.query_one("#jobs", DataTable)
        table.add_columns(*JOB_COLUMNS)
        self.show_state(None)

    def draw(self, changed: set[str] | None) -> None:
        state = self.console.state
        if touches(changed, "gpus", "holders", "hello", "jobs"):
            self.query_one(GpuPanel).show_state(state, self.console.holders_expanded)
        if touches(changed, "jobs", "metrics", "selection", "connection"):
            self._draw_jobs()
        if touches(changed, "metrics", "jobs", "selection"):
            self.query_one(LatestMetrics).show_state(state, self.console.selected_job)
        if touches(changed, "disks"):
            self.query_one(DiskPanel).show_state(state)
        if touches(changed, "actions"):
            self.query_one(ActionLog).show_state(state)

    def _draw_jobs(self) -> None:
        state = self.console.state
        table = self.query_one("#jobs", DataTable)
        now = state.clock()
        table.clear()
        for job in reversed(list(state.jobs.values())):
            latest = state.metrics.get(job.name)
            record = (latest.latest_train or latest.latest) if latest else {}
            end = job.ended_at if job.ended_at else now
            style = STATE_STYLES.get(job.state, "")
            table.add_row(
                job.name,
                job.kind + (" (adopted)" if job.adopted else ""),
                Text(job.state, style=style),
                str(job.pid),
                str(job.pgid),
                duration(end - job.started_at),
                "-" if job.exit_code is None else str(job.exit_code),
                str(record.get("step", "-")),
                number(record.get("loss")),
                state.job_details.get(job.name, "")[:40],
                key=job.name,
            )
        selected = self.console.selected_job
        if selected is not None and selected in state.jobs:
            table.move_cursor(row=table.get_row_index(selected), animate=False)

    def on_data_table_row_highlighted(self, event: DataTable.RowHighlighted) -> None:
        if event.data_table.id != "jobs" or event.row_key is None or not event.row_key.value:
            return
        table = event.data_table
        if event.cursor_row != table.cursor_row or event.row_key not in table.rows or table.get_row_index(event.row_key) != table.cursor_row:
            return  # stale: posted by a rebuild before the cursor was put back on the selected job (row or key moved since)
        self.console.select_job(event.row_key.value)
