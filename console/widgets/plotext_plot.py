"""The previous plot widget, kept as the frame benchmark's peer: the same prepared curves drawn by plotext, read back as ANSI.

The console draws with curve_plot.CurvePlot (its own canvas); benchmarks/bench_long_run.py swaps this class in to
measure what a frame cost before. plotext is imported only here.
"""

from __future__ import annotations

import math
import time

from plotext import _utility as plotext_utility
from textual_plotext import PlotextPlot

from backend.safetext import visible
from console.plotting import Curve, CurveOptions, SeriesSpec, Ticks, history_points, log_ticks, prepare_curve, span
from console.widgets.curve_plot import fitting_title, legend_labels

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


class PlotextCurvePlot(PlotextPlot):
    """Set `specs` and `options`, call `replot()`; resizing replots with the new bucket count.

    Half-block ("hd") markers: half the build cost of braille, and 2 dots per cell match the
    min/max pair each downsampling bucket (one per column) yields. Titles, legends and log-axis ticks are fitted to
    the plot's size, since plotext silently drops whatever does not fit.
    """

    def __init__(self, title: str, *shorter: str, raw: bool = False, **kwargs):
        super().__init__(**kwargs)
        self.titles = [title, *shorter]  # the longest first; replot shows the first that fits
        self.raw = raw  # plot every point (only the benchmark's peer uses this)
        self.specs: list[SeriesSpec] = []
        self.options = CurveOptions()
        self._cache: dict[str, tuple[tuple, Curve]] = {}
        self._drawn_key: tuple | None = None
        self.x_ticks: Ticks | None = None  # the log-axis ticks handed to plotext by the last replot (None: plotext's own)
        self.y_ticks: Ticks | None = None
        self.shown_title = title  # what the last replot handed plotext
        self.legend: list[str] = []

    @property
    def title(self) -> str:
        return self.titles[0]

    def set_data(self, specs: list[SeriesSpec], options: CurveOptions) -> None:
        self.specs = specs
        self.options = options
        self.replot()

    def set_title(self, *titles: str) -> None:
        """One title, or several from the longest to the shortest: the first that fits the plot is shown (job names in
        it shown inert: plotext's output is read back as ANSI)."""
        shown = [visible(title) for title in titles]
        if shown != self.titles:
            self.titles = shown
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
        key = (id(spec.series), spec.series.version, len(spec.series), id(spec.buckets), spec.end_step, spec.step_from, spec.step_to, self.buckets(), options)
        cached = self._cache.get(spec.prefix + spec.label)
        if cached is not None and cached[0] == key:
            return cached[1]
        steps, values = history_points(
            spec.buckets, spec.series.steps, spec.series.values, spec.end_step, mean=options.ema_weight > 0, step_from=spec.step_from, step_to=spec.step_to
        )
        curve = prepare_curve(steps, values, buckets=self.buckets(), log_x=options.log_x, log_y=options.log_y, ema_weight=options.ema_weight)
        if spec.total is not None:
            curve.source_points = spec.total
        self._cache[spec.prefix + spec.label] = (key, curve)
        return curve

    def replot(self) -> None:
        key = (
            tuple((s.prefix, s.label, id(s.series), s.series.version, id(s.buckets), s.step_from, s.step_to, len(s.markers)) for s in self.specs),
            self.options,
            self.size.width,
            self.size.height,
        )
        if key == self._drawn_key and not self.raw:
            return
        self._drawn_key = key
        plt = self.plt
        plt.clear_data()
        plt.clear_figure()
        self.x_ticks = self.y_ticks = None
        self.legend = []
        width, height = self.size.width, self.size.height
        curves = [(spec, self.curve(spec)) for spec in self.specs]
        drawn = [(spec, c) for spec, c in curves if c.xs]
        if not drawn:
            self.shown_title = f"{self.title}: no data yet"
            plt.title(self.shown_title)
            self.refresh()
            return
        plotted = [c for _, c in drawn]
        y_span = span(plotted, "y")
        marker_xs = self._marker_xs()
        if self.options.log_y and y_span:
            y_lo, y_hi = plotext_utility.get_lim(list(y_span))
            self.y_ticks = spaced_y_ticks(log_ticks(*y_span, max_ticks=max(3, height // 3)), y_lo, y_hi, max(1, height - FRAME_ROWS))
            plt.yticks(self.y_ticks.positions, self.y_ticks.labels)
        label_width = max(map(len, self.y_ticks.labels), default=0) if self.y_ticks is not None else default_y_label_width(*y_span) if y_span else 0
        cells = max(1, width - FRAME_COLUMNS - label_width)
        entries = [(visible(spec.prefix), visible(spec.label), curve.source_points) for spec, curve in drawn]  # metrics keys, job names
        if marker_xs:
            entries.append(("", "NaN/inf", len(marker_xs)))
        self.legend = legend_labels(entries, cells)
        rows = height - FRAME_ROWS
        if len(entries) * (max(map(len, self.legend)) + 5) > rows * cells / 2:
            self.legend = []  # it would cover more than half the canvas: the curves matter more
        labels: list[str | None] = list(self.legend) or [None] * len(entries)
        for (spec, curve), label in zip(drawn, labels):
            plt.plot(curve.xs, curve.ys, label=label, color=spec.color, marker="hd")
        if marker_xs and y_span:  # NaN/inf values as red x along the top edge, at their steps (they have no y of their own)
            plt.scatter(marker_xs, [y_span[1]] * len(marker_xs), marker="x", color="red", label=labels[-1])
        if self.options.log_x:
            self._set_x_ticks(plotted, marker_xs, label_width, cells)
        hidden = sum(c.hidden_points for _, c in curves)
        suffix = f" ({hidden} pts ≤0 hidden on log axis)" if hidden else ""
        titles = [title + suffix for title in self.titles] + ([f"{self.titles[-1]} ({hidden} hidden ≤0)"] if hidden else [])
        self.shown_title = fitting_title(titles + self.titles[-1:], label_width, cells, width)
        plt.title(self.shown_title)
        plt.xlabel("step (log)" if self.options.log_x else "step")
        self.refresh()

    def _marker_xs(self) -> list[float]:
        steps = sorted({m for spec in self.specs for m in spec.markers})
        return [math.log10(m) for m in steps if m > 0] if self.options.log_x else steps

    def _set_x_ticks(self, curves: list[Curve], marker_xs: list[float], label_width: int, cells: int) -> None:
        """Our log-step ticks, thinned so that no two labels touch at this width (plotext would resolve that in a
        hash-seeded order); a linear axis keeps plotext's own evenly spaced ticks, placed in order."""
        x_span = span(curves, "x")
        if not x_span:
            return
        lo, hi = plotext_utility.get_lim([*x_span, *marker_xs])
        ticks = log_ticks(*x_span, si=True, max_ticks=max(3, self.size.width // 12))
        self.x_ticks = spaced_x_ticks(ticks, lo, hi, cells, offset=label_width + 1)
        self.plt.xticks(self.x_ticks.positions, self.x_ticks.labels)
