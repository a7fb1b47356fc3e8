"""A PlotextPlot that draws prepared curves: downsampled to its width, log axes via log10 values and our ticks."""
from __future__ import annotations

import time
from dataclasses import dataclass

from textual_plotext import PlotextPlot

from console.plotting import Curve, log_ticks, prepare_curve, span
from console.state import Series


@dataclass(frozen=True)
class CurveOptions:
    log_x: bool = False
    log_y: bool = False
    ema_weight: float = 0.0


@dataclass
class SeriesSpec:
    label: str
    series: Series
    color: str


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
        if self.raw:
            return prepare_curve(spec.series.steps, spec.series.values, buckets=10**9, log_x=options.log_x, log_y=options.log_y, ema_weight=options.ema_weight)
        key = (id(spec.series), spec.series.version, len(spec.series), self.buckets(), options)
        cached = self._cache.get(spec.label)
        if cached is not None and cached[0] == key:
            return cached[1]
        curve = prepare_curve(spec.series.steps, spec.series.values, buckets=self.buckets(), log_x=options.log_x, log_y=options.log_y, ema_weight=options.ema_weight)
        self._cache[spec.label] = (key, curve)
        return curve

    def replot(self) -> None:
        key = (tuple((s.label, id(s.series), s.series.version) for s in self.specs), self.options, self.size.width, self.size.height)
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
        self._set_ticks([c for _, c in drawn])
        plt.xlabel("step (log)" if self.options.log_x else "step")
        self.refresh()

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
