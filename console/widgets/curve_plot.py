"""A PlotextPlot that draws prepared curves: downsampled to its width, log axes via log10 values and our ticks."""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from textual_plotext import PlotextPlot

import math

from console.plotting import Curve, history_points, log_ticks, prepare_curve, span
from console.state import Series


@dataclass(frozen=True)
class CurveOptions:
    log_x: bool = False
    log_y: bool = False
    ema_weight: float = 0.0


@dataclass
class SeriesSpec:
    """One curve: the live tail `series`, drawn after the host's `buckets` (whole history or a zoomed range) when given."""

    label: str
    series: Series
    color: str
    buckets: list[dict] | None = None
    end_step: float | None = None  # the last step the buckets cover
    step_from: float | None = None  # a zoomed view's range
    step_to: float | None = None
    markers: list[float] = field(default_factory=list)  # steps of NaN/inf values, drawn as red x at the top
    total: int | None = None  # points in the whole history (label), when known
    ema_weight: float | None = None  # this curve's own smoothing (None: the plot's options)


class CurvePlot(PlotextPlot):
    """Set `specs` and `options`, call `replot()`; resizing replots with the new bucket count.

    Half-block ("hd") markers: half the build cost of braille, and 2 dots per cell match the
    min/max pair each downsampling bucket (one per column) yields.
    """

    def __init__(self, title: str, *, raw: bool = False, **kwargs):
        super().__init__(**kwargs)
        self.title = title
        self.raw = raw  # plot every point (only the benchmark's peer uses this)
        self.specs: list[SeriesSpec] = []
        self.options = CurveOptions()
        self._cache: dict[str, tuple[tuple, Curve]] = {}
        self._drawn_key: tuple | None = None

    def set_data(self, specs: list[SeriesSpec], options: CurveOptions) -> None:
        self.specs = specs
        self.options = options
        self.replot()

    def on_resize(self) -> None:
        self.replot()

    def render(self):
        started = time.perf_counter()
        try:
            return super().render()
        finally:
            note = getattr(self.app, "note_paint_cost", None)
            if note is not None:
                note(time.perf_counter() - started)

    def buckets(self) -> int:
        return max(8, self.size.width - 8)

    def curve(self, spec: SeriesSpec) -> Curve:
        options = self.options
        if spec.ema_weight is not None:
            options = CurveOptions(options.log_x, options.log_y, spec.ema_weight)
        if self.raw:
            return prepare_curve(spec.series.steps, spec.series.values, buckets=10**9, log_x=options.log_x, log_y=options.log_y, ema_weight=options.ema_weight)
        key = (id(spec.series), spec.series.version, len(spec.series), id(spec.buckets), spec.end_step, spec.step_from,
               spec.step_to, self.buckets(), options)
        cached = self._cache.get(spec.label)
        if cached is not None and cached[0] == key:
            return cached[1]
        steps, values = history_points(spec.buckets, spec.series.steps, spec.series.values, spec.end_step,
                                       mean=options.ema_weight > 0, step_from=spec.step_from, step_to=spec.step_to)
        curve = prepare_curve(steps, values, buckets=self.buckets(), log_x=options.log_x, log_y=options.log_y, ema_weight=options.ema_weight)
        if spec.total is not None:
            curve.source_points = spec.total
        self._cache[spec.label] = (key, curve)
        return curve

    def replot(self) -> None:
        key = (tuple((s.label, id(s.series), s.series.version, id(s.buckets), s.step_from, s.step_to, len(s.markers)) for s in self.specs),
               self.options, self.size.width, self.size.height)
        if key == self._drawn_key and not self.raw:
            return
        self._drawn_key = key
        plt = self.plt
        plt.clear_data()
        plt.clear_figure()
        curves = [(spec, self.curve(spec)) for spec in self.specs]
        drawn = [(spec, c) for spec, c in curves if c.xs]
        hidden = sum(c.hidden_points for _, c in curves)
        title = self.title
        if hidden:
            title += f" ({hidden} pts ≤0 hidden on log axis)"
        plt.title(title)
        if not drawn:
            plt.title(f"{self.title}: no data yet")
            self.refresh()
            return
        for spec, curve in drawn:
            plt.plot(curve.xs, curve.ys, label=f"{spec.label} ({curve.source_points})", color=spec.color, marker="hd")
        self._draw_markers([c for _, c in drawn])
        self._set_ticks([c for _, c in drawn])
        plt.xlabel("step (log)" if self.options.log_x else "step")
        self.refresh()

    def _draw_markers(self, curves: list[Curve]) -> None:
        """NaN/inf values as red x along the top edge, at their steps (they have no y of their own)."""
        steps = sorted({m for spec in self.specs for m in spec.markers})
        if self.options.log_x:
            steps = [math.log10(m) for m in steps if m > 0]
        y_span = span(curves, "y")
        if not steps or y_span is None:
            return
        self.plt.scatter(steps, [y_span[1]] * len(steps), marker="x", color="red", label=f"NaN/inf ({len(steps)})")

    def _set_ticks(self, curves: list[Curve]) -> None:
        plt = self.plt
        if self.options.log_x:
            x_span = span(curves, "x")
            if x_span:
                ticks = log_ticks(*x_span, si=True, max_ticks=max(3, self.size.width // 12))
                plt.xticks(ticks.positions, ticks.labels)
        if self.options.log_y:
            y_span = span(curves, "y")
            if y_span:
                ticks = log_ticks(*y_span, max_ticks=max(3, self.size.height // 3))
                plt.yticks(ticks.positions, ticks.labels)
