"""Screens that plot a job's history on a step axis: zoom and pan keys, asking the host for the zoomed buckets, and the
wall-time axis (key t: x is the time since the run's first step, each run's steps mapped by its own StepClock)."""

from __future__ import annotations

from textual.binding import Binding, BindingType
from textual.reactive import reactive

from console.screens.base import ConsoleScreen
from console.plotting import StepClock
from console.zoom import StepView, clock_key, followed, panned, run_span, step_clock, view_label, zoomed
from console.state import JobMetrics, Section

ZOOM_GROUP = Binding.Group("Zoom/pan", compact=True)
ZOOM_BINDINGS: list[BindingType] = [
    Binding("plus,equals_sign", "zoom_in", "Zoom in", group=ZOOM_GROUP),
    Binding("minus", "zoom_out", "Zoom out", group=ZOOM_GROUP),
    Binding("comma", "pan_left", "Earlier", group=ZOOM_GROUP),
    Binding("full_stop", "pan_right", "Later", group=ZOOM_GROUP),
    Binding("0", "whole_run", "Whole run", group=ZOOM_GROUP),
]
WALL_TIME_BINDING = Binding("t", "toggle_wall_time", "Wall time", tooltip="x axis: the wall time since the run's first step, or the step")


class ZoomableScreen(ConsoleScreen):
    """`view` is None for the whole run, else a StepView; changing it asks the app for that range's buckets. With
    `wall_time` on, x is each step's wall time (zoom and pan still move in steps)."""

    LOG_X_DEFAULT = False

    wall_time: reactive[bool] = reactive(False, init=False)

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.view: StepView | None = None
        self._clocks: dict[str, tuple[tuple, StepClock]] = {}

    def plot_width(self) -> int:
        return max(40, self.size.width)

    def view_is_log(self) -> bool:
        return self.LOG_X_DEFAULT and not self.wall_time

    def action_toggle_wall_time(self) -> None:
        self.wall_time = not self.wall_time

    def watch_wall_time(self) -> None:
        self.console.ensure_summary(self.console.selected_job, log_x=self.view_is_log())
        self.set_view(self.view)  # a zoomed range is asked again with the axis's bucket spacing

    def clock_of(self, job: str, metrics: JobMetrics) -> StepClock:
        """`job`'s step -> wall-time map, rebuilt only when its time buckets or live times changed."""
        key = clock_key(metrics, self.view)
        cached = self._clocks.get(job)
        if cached is None or cached[0] != key:
            cached = (key, step_clock(metrics, self.view))
            self._clocks[job] = cached
        return cached[1]

    def _span(self):
        job = self.console.selected_job
        return run_span(self.console.state.metrics.get(job)) if job else None

    def set_view(self, view: StepView | None) -> None:
        self.view = view
        job = self.console.selected_job
        if view is not None and job:
            self.console.request_zoom(job, view.lo, view.hi, self.plot_width(), self.view_is_log())
        self.show_state({Section.OPTIONS})

    def follow_run(self) -> None:
        """New data moved the end of the run: a following view moves with it."""
        moved = followed(self.view, self._span())
        if moved != self.view:
            self.set_view(moved)

    def view_text(self) -> str:
        return view_label(self.view)

    def action_zoom_in(self) -> None:
        span = self._span()
        if span:
            self.set_view(zoomed(self.view, span, 0.5))

    def action_zoom_out(self) -> None:
        span = self._span()
        if span and self.view is not None:
            self.set_view(zoomed(self.view, span, 2.0))

    def action_pan_left(self) -> None:
        span = self._span()
        if span:
            self.set_view(panned(self.view, span, -0.25))

    def action_pan_right(self) -> None:
        span = self._span()
        if span:
            self.set_view(panned(self.view, span, 0.25))

    def action_whole_run(self) -> None:
        self.set_view(None)
