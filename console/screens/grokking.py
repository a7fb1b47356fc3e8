"""Grokking: loss (EMA) on a log-step (or wall-time) axis, weight and grad norms, LR; the host's grokking signals and the
data-scaling numbers."""

from __future__ import annotations

from dataclasses import replace
from functools import partial

from rich.text import Text
from textual.app import ComposeResult
from textual.containers import Horizontal, VerticalScroll
from textual.widgets import Footer, Header, Static

from backend.smoothing import TRAIN_EMA_BETA, VAL_EMA_BETA
from console.screens.base import no_job_text, touches
from console.screens.zoomable import WALL_TIME_BINDING, ZOOM_BINDINGS, ZoomableScreen
from console.state import JobMetrics, Section
from console.widgets.banner import ConnectionBanner
from console.plotting import CurveOptions
from console.widgets.curve_plot import CurvePlot
from console.format import clock_time, inert_text
from console.widgets.grok_panels import acceptance_text, alerts_text, data_scaling_text, norms_text, signals_text
from console.zoom import history_spec, history_text, indexing_text

MODULE_COLORS = ("green", "magenta", "orange", "blue", "red", "gold")
NARROW_WIDTH = 140  # below it the four panels go two by two (the acceptance table needs ~35 columns)


class GrokkingScreen(ZoomableScreen):
    MODE = "grokking"
    TITLE = "eagle3-console · Grokking (4)"  # the header names the screen
    LOG_X_DEFAULT = True
    BINDINGS = [WALL_TIME_BINDING, *ZOOM_BINDINGS]

    def compose(self) -> ComposeResult:
        yield Header()
        yield ConnectionBanner(id="banner")
        yield Static(id="grok-title")
        yield Static(id="grok-alerts")
        with Horizontal(id="grok-plots"):
            yield CurvePlot("loss, EMA", id="grok-loss")
            yield CurvePlot("weight norm", id="grok-weight")
            yield CurvePlot("grad norm (pre-clip)", "grad norm", id="grok-grad")
            yield CurvePlot("learning rate", id="grok-lr")
        with Horizontal(id="grok-panels"):
            with VerticalScroll(classes="grok-panel"):
                yield Static("Signals", classes="section-title")
                yield Static(id="grok-signals")
            with VerticalScroll(classes="grok-panel"):
                yield Static("Acceptance per TTT position", classes="section-title")
                yield Static(id="grok-acceptance")
            with VerticalScroll(classes="grok-panel"):
                yield Static("Weights & gradients", classes="section-title")
                yield Static(id="grok-norms")
            with VerticalScroll(classes="grok-panel"):
                yield Static("Data scaling", classes="section-title")
                yield Static(id="grok-data")
        yield Footer()

    def on_mount(self) -> None:
        self.fit_layout()
        self.show_state(None)

    def on_resize(self) -> None:
        self.fit_layout()

    def fit_layout(self) -> None:
        """Four panels side by side when wide; two by two below NARROW_WIDTH, where 25-column panels wrapped every line."""
        narrow = self.size.width < NARROW_WIDTH
        panels = self.query_one("#grok-panels")
        if narrow:
            panels.styles.layout = "grid"
            panels.styles.grid_size_columns, panels.styles.grid_size_rows = 2, 2
        else:
            panels.styles.layout = "horizontal"

    def on_screen_resume(self) -> None:
        super().on_screen_resume()
        self.console.grokking_shown()
        self.console.ensure_summary(self.console.selected_job, log_x=True)

    def draw(self, changed: set[str] | None) -> None:
        console = self.console
        job = console.selected_job
        state = console.state
        metrics = state.metrics.get(job) if job else None
        signals = state.signals.get(job) if job else None
        if touches(changed, Section.SELECTION):
            self.view = None
        if touches(changed, Section.METRICS, Section.SELECTION, Section.JOBS, Section.SIGNALS, Section.DATA_SCALING, Section.METRICS_PROGRESS, Section.OPTIONS):
            self.query_one("#grok-title", Static).update(self._title(job, metrics, signals))
        if touches(changed, Section.METRICS, Section.SELECTION, Section.JOBS, Section.OPTIONS):
            self._draw_plots(metrics)
        if touches(changed, Section.SIGNALS, Section.SELECTION, Section.JOBS):
            self.query_one("#grok-alerts", Static).update(alerts_text(signals))
            self.query_one("#grok-signals", Static).update(signals_text(signals))
            self.query_one("#grok-norms", Static).update(norms_text(signals, watched=state.is_external(job)))
        if touches(changed, Section.SIGNALS, Section.SELECTION, Section.JOBS, Section.METRICS):  # metrics: the latest raw train values
            latest_train = metrics.latest_train if metrics else None
            self.query_one("#grok-acceptance", Static).update(acceptance_text(signals, latest_train))
        if touches(changed, Section.DATA_SCALING, Section.SELECTION, Section.JOBS):
            report = state.data_scaling.get(job) if job else None
            self.query_one("#grok-data", Static).update(data_scaling_text(report, console.profile_of(job) if job else None))

    @inert_text
    def _title(self, job: str | None, metrics: JobMetrics | None, signals: dict | None) -> Text:
        if not job:
            return Text(no_job_text(self.console))
        text = Text()
        text.append(job, style="bold")
        if self.console.state.is_external(job):
            text.append(" (external, read-only)", style="yellow")
        axis = "wall time axis" if self.wall_time else "log step axis"
        text.append(f" · {history_text(metrics)} · {axis} (t) · {self.view_text()} (+ - , . 0) · EMA train {TRAIN_EMA_BETA} / val {VAL_EMA_BETA}")
        if self.wall_time and metrics is not None and not self.clock_of(job, metrics):
            text.append(" · no wall time in this run's records: t shows steps again", style="yellow")
        indexing = indexing_text(metrics)
        if indexing:
            text.append(f" · {indexing}", style="yellow")
        at = self.console.state.signals_at.get(job)
        if signals is not None and at is not None:
            text.append(f" · signals from the host at {clock_time(at)} ({signals.get('n_records', '?')} records)")
        else:
            text.append(" · signals: waiting for the host", style="dim")
        return text

    def _draw_plots(self, metrics: JobMetrics | None) -> None:
        log = self.view_is_log()
        axis = CurveOptions(log_x=log, wall_time=self.wall_time)
        plots = {name: self.query_one(f"#grok-{name}", CurvePlot) for name in ("loss", "weight", "grad", "lr")}
        if metrics is None:
            for plot in plots.values():
                plot.set_data([], axis)
            return
        job = self.console.selected_job
        clock = self.clock_of(job, metrics) if self.wall_time and job else None
        spec = partial(history_spec, metrics=metrics, log_x=log, view=self.view, clock=clock)
        plots["loss"].set_data(
            [
                spec("train raw", key="train.loss", tail=metrics.train_loss, color="gray"),
                spec("train EMA", key="train.loss", tail=metrics.train_loss, color="cyan", ema_weight=TRAIN_EMA_BETA),
                spec("val EMA", key="val.loss", tail=metrics.val_loss, color="orange", ema_weight=VAL_EMA_BETA),
            ],
            axis,
        )
        weights = [spec("total", key="weight_norm", tail=metrics.weight_norm, color="cyan")]
        for index, (module, series) in enumerate(sorted(metrics.weight_norm_modules.items())):
            weights.append(spec(module, key=f"weight_norm.{module}", tail=series, color=MODULE_COLORS[index % len(MODULE_COLORS)]))
        plots["weight"].set_data(weights, axis)
        plots["grad"].set_data([spec("grad", key="grad_norm", tail=metrics.grad_norm, color="red")], axis)
        plots["lr"].set_data([spec("lr", key="lr", tail=metrics.lr, color="green")], replace(axis, log_y=True))
