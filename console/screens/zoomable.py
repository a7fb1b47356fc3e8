"""Screens that plot a job's history on a step axis: zoom and pan keys, and asking the host for the zoomed buckets."""

from __future__ import annotations

from textual.binding import Binding, BindingType

from console.screens.base import ConsoleScreen
from console.zoom import StepView, followed, panned, run_span, view_label, zoomed
from console.state import Section

ZOOM_GROUP = Binding.Group("Zoom/pan", compact=True)
ZOOM_BINDINGS: list[BindingType] = [
    Binding("plus,equals_sign", "zoom_in", "Zoom in", group=ZOOM_GROUP),
    Binding("minus", "zoom_out", "Zoom out", group=ZOOM_GROUP),
    Binding("comma", "pan_left", "Earlier", group=ZOOM_GROUP),
    Binding("full_stop", "pan_right", "Later", group=ZOOM_GROUP),
    Binding("0", "whole_run", "Whole run", group=ZOOM_GROUP),
]


class ZoomableScreen(ConsoleScreen):
    """`view` is None for the whole run, else a StepView; changing it asks the app for that range's buckets."""

    LOG_X_DEFAULT = False

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.view: StepView | None = None

    def plot_width(self) -> int:
        return max(40, self.size.width)

    def view_is_log(self) -> bool:
        return self.LOG_X_DEFAULT

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
