"""A PlotextPlot that draws prepared curves: downsampled to its width, log axes via log10 values and our ticks."""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

from plotext import _utility as plotext_utility
from textual_plotext import PlotextPlot

from console.plotting import Curve, Ticks, history_points, log_ticks, prepare_curve, span
from console.state import Series

# plotext's frame around the canvas: one y-axis column on each side, and above/below the canvas the title, two x-axis
# rows, the tick labels and the x label (plotext _build: width_canvas / height_canvas).
FRAME_COLUMNS = 2
FRAME_ROWS = 5
PLOTEXT_Y_TICKS = 7  # plotext's default y frequency: the linear y labels we leave to it


def tick_column(value: float, lo: float, hi: float, cells: int) -> int:
    """The canvas column (or row) plotext puts `value` of the axis lo..hi in (plotext _utility.get_matrix_data)."""
    if hi == lo:
        return 0
    return math.floor(round(0.5 + (cells - 1) * (value - lo) / (hi - lo), 8))


def spaced_x_ticks(ticks: Ticks, lo: float, hi: float, cells: int, offset: int = 0) -> Ticks:
    """The ticks, left to right, whose labels cannot touch once plotext centres them on their columns.

    plotext de-duplicates ticks through a set (hash-seeded order) and drops a label that lands next to one placed
    before it, shifting the others: labels closer than that made the axis depend on PYTHONHASHSEED. Two labels
    a < b are kept when b starts more than len(a) columns after a's tick and a ends more than len(b) columns before
    b's tick (the span plotext's placement looks at), plus one spare column for the estimate of the canvas width.
    """
    kept: list[tuple[float, str, int, int]] = []  # position, label, tick column, first column of the label
    for position, label in sorted(zip(ticks.positions, ticks.labels)):
        column = offset + tick_column(position, lo, hi, cells)
        start = (2 * column + 1 - len(label)) // 2
        if kept:
            _, last, last_column, last_start = kept[-1]
            if start <= last_column + len(last) + 1 or last_start + len(last) - 1 >= column - len(label) - 1:
                continue
        kept.append((position, label, column, start))
    return Ticks([k[0] for k in kept], [k[1] for k in kept])


def spaced_y_ticks(ticks: Ticks, lo: float, hi: float, rows: int) -> Ticks:
    """The ticks, bottom to top, that land on rows of their own (two on one row overwrite each other in set order)."""
    kept: list[tuple[float, str]] = []
    used: set[int] = set()
    for position, label in sorted(zip(ticks.positions, ticks.labels)):
        row = tick_column(position, lo, hi, rows)
        if row not in used:
            used.add(row)
            kept.append((position, label))
    return Ticks([k[0] for k in kept], [k[1] for k in kept])


def default_y_label_width(lo: float, hi: float) -> int:
    """How wide plotext's own linear y labels for lo..hi are (plotext _build: get_lim, linspace, get_labels)."""
    lo, hi = plotext_utility.get_lim([lo, hi])
    return plotext_utility.max_length(plotext_utility.get_labels(plotext_utility.linspace(lo, hi, PLOTEXT_Y_TICKS)))


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
        self.x_ticks: Ticks | None = None  # the log-axis ticks handed to plotext by the last replot (None: plotext's own)
        self.y_ticks: Ticks | None = None

    def set_data(self, specs: list[SeriesSpec], options: CurveOptions) -> None:
        self.specs = specs
        self.options = options
        self.replot()

    def set_title(self, title: str) -> None:
        if title != self.title:
            self.title = title
            self._drawn_key = None
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
        self.x_ticks = self.y_ticks = None
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
        marker_xs = self._draw_markers([c for _, c in drawn])
        self._set_ticks([c for _, c in drawn], marker_xs)
        plt.xlabel("step (log)" if self.options.log_x else "step")
        self.refresh()

    def _draw_markers(self, curves: list[Curve]) -> list[float]:
        """NaN/inf values as red x along the top edge, at their steps (they have no y of their own); returns their x."""
        steps = sorted({m for spec in self.specs for m in spec.markers})
        if self.options.log_x:
            steps = [math.log10(m) for m in steps if m > 0]
        y_span = span(curves, "y")
        if not steps or y_span is None:
            return []
        self.plt.scatter(steps, [y_span[1]] * len(steps), marker="x", color="red", label=f"NaN/inf ({len(steps)})")
        return steps

    def _set_ticks(self, curves: list[Curve], marker_xs: list[float]) -> None:
        """Our log-axis ticks, thinned so that no two labels touch at this size (which plotext would resolve in a
        hash-seeded order); linear axes keep plotext's own evenly spaced ticks, placed in order."""
        plt = self.plt
        width, height = self.size.width, self.size.height
        y_span = span(curves, "y")
        y_ticks = None
        if self.options.log_y and y_span:
            y_ticks = log_ticks(*y_span, max_ticks=max(3, height // 3))
            y_lo, y_hi = plotext_utility.get_lim(list(y_span))
            y_ticks = spaced_y_ticks(y_ticks, y_lo, y_hi, max(1, height - FRAME_ROWS))
            plt.yticks(y_ticks.positions, y_ticks.labels)
            self.y_ticks = y_ticks
        if self.options.log_x:
            x_span = span(curves, "x")
            if x_span:
                lo, hi = plotext_utility.get_lim([*x_span, *marker_xs])
                label_width = (max((len(label) for label in y_ticks.labels), default=0) if y_ticks is not None
                               else default_y_label_width(*y_span) if y_span else 0)
                cells = max(1, width - FRAME_COLUMNS - label_width)
                ticks = log_ticks(*x_span, si=True, max_ticks=max(3, width // 12))
                ticks = spaced_x_ticks(ticks, lo, hi, cells, offset=label_width + 1)
                plt.xticks(ticks.positions, ticks.labels)
                self.x_ticks = ticks
