"""Training: train/val loss and LR curves of the selected job, and validation accuracy per TTT step."""
from __future__ import annotations

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal
from textual.reactive import reactive
from textual.widgets import DataTable, Footer, Header, Static

from console.screens.base import touches
from console.screens.zoomable import ZOOM_BINDINGS, ZoomableScreen
from console.widgets.banner import ConnectionBanner
from console.widgets.curve_plot import CurveOptions, CurvePlot
from console.widgets.format import percent
from console.widgets.history import history_spec, history_text, indexing_text

EMA_WEIGHT = 0.9
ACC_ROWS = 8


class TrainingScreen(ZoomableScreen):
    MODE = "training"

    BINDINGS = [
        Binding("x", "toggle_log_step", "Log step"),
        Binding("y", "toggle_log_y", "Log y"),
        Binding("e", "toggle_ema", "EMA"),
        *ZOOM_BINDINGS,
    ]

    log_step: reactive[bool] = reactive(False, init=False)
    log_y: reactive[bool] = reactive(False, init=False)
    smooth: reactive[bool] = reactive(False, init=False)

    def __init__(self, *, raw_plots: bool = False, **kwargs):
        super().__init__(**kwargs)
        self.raw_plots = raw_plots

    def compose(self) -> ComposeResult:
        yield Header()
        yield ConnectionBanner(id="banner")
        yield Static(id="training-title")
        with Horizontal(id="plots"):
            yield CurvePlot("loss", id="loss-plot", raw=self.raw_plots)
            yield CurvePlot("learning rate", id="lr-plot", raw=self.raw_plots)
        yield Static("Validation accuracy per TTT step (newest first)", classes="section-title")
        yield DataTable(id="acc-table", zebra_stripes=True, cursor_type="none")
        yield Footer()

    def on_mount(self) -> None:
        self.show_state(None)

    def action_toggle_log_step(self) -> None:
        self.log_step = not self.log_step

    def action_toggle_log_y(self) -> None:
        self.log_y = not self.log_y

    def action_toggle_ema(self) -> None:
        self.smooth = not self.smooth

    def watch_log_step(self) -> None:
        if self.log_step:
            self.console.ensure_summary(self.console.selected_job, log_x=True)
        self.set_view(self.view)

    def view_is_log(self) -> bool:
        return self.log_step

    def watch_log_y(self) -> None:
        self.show_state({"options"})

    def watch_smooth(self) -> None:
        self.show_state({"options"})

    def options(self) -> CurveOptions:
        return CurveOptions(log_x=self.log_step, log_y=self.log_y, ema_weight=EMA_WEIGHT if self.smooth else 0.0)

    def draw(self, changed: set[str] | None) -> None:
        if touches(changed, "metrics_progress") and not touches(changed, "metrics", "selection", "options", "jobs"):
            job = self.console.selected_job
            self.query_one("#training-title", Static).update(self._title(job, self.console.state.metrics.get(job) if job else None))
            return
        if not touches(changed, "metrics", "selection", "options", "jobs"):
            return
        if touches(changed, "selection"):
            self.view = None
        job = self.console.selected_job
        metrics = self.console.state.metrics.get(job) if job else None
        self.query_one("#training-title", Static).update(self._title(job, metrics))
        options = self.options()
        if metrics is None:
            self.query_one("#loss-plot", CurvePlot).set_data([], options)
            self.query_one("#lr-plot", CurvePlot).set_data([], options)
        else:
            log_x, view = self.log_step, self.view
            self.query_one("#loss-plot", CurvePlot).set_data([
                history_spec("train", metrics, "train.loss", metrics.train_loss, "cyan", log_x=log_x, view=view),
                history_spec("val", metrics, "val.loss", metrics.val_loss, "orange", log_x=log_x, view=view),
            ], options)
            self.query_one("#lr-plot", CurvePlot).set_data(
                [history_spec("lr", metrics, "lr", metrics.lr, "green", log_x=log_x, view=view)], options)
        self._draw_accuracy(metrics)

    def _title(self, job: str | None, metrics) -> Text:
        if not job:
            return Text("no job selected (press ] or [ to pick one)")
        on = lambda flag: "on" if flag else "off"
        text = Text(f"{job} · {history_text(metrics)} · {self.view_text()} (+ - , . 0) · log step {on(self.log_step)} (x) · "
                    f"log y {on(self.log_y)} (y) · EMA {'0.9' if self.smooth else 'off'} (e)")
        indexing = indexing_text(metrics)
        if indexing:
            text.append(f" · {indexing}", style="yellow")
        nonfinite = metrics.nonfinite_count("train.loss", metrics.train_loss) + metrics.nonfinite_count("val.loss", metrics.val_loss) if metrics else 0
        if nonfinite:
            text.append(f" · {nonfinite} NaN/inf loss values (red x)", style="bold red")
        return text

    def _draw_accuracy(self, metrics) -> None:
        table = self.query_one("#acc-table", DataTable)
        table.clear(columns=True)
        rows = list(reversed(metrics.val_acc[-ACC_ROWS:])) if metrics else []
        width = max((len(acc) for _, acc in rows), default=0)
        table.add_columns("step", *[f"acc@{i}" for i in range(width)])
        for step, acc in rows:
            table.add_row(f"{step:g}", *[percent(a) for a in acc], *[""] * (width - len(acc)))

