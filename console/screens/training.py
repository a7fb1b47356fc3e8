"""Training: loss, validation accuracy at every draft position and LR curves of the selected job, on a step or wall-time
axis, optionally over a second job's (the overlay), and validation accuracy per TTT step."""

from __future__ import annotations

from dataclasses import replace

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal
from textual.reactive import reactive
from textual.widgets import DataTable, Footer, Header, Static

from backend.smoothing import TRAIN_EMA_BETA
from console.screens.base import no_job_text, touches
from console.screens.zoomable import WALL_TIME_BINDING, ZOOM_BINDINGS, ZoomableScreen
from console.state import JobMetrics, Section, Series
from console.widgets.banner import ConnectionBanner
from console.plotting import CurveOptions, SeriesSpec, StepClock
from console.widgets.curve_plot import CurvePlot
from console.format import inert_text, percent
from console.zoom import ACC_PREFIX, acc_positions, acc_tail, history_spec, history_text, indexing_text, next_overlay, overlay_candidates

ACC_ROWS = 8
# The overlay's curves: dim shades (xterm-256) of the selected job's cyan / orange / green.
COLORS: dict[str, str | int] = {"train": "cyan", "val": "orange", "lr": "green"}
OVERLAY_COLORS: dict[str, str | int] = {"train": 66, "val": 137, "lr": 65}
# Val accuracy per draft position (val.acc.0, val.acc.1, ...; from the val rows held here where the index lacks one):
# a hue per position, the overlay's a dim shade of the same hue, so acc@k of both runs reads as one colour.
ACC_COLORS: tuple[str | int, ...] = ("orange", 220, 113, 44, 75, 141, 205, 250)
OVERLAY_ACC_COLORS: tuple[str | int, ...] = (137, 136, 65, 30, 67, 97, 132, 243)
TITLES = {"loss": ("loss",), "acc": ("val acc per draft position", "val acc@k"), "lr": ("learning rate",)}


class TrainingScreen(ZoomableScreen):
    MODE = "training"
    TITLE = "eagle3-console · Training (2)"  # the header names the screen

    BINDINGS = [
        Binding("x", "toggle_log_step", "Log step"),
        Binding("y", "toggle_log_y", "Log y"),
        Binding("e", "toggle_ema", "EMA"),
        Binding("o", "next_overlay", "Overlay", tooltip="draw another training job or watched run on the same axes (cycles, then off)"),
        WALL_TIME_BINDING,
        *ZOOM_BINDINGS,
    ]

    log_step: reactive[bool] = reactive(False, init=False)
    log_y: reactive[bool] = reactive(False, init=False)
    smooth: reactive[bool] = reactive(False, init=False)

    def __init__(self, *, raw_plots: bool = False, **kwargs):
        super().__init__(**kwargs)
        self.raw_plots = raw_plots
        self.overlay: str | None = None  # the job whose curves are drawn dim under the selected one's
        self._acc_tails: dict[tuple[str, int], tuple[tuple, Series]] = {}

    def compose(self) -> ComposeResult:
        yield Header()
        yield ConnectionBanner(id="banner")
        yield Static(id="training-title")
        with Horizontal(id="plots"):
            yield CurvePlot("loss", id="loss-plot", raw=self.raw_plots)
            acc = CurvePlot(*TITLES["acc"], id="acc-plot", raw=self.raw_plots)
            acc.styles.width = "2fr"
            yield acc
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

    def action_next_overlay(self) -> None:
        """Overlay the next of the host's other training jobs and watched runs; after the last one, none."""
        candidates = overlay_candidates(self.console.state, self.console.selected_job)
        if not candidates:
            self.overlay = None
            self.console.note("nothing to overlay: no other training job or watched run on this host")
        else:
            self.overlay = next_overlay(candidates, self.overlay)
        if self.overlay:
            self.console.ensure_summary(self.overlay, log_x=self.view_is_log())
        self.show_state({Section.OPTIONS})

    def watch_log_step(self) -> None:
        if self.log_step:
            self.console.ensure_summary(self.console.selected_job, log_x=True)
        self.set_view(self.view)

    def view_is_log(self) -> bool:
        return self.log_step and not self.wall_time

    def watch_log_y(self) -> None:
        self.show_state({Section.OPTIONS})

    def watch_smooth(self) -> None:
        self.show_state({Section.OPTIONS})

    def options(self) -> CurveOptions:
        return CurveOptions(log_x=self.view_is_log(), log_y=self.log_y, ema_weight=TRAIN_EMA_BETA if self.smooth else 0.0, wall_time=self.wall_time)

    def current_overlay(self) -> str | None:
        """The overlay while it is still one of the candidates (not gone, not the selected job itself)."""
        if self.overlay not in overlay_candidates(self.console.state, self.console.selected_job):
            self.overlay = None
        return self.overlay

    def draw(self, changed: set[str] | None) -> None:
        if touches(changed, Section.METRICS_PROGRESS) and not touches(changed, Section.METRICS, Section.SELECTION, Section.OPTIONS, Section.JOBS):
            job = self.console.selected_job
            self.query_one("#training-title", Static).update(self._title(job, self.console.state.metrics.get(job) if job else None))
            return
        if not touches(changed, Section.METRICS, Section.SELECTION, Section.OPTIONS, Section.JOBS):
            return
        if touches(changed, Section.SELECTION):
            self.view = None
        job = self.console.selected_job
        metrics = self.console.state.metrics.get(job) if job else None
        overlay = self.current_overlay()
        other = self.console.state.metrics.get(overlay) if overlay else None
        if overlay:
            self.console.ensure_summary(overlay, log_x=self.view_is_log())  # at most every few seconds (the app's summary refresh)
        self.query_one("#training-title", Static).update(self._title(job, metrics))
        options = self.options()
        plots = {name: self.query_one(f"#{name}-plot", CurvePlot) for name in ("loss", "acc", "lr")}
        for name, plot in plots.items():
            what, *shorter = TITLES[name]
            plot.set_title(
                *(
                    [f"{what}: {job} vs {overlay} (dim)", f"{what} vs {overlay} (dim)", f"{what} + overlay (dim)", *shorter, what]
                    if overlay
                    else [what, *shorter]
                )
            )
        specs: dict[str, list[SeriesSpec]] = {"loss": [], "acc": [], "lr": []}
        layers: list[tuple[str | None, JobMetrics | None, dict[str, str | int], tuple[str | int, ...], str]] = [
            (overlay, other, OVERLAY_COLORS, OVERLAY_ACC_COLORS, f"{overlay} "),
            (job, metrics, COLORS, ACC_COLORS, ""),
        ]
        for owner, source, colors, acc_colors, prefix in layers:  # the overlay first, so the selected job's curves are drawn over it
            if owner is None or source is None:
                continue
            clock = self.clock_of(owner, source) if self.wall_time else None
            specs["loss"] += [
                self._spec(prefix, "train", source, "train.loss", source.train_loss, colors["train"], clock),
                self._spec(prefix, "val", source, "val.loss", source.val_loss, colors["val"], clock),
            ]
            for position in range(acc_positions(source)):
                color = acc_colors[position % len(acc_colors)]
                tail = self._acc_tail(owner, source, position)
                specs["acc"].append(self._spec(prefix, f"acc@{position}", source, f"{ACC_PREFIX}{position}", tail, color, clock))
            specs["lr"].append(self._spec(prefix, "lr", source, "lr", source.lr, colors["lr"], clock))
        for name, plot in plots.items():  # log y is for loss and LR (the key's help): accuracies stay linear
            plot.set_data(specs[name], replace(options, log_y=False) if name == "acc" else options)
        self._draw_accuracy(metrics)

    def _spec(self, prefix: str, label: str, metrics: JobMetrics, key: str, tail: Series, color: str | int, clock: StepClock | None) -> SeriesSpec:
        spec = history_spec(label, metrics, key, tail, color, log_x=self.view_is_log(), view=self.view, clock=clock)
        spec.prefix = prefix
        return spec

    def _acc_tail(self, job: str, metrics: JobMetrics, position: int) -> Series:
        """Val acc at `position` of the val rows held for `job`, rebuilt only when they changed (its version keeps the
        plot's cache)."""
        rows = metrics.val_acc
        key = (id(metrics), len(rows), rows[-1][0] if rows else None)
        cached = self._acc_tails.get((job, position))
        if cached is None or cached[0] != key:
            cached = (key, acc_tail(metrics, position))
            self._acc_tails[(job, position)] = cached
        return cached[1]

    @inert_text
    def _title(self, job: str | None, metrics) -> Text:
        if not job:
            return Text(no_job_text(self.console))
        on = lambda flag: "on" if flag else "off"
        axis = "wall time" if self.wall_time else "log step" if self.log_step else "step"
        text = Text(
            f"{job} · {history_text(metrics)} · {self.view_text()} (+ - , . 0) · x {axis} (x t) · "
            f"log y {on(self.log_y)} (y) · EMA {TRAIN_EMA_BETA if self.smooth else 'off'} (e) · overlay "
        )
        overlay = self.overlay
        if overlay:
            text.append(overlay, style="bold")
            other = self.console.state.metrics.get(overlay)
            text.append(f" dim, {history_text(other)} (o)" if other else " dim, loading (o)")
        else:
            text.append("off (o)")
        if self.wall_time and metrics is not None and not self.clock_of(job, metrics):
            text.append(" · no wall time in this run's records: t shows steps again", style="yellow")
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
