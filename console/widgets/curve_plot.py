"""The plot widget of the Training and Grokking screens: prepared curves drawn on our own canvas straight into Strips.

Each frame: the host's buckets plus the live tail -> a Curve per series (console/plotting.py, downsampled to the
plot's width) -> a Canvas of quadrant dots (console/widgets/canvas.py) with axes, ticks, legend and NaN markers ->
one Strip per row, the way Textual paints a widget. No plotext and no ANSI string round trip (the previous widget,
kept for the benchmark's peer, is console/widgets/plotext_plot.py). Plots side by side in one container share
their x range; a smoothed curve keeps its raw line faint behind it; the mouse reads values off the curves. On a
wall-time axis each curve's steps go through its run's StepClock after the zoom range is cut, so zoom stays in steps.
"""

from __future__ import annotations

import math
import time
from bisect import bisect_left
from dataclasses import dataclass

from rich.cells import cell_len
from rich.segment import Segment
from rich.style import Style
from rich.text import Text
from textual import events
from textual.geometry import Region
from textual.strip import Strip
from textual.widget import Widget

from backend.safetext import visible
from console.plotting import (
    Curve,
    CurveOptions,
    SeriesSpec,
    Ticks,
    bucket_points,
    elapsed_label,
    format_number,
    history_points,
    linear_ticks,
    log_ticks,
    prepare_curve,
    span,
    time_ticks,
)
from console.widgets.canvas import NO_INK, Canvas, dot_index, dot_indices

# The frame around the canvas: the y-axis column on the left and the border on the right; above the canvas the title
# and the top border, below it the x axis, its tick labels and the x label (or the cursor's read-out).
FRAME_COLUMNS = 2
FRAME_ROWS = 5
# With the plot's EMA on, a curve with under a tenth of the points of the densest curve in its row of plots (an eval
# every N steps next to a train loss every step) is drawn raw: a few smoothed evals read as values they never had.
SPARSE_SHARE = 10
WALL_TIME_LABELS = ("wall time since the first step", "wall time")  # the x label of a wall-time axis, the first that fits
COLUMN_LEGEND_MAX = 4  # more entries than this go on rows (compact_legend), run by run
# plotext's colour names (what the screens pass) as terminal colours, and xterm-256 indices as they are.
COLOR_NAMES = {"black": 0, "red": 1, "green": 2, "orange": 3, "yellow": 3, "blue": 4, "magenta": 5, "cyan": 6, "gray": 8, "white": 15, "gold": 220}


def tick_column(value: float, lo: float, hi: float, cells: int) -> int:
    """The cell (column, or row from the bottom) of a `cells`-long axis lo..hi that `value` is drawn in."""
    return dot_index(value, lo, hi, 2 * cells) >> 1


def spaced_x_ticks(ticks: Ticks, lo: float, hi: float, cells: int, offset: int = 0, width: int | None = None) -> Ticks:
    """The ticks, left to right, whose labels, centred on their columns, keep clear of each other (and of the plot's
    edges when `width` is given: a label that would cross one is moved inside).

    Two labels a < b are kept when b starts more than len(a) columns after a's tick and a ends more than len(b)
    columns before b's tick, so that no two labels read as one.
    """
    kept: list[tuple[float, str, int, int]] = []  # position, label, tick column, first column of the label
    for position, label in sorted(zip(ticks.positions, ticks.labels)):
        column = offset + tick_column(position, lo, hi, cells)
        start = label_start(column, label, width)
        if kept:
            _, last, last_column, last_start = kept[-1]
            if start <= last_column + len(last) + 1 or last_start + len(last) - 1 >= column - len(label) - 1:
                continue
        kept.append((position, label, column, start))
    return Ticks([k[0] for k in kept], [k[1] for k in kept])


def label_start(column: int, label: str, width: int | None) -> int:
    start = (2 * column + 1 - len(label)) // 2
    return start if width is None else max(0, min(start, width - len(label)))


def spaced_y_ticks(ticks: Ticks, lo: float, hi: float, rows: int) -> Ticks:
    """The ticks, bottom to top, that land on rows of their own (two on one row would hide one label)."""
    kept: list[tuple[float, str]] = []
    used: set[int] = set()
    for position, label in sorted(zip(ticks.positions, ticks.labels)):
        row = tick_column(position, lo, hi, rows)
        if row not in used:
            used.add(row)
            kept.append((position, label))
    return Ticks([k[0] for k in kept], [k[1] for k in kept])


def axis_limits(lo: float, hi: float) -> tuple[float, float]:
    """lo..hi, widened around a single value so that it has an axis to sit on."""
    if hi > lo:
        return lo, hi
    pad = abs(lo) * 0.1 or 1.0
    return lo - pad, hi + pad


def legend_labels(entries: list[tuple[str, str, int]], cells: int) -> list[str]:
    """Legend texts for (prefix, label, points) entries that fit a canvas `cells` wide (3 columns go to the marker,
    2 to the margins): with point counts, then without, then shorter prefixes, then cut."""
    room = cells - 5
    full = [f"{prefix}{label} ({points})" for prefix, label, points in entries]
    if max(map(len, full), default=0) <= room:
        return full
    for keep in (None, 8, 4, 0):
        texts = [(prefix if keep is None or len(prefix) <= keep + 1 else prefix[:keep] + "… " if keep else "") + label for prefix, label, _ in entries]
        if max(map(len, texts), default=0) <= room:
            return texts
    return [text if len(text) <= room else text[: max(1, room - 1)] + "…" for text in texts]


def fitting_title(titles: list[str], label_width: int, cells: int, width: int) -> str:
    """The first title that, centred on the canvas, stays inside the plot; else the last (cut at the edge)."""
    centre = label_width + 1 + cells // 2
    for title in titles:
        start = centre - len(title) // 2
        if start >= 0 and start + len(title) <= width:
            return title
    return titles[-1]


def color_of(color: str | int) -> str:
    """A screen's colour (a plotext name or an xterm-256 index) as a Rich colour."""
    if isinstance(color, int):
        return f"color({color})"
    return f"color({COLOR_NAMES[color]})" if color in COLOR_NAMES else color


@dataclass
class Layer:
    """A curve as drawn: `faint` is the raw line under a smoothed one (no legend entry of its own); `smoothed` says
    the plot's EMA (not the spec's own) smooths it, which its legend entry then says."""

    spec: SeriesSpec
    curve: Curve
    faint: bool = False
    smoothed: bool = False


@dataclass
class PlotLayout:
    """One frame of the plot: its rows as (text, style index) runs, and what was chosen to fit the size."""

    lines: list[list[tuple[str, int]]]
    styles: list[Style]
    title: str
    legend: list[str]
    x_ticks: Ticks | None
    y_ticks: Ticks | None
    x_limits: tuple[float, float] | None = None
    y_limits: tuple[float, float] | None = None
    canvas_origin: tuple[int, int] = (0, 0)  # (column, row) of the canvas's top-left cell in the widget
    canvas_size: tuple[int, int] = (0, 0)


class CurvePlot(Widget):
    """Set `specs` and `options` with `set_data`; resizing replots with the new bucket count.

    `replot` prepares the curves (cached per series version); the layout and its Strips are built at paint time,
    once per change, so that plots side by side can agree on one x range first.
    """

    DEFAULT_CSS = """
    CurvePlot {
        width: 1fr;
        height: 1fr;
        background: $surface;
    }
    """

    def __init__(self, title: str, *shorter: str, raw: bool = False, **kwargs):
        super().__init__(**kwargs)
        self.titles = [title, *shorter]  # the longest first; the layout shows the first that fits
        self.raw = raw  # plot every point (only the benchmark's peer uses this)
        self.specs: list[SeriesSpec] = []
        self.options = CurveOptions()
        self._cache: dict[str, tuple[tuple, Curve]] = {}
        self._heads: dict[str, tuple[tuple, Curve]] = {}  # the bucket part of each curve, per summary
        self._repaint_pending = False
        self._painted: list[Strip] | None = None  # the Strips Textual was last handed
        self._painted_width = 0
        self._bucket_points: dict[tuple, tuple[list[dict], list[float], list[float]]] = {}
        self._row_strips: dict[tuple, Strip] = {}  # the last frame's rows, by their runs
        self._row_strips_key: tuple | None = None
        self._drawn_key: tuple | None = None
        self._layers: list[Layer] = []
        self._hidden = 0
        self.own_x_span: tuple[float, float] | None = None  # the x range of this plot's own curves and markers
        self._layout: PlotLayout | None = None
        self._strips: list[Strip] | None = None
        self.cursor: tuple[int, int] | None = None  # the mouse's cell over the canvas, for the read-out

    @property
    def title(self) -> str:
        return self.titles[0]

    @property
    def shown_title(self) -> str:
        return self.drawn().title

    @property
    def legend(self) -> list[str]:
        return self.drawn().legend

    @property
    def x_ticks(self) -> Ticks | None:
        """Ticks of the x axis as drawn (after thinning to the width)."""
        return self.drawn().x_ticks

    @property
    def y_ticks(self) -> Ticks | None:
        return self.drawn().y_ticks

    def set_data(self, specs: list[SeriesSpec], options: CurveOptions) -> None:
        self.specs = specs
        self.options = options
        self.replot()

    def set_title(self, *titles: str) -> None:
        """One title, or several from the longest to the shortest: the first that fits the plot is shown (job names in
        it shown inert)."""
        shown = [visible(title) for title in titles]
        if shown != self.titles:
            self.titles = shown
            self._invalidate()

    def on_resize(self) -> None:
        self.replot()

    # -- curves -------------------------------------------------------------------------------------

    def buckets(self) -> int:
        return max(8, self.size.width - 8)

    def smoothing(self, spec: SeriesSpec, densest: int) -> float:
        """The EMA weight `spec` is drawn with: its own, else the plot's unless the series is sparse (an eval curve)."""
        if spec.ema_weight is not None:
            return spec.ema_weight
        weight = self.options.ema_weight
        return 0.0 if weight and self._points(spec) * SPARSE_SHARE < densest else weight

    @staticmethod
    def _points(spec: SeriesSpec) -> int:
        return spec.total if spec.total is not None else len(spec.series)

    def curve(self, spec: SeriesSpec, ema_weight: float | None = None) -> Curve:
        """`spec` prepared for this plot's width and axes, smoothed with `ema_weight` (None: the spec's or the plot's)."""
        weight = (self.options.ema_weight if spec.ema_weight is None else spec.ema_weight) if ema_weight is None else ema_weight
        log_x, log_y = self.options.log_x, self.options.log_y
        if self.options.wall_time and not spec.clock:
            return Curve([], [], self._points(spec))  # no times known for this run: nothing to place on the axis
        if self.raw:
            return prepare_curve(self.xs(spec, spec.series.steps), spec.series.values, buckets=10**9, log_x=log_x, log_y=log_y, ema_weight=weight)
        name = f"{spec.prefix}{spec.label}\0{weight}"
        clock = spec.clock.key if self.options.wall_time and spec.clock else None
        head_key = (id(spec.buckets), spec.end_step, spec.step_from, spec.step_to, self.buckets(), log_x, log_y, weight, clock)
        key = (*head_key, id(spec.series), spec.series.version, len(spec.series))
        cached = self._cache.get(name)
        if cached is not None and cached[0] == key:
            return cached[1]
        if spec.buckets is not None and not weight:
            curve = self._head_and_tail(spec, name, head_key)
        else:  # a smoothed curve runs its EMA over the whole history: one pass
            steps, values = history_points(
                spec.buckets,
                spec.series.steps,
                spec.series.values,
                spec.end_step,
                mean=weight > 0,
                step_from=spec.step_from,
                step_to=spec.step_to,
                head=self._bucket_xy(spec.buckets, weight > 0),
            )
            curve = prepare_curve(self.xs(spec, steps), values, buckets=self.buckets(), log_x=log_x, log_y=log_y, ema_weight=weight)
        if spec.total is not None:
            curve.source_points = spec.total
        self._cache[name] = (key, curve)
        return curve

    def xs(self, spec: SeriesSpec, steps: list[float]) -> list[float]:
        """The x of each step: the step, or on a wall-time axis the seconds since the run's first step."""
        return spec.clock.elapsed(steps) if self.options.wall_time and spec.clock else steps

    def _bucket_xy(self, buckets: list[dict] | None, mean: bool) -> tuple[list[float], list[float]] | None:
        """bucket_points of a summary's buckets, kept while that summary is the one drawn."""
        if buckets is None:
            return None
        key = (id(buckets), len(buckets), mean)
        cached = self._bucket_points.get(key)
        if cached is None or cached[0] is not buckets:
            if len(self._bucket_points) > 32:
                self._bucket_points.clear()
            cached = (buckets, *bucket_points(buckets, mean=mean))
            self._bucket_points[key] = cached
        return cached[1], cached[2]

    def _head_and_tail(self, spec: SeriesSpec, name: str, head_key: tuple) -> Curve:
        """The host's buckets prepared once per summary (the head), then only the live points after them (the tail),
        downsampled at the same density: a new live point costs the tail, not the whole history."""
        log_x, log_y, buckets = self.options.log_x, self.options.log_y, self.buckets()
        cached = self._heads.get(name)
        if cached is None or cached[0] != head_key:
            steps, values = history_points(spec.buckets, [], [], spec.end_step, step_from=spec.step_from, step_to=spec.step_to)
            cached = (head_key, prepare_curve(self.xs(spec, steps), values, buckets=buckets, log_x=log_x, log_y=log_y))
            self._heads[name] = cached
        head = cached[1]
        tail_steps, tail_values = history_points([], spec.series.steps, spec.series.values, spec.end_step, step_from=spec.step_from, step_to=spec.step_to)
        tail_steps = self.xs(spec, tail_steps)
        if not tail_steps:
            return Curve(head.xs, head.ys, head.source_points, head.hidden_points)
        lo = head.xs[0] if head.xs else tail_steps[0]
        hi = math.log10(tail_steps[-1]) if log_x and tail_steps[-1] > 0 else tail_steps[-1]
        first = math.log10(tail_steps[0]) if log_x and tail_steps[0] > 0 else tail_steps[0]
        share = (hi - first) / (hi - lo) if hi > lo else 1.0
        tail = prepare_curve(tail_steps, tail_values, buckets=max(1, math.ceil(buckets * share)), log_x=log_x, log_y=log_y)
        return Curve(head.xs + tail.xs, head.ys + tail.ys, head.source_points + tail.source_points, head.hidden_points + tail.hidden_points)

    def replot(self) -> None:
        """Prepare the curves of `specs` (when they, the options or the size changed) and schedule a new layout."""
        key = (
            tuple(
                (
                    s.prefix,
                    s.label,
                    id(s.series),
                    s.series.version,
                    id(s.buckets),
                    s.step_from,
                    s.step_to,
                    len(s.markers),
                    s.ema_weight,
                    s.clock and s.clock.key,
                )
                for s in self.specs
            ),
            self.options,
            self.size.width,
            self.size.height,
        )
        if key == self._drawn_key and not self.raw:
            return
        self._drawn_key = key
        densest = max((self._points(s) for plot in (self, *self.row_plots()) for s in plot.specs), default=0)
        unsmoothed = {id(s.series) for s in self.specs if self.smoothing(s, densest) == 0}
        layers: list[Layer] = []
        for spec in self.specs:
            weight = self.smoothing(spec, densest)
            if weight and id(spec.series) not in unsmoothed:  # its raw line, unless another curve of the plot draws it
                layers.append(Layer(spec, self.curve(spec, 0.0), faint=True))
            layers.append(Layer(spec, self.curve(spec, weight), smoothed=bool(weight) and spec.ema_weight is None))
        self._layers = layers
        self._hidden = sum(layer.curve.hidden_points for layer in layers if not layer.faint)
        before = self.own_x_span
        self.own_x_span = self._x_span()
        self._invalidate()
        if self.own_x_span != before:
            for sibling in self.axis_mates():
                sibling._invalidate()

    def _x_span(self) -> tuple[float, float] | None:
        xs = span([layer.curve for layer in self._layers], "x")
        markers = self._marker_xs()
        if markers and xs:
            return min(xs[0], markers[0]), max(xs[1], markers[-1])
        return xs

    def _marker_xs(self) -> list[float]:
        if self.options.wall_time:
            return sorted({x for spec in self.specs if spec.clock for x in spec.clock.elapsed(spec.markers)})
        steps = sorted({m for spec in self.specs for m in spec.markers})
        return [math.log10(m) for m in steps if m > 0] if self.options.log_x else steps

    def row_plots(self) -> list[CurvePlot]:
        """The other plots in this plot's container (one row of plots of one job)."""
        parent = self.parent
        return [] if parent is None else [w for w in parent.children if isinstance(w, CurvePlot) and w is not self]

    def axis_mates(self) -> list[CurvePlot]:
        """The neighbours on the same kind of step axis: they share one x range."""
        return [w for w in self.row_plots() if (w.options.log_x, w.options.wall_time) == (self.options.log_x, self.options.wall_time)]

    def shared_x_span(self) -> tuple[float, float] | None:
        spans = [s for s in [self.own_x_span, *(w.own_x_span for w in self.axis_mates() if w._layers)] if s is not None]
        if not spans or self.own_x_span is None:
            return self.own_x_span
        return min(s[0] for s in spans), max(s[1] for s in spans)

    # -- layout and paint -----------------------------------------------------------------------------

    def _invalidate(self) -> None:
        """Forget the layout; once the current handler is done (every plot of the row has its data), lay out again
        and repaint the rows that changed."""
        self._layout = None
        self._strips = None
        if not self._repaint_pending:  # several changes in one redraw share one repaint
            self._repaint_pending = True
            if self.is_attached:
                self.call_next(self.repaint_changed_rows)
            else:
                self.refresh()

    def repaint_changed_rows(self) -> None:
        """Build this frame's Strips and refresh only the rows that differ from the ones on screen: with a new live
        point most rows of a long run look the same, and Textual re-renders only the refreshed ones."""
        if not self._repaint_pending:
            return  # painted meanwhile
        self._repaint_pending = False
        if not self.screen.is_current:  # a screen in the background: draw it when it is shown
            self.refresh()
            return
        before, width = self._painted, self.size.width
        strips = self._ensure_strips()
        if before is None or len(before) != len(strips) or self._painted_width != width:
            self.refresh()
            return
        changed = [Region(0, y, width, 1) for y, (old, new) in enumerate(zip(before, strips)) if old is not new]
        if changed:
            self.refresh(*changed)

    def drawn(self) -> PlotLayout:
        if self._layout is None:
            self._layout = self._build_layout()
        return self._layout

    def _ensure_strips(self) -> list[Strip]:
        strips = self._strips
        if strips is None or self._layout is None:
            started = time.perf_counter()
            strips = self._strips = self._build_strips()
            note = getattr(self.app, "note_paint_cost", None)
            if note is not None:
                note(time.perf_counter() - started)
        return strips

    def render_line(self, y: int) -> Strip:
        if self._repaint_pending:  # painted before the repaint ran: draw this frame now, and all of it next time
            self._repaint_pending = False
            self.refresh()
        strips = self._ensure_strips()
        self._painted, self._painted_width = strips, self.size.width
        return strips[y] if 0 <= y < len(strips) else Strip.blank(self.size.width, self.rich_style)

    def render(self) -> Text:
        """The frame as plain text (for tests and tools; painting goes through render_line)."""
        return Text("\n".join("".join(text for text, _ in line) for line in self.drawn().lines))

    def _build_strips(self) -> list[Strip]:
        """One Strip per row; a row drawn the same as in the last frame (frame, axes, quiet canvas rows) is reused."""
        layout = self.drawn()
        base = self.rich_style
        styles = [base + style for style in layout.styles]
        width = self.size.width
        known = self._row_strips if self._row_strips_key == (width, base, tuple(styles)) else {}
        strips: list[Strip] = []
        rows: dict[tuple, Strip] = {}
        for line in layout.lines:
            key = tuple(line)
            strip = known.get(key) or rows.get(key)
            if strip is None:
                segments = [Segment(text, base if ink == NO_INK else styles[ink]) for text, ink in line if text]
                length = sum(cell_len(text) for text, _ in line)
                strip = Strip(segments, length) if length == width else Strip(segments, length).adjust_cell_length(width, base)
            rows[key] = strip
            strips.append(strip)
        self._row_strips, self._row_strips_key = rows, (width, base, tuple(styles))
        return strips

    def _build_layout(self) -> PlotLayout:
        frame = Frame(
            layers=self._layers,
            markers=self._marker_xs(),
            titles=self._titles(),
            x_span=self.shared_x_span(),
            options=self.options,
            width=self.size.width,
            height=self.size.height,
            cursor=self.cursor,
        )
        return lay_out(frame)

    def _titles(self) -> list[str]:
        """The titles to try, longest first; with the count of points a log axis hides when there are any."""
        hidden = self._hidden
        if not hidden:
            return list(self.titles)
        return [f"{title} ({hidden} pts ≤0 hidden on log axis)" for title in self.titles] + [f"{self.titles[-1]} ({hidden} hidden ≤0)", self.titles[-1]]

    # -- the read-out under the mouse -------------------------------------------------------------

    def on_mouse_move(self, event: events.MouseMove) -> None:
        offset = event.get_content_offset(self)
        self._set_cursor(None if offset is None else (offset.x, offset.y))

    def on_leave(self, event: events.Leave) -> None:
        self._set_cursor(None)

    def _set_cursor(self, cursor: tuple[int, int] | None) -> None:
        if cursor != self.cursor:
            self.cursor = cursor
            self._invalidate()


@dataclass
class Frame:
    """What one frame of a plot is drawn from: prepared layers, the NaN/inf marker steps (axis values), the titles to
    try, the x range (shared with the plot's neighbours), the axes, the size and the mouse's cell."""

    layers: list[Layer]
    markers: list[float]
    titles: list[str]
    x_span: tuple[float, float] | None
    options: CurveOptions
    width: int
    height: int
    cursor: tuple[int, int] | None = None


def lay_out(frame: Frame) -> PlotLayout:
    """The plot as rows of runs: title, frame, y labels, the canvas with curves / NaN markers / legend, the x axis with
    its labels, and the x label or the read-out under the mouse."""
    width, height, options = frame.width, frame.height, frame.options
    styles: list[Style] = [Style(color="red", bold=True)]  # 0: NaN/inf markers; then one per layer
    drawn = [layer for layer in frame.layers if layer.curve.xs]
    if not drawn or width < 4 or height < 1:
        title = f"{frame.titles[0] if frame.titles else 'plot'}: no data yet"
        return PlotLayout([[(_centred(title, width // 2, width), NO_INK)]], styles, title, [], None, None)
    rows = max(1, height - FRAME_ROWS)
    y_lo, y_hi = axis_limits(*(span([layer.curve for layer in drawn], "y") or (0.0, 1.0)))
    if options.log_y:
        y_ticks = spaced_y_ticks(log_ticks(y_lo, y_hi, max_ticks=max(3, rows // 3)), y_lo, y_hi, rows)
    else:
        y_ticks = spaced_y_ticks(linear_ticks(y_lo, y_hi, max_ticks=max(2, min(8, rows // 2 + 1))), y_lo, y_hi, rows)
    label_width = max(map(len, y_ticks.labels), default=0)
    cells = max(1, width - FRAME_COLUMNS - label_width)
    x_lo, x_hi = axis_limits(*(frame.x_span or (0.0, 1.0)))
    if options.wall_time:
        x_ticks = time_ticks(x_lo, x_hi, max_ticks=max(2, cells // 10))
    elif options.log_x:
        x_ticks = log_ticks(x_lo, x_hi, si=True, max_ticks=max(3, width // 12))
    else:
        x_ticks = linear_ticks(x_lo, x_hi, max_ticks=max(2, cells // 10), integer=True, si=True)
    x_ticks = spaced_x_ticks(x_ticks, x_lo, x_hi, cells, offset=label_width + 1, width=width)

    canvas = Canvas(cells, rows)
    for layer in drawn:
        styles.append(Style(color=color_of(layer.spec.color), dim=layer.faint))
        canvas.polyline(dot_indices(layer.curve.xs, x_lo, x_hi, 2 * cells), dot_indices(layer.curve.ys, y_lo, y_hi, 2 * rows), len(styles) - 1)
    for x in frame.markers:  # NaN/inf values as red x along the top edge, at their steps (they have no y of their own)
        canvas.text(tick_column(x, x_lo, x_hi, cells), 0, "x", 0)
    legend = draw_legend(canvas, drawn, len(frame.markers), cells, rows)

    title = fitting_title(frame.titles, label_width, cells, width)
    centre = label_width + 1 + cells // 2
    lines: list[list[tuple[str, int]]] = [[(_centred(title, centre, width), NO_INK)]]
    lines.append([(" " * label_width + "┌" + "─" * cells + "┐", NO_INK)])
    labels_by_row = {rows - 1 - tick_column(p, y_lo, y_hi, rows): label for p, label in zip(y_ticks.positions, y_ticks.labels)}
    for row in range(rows):
        label = labels_by_row.get(row)
        left = label.rjust(label_width) + "┤" if label is not None else " " * label_width + "│"
        lines.append(merged([(left, NO_INK), *canvas.runs(row), ("│", NO_INK)]))
    tick_columns = {tick_column(p, x_lo, x_hi, cells) for p in x_ticks.positions}
    lines.append([(" " * label_width + "└" + "".join("┬" if c in tick_columns else "─" for c in range(cells)) + "┘", NO_INK)])
    lines.append([(_placed(x_ticks, x_lo, x_hi, cells, label_width + 1, width), NO_INK)])
    layout = PlotLayout(lines, styles, title, legend, x_ticks, y_ticks, (x_lo, x_hi), (y_lo, y_hi), (label_width + 1, 2), (cells, rows))
    axis_label = next(label for label in WALL_TIME_LABELS if len(label) <= width or label == WALL_TIME_LABELS[-1]) if options.wall_time else ""
    x_label = readout(frame, layout) or axis_label or ("step (log)" if options.log_x else "step")
    lines.append([(_centred(x_label, centre, width), NO_INK)])
    layout.lines = lines[:height]
    return layout


def draw_legend(canvas: Canvas, drawn: list[Layer], markers: int, cells: int, rows: int) -> list[str]:
    """The legend in the canvas's top-left corner (ink i+1 is drawn[i]'s): one entry a row, else, when that column would
    hide much of the curves (many curves: val acc per draft position), each run's entries on a row of their own with the
    labels' common start said once (`acc@ ▞▞0 ▞▞1 ▞▞2`); [] when neither fits in half the canvas."""
    shown = [(layer, index) for index, layer in enumerate(drawn) if not layer.faint]
    entries = [  # metrics keys and job names, shown inert
        (visible(layer.spec.prefix), visible(layer.spec.label) + (" EMA" if layer.smoothed else ""), layer.curve.source_points) for layer, _ in shown
    ]
    inks = [index + 1 for _, index in shown]
    if markers:
        entries.append(("", "NaN/inf", markers))
        inks.append(0)
    legend = legend_labels(entries, cells)
    if not legend:
        return []
    area = len(entries) * (max(map(len, legend)) + 5)
    if len(legend) > min(COLUMN_LEGEND_MAX, max(2, rows // 2)) or area > rows * cells / 4:  # a column would hide the curves
        compact = compact_legend(canvas, entries, inks, cells, rows)
        if compact or len(legend) > rows or area > rows * cells / 2:
            return compact
    room = max(map(len, legend)) + 4
    for row, (text, ink) in enumerate(zip(legend, inks)):
        canvas.text(0, row, " " * (room + 1), NO_INK)
        canvas.text(1, row, "xx" if ink == 0 else "▞▞", ink)
        canvas.text(4, row, text, NO_INK)
    return legend


def common_start(labels: list[str]) -> str:
    """What every label starts with, up to its last non-alphanumeric character ("acc@" of acc@0..acc@11); "" for one label."""
    if len(labels) < 2:
        return ""
    start = labels[0]
    for label in labels[1:]:
        while not label.startswith(start):
            start = start[:-1]
    cut = max((i for i, char in enumerate(start) if not char.isalnum()), default=-1)
    return start[: cut + 1]


def compact_legend(canvas: Canvas, entries: list[tuple[str, str, int]], inks: list[int], cells: int, rows: int) -> list[str]:
    """Each run's (prefix's) entries on one row, or a few when they do not fit: `acc@ ▞▞0 ▞▞1`; a run whose labels are
    another run's (the overlay: the same hues, dim) is one short row, `dim: grok-1`. At most a third of the canvas's
    rows; [] when more are needed."""
    groups: dict[str | None, list[tuple[str, int]]] = {}
    for (run, label, points), ink in zip(entries, inks):
        groups.setdefault(None if ink == 0 else run, []).append((f"{label} ({points})" if ink == 0 else label, ink))
    labels = {run: [label for label, _ in members] for run, members in groups.items()}
    lines: list[list[tuple[str, int]]] = []
    dim: list[list[tuple[str, int]]] = []
    for group, members in groups.items():
        if group and any(other != group and labels[other] == labels[group] for other in labels):
            dim.append([(f"dim: {group.strip()}", NO_INK)])
            continue
        lines += legend_rows(group, members, cells)
    lines += dim
    if len(lines) > max(1, rows // 3) or any(run_length(line) > cells - 1 for line in lines):
        return []
    for row, line in enumerate(lines):
        canvas.text(0, row, " " * (run_length(line) + 1), NO_INK)
        column = 1
        for text, ink in line:
            canvas.text(column, row, text, ink)
            column += len(text)
    return ["".join(text for text, _ in line).rstrip() for line in lines]


def legend_rows(prefix: str | None, members: list[tuple[str, int]], cells: int) -> list[list[tuple[str, int]]]:
    """One run's legend entries as rows of runs, the labels' common start said once, wrapped at the canvas's width."""
    common = common_start([label for label, _ in members]) if prefix is not None else ""
    head = f"{prefix or ''}{common}"
    rows: list[list[tuple[str, int]]] = []
    line: list[tuple[str, int]] = [(head + " ", NO_INK)] if head else []
    filled = False
    for label, ink in members:
        piece = [("xx" if ink == 0 else "▞▞", ink), (label[len(common) :] + " ", NO_INK)]
        if filled and run_length(line + piece) > cells - 1:
            rows.append(line)
            line = [("  ", NO_INK)]
        line += piece
        filled = True
    return rows + [line]


def run_length(line: list[tuple[str, int]]) -> int:
    return sum(len(text) for text, _ in line)


def readout(frame: Frame, layout: PlotLayout) -> str | None:
    """'step 1.2k: train 2.31 · val 2.45' for the canvas column under the mouse: each curve's nearest point."""
    if frame.cursor is None or layout.x_limits is None:
        return None
    (left, top), (cells, rows) = layout.canvas_origin, layout.canvas_size
    column, row = frame.cursor[0] - left, frame.cursor[1] - top
    if not (0 <= column < cells and 0 <= row < rows):
        return None
    x_lo, x_hi = layout.x_limits
    x = x_lo + (x_hi - x_lo) * (2 * column + 0.5) / max(1, 2 * cells - 1)
    log_x, log_y = frame.options.log_x, frame.options.log_y
    values = []
    for layer in frame.layers:
        if layer.faint or not layer.curve.xs:
            continue
        value = nearest(layer.curve, x)
        values.append(f"{visible(layer.spec.prefix)}{visible(layer.spec.label)} {format_number(10**value if log_y else value)}")
    if frame.options.wall_time:
        where = f"at {elapsed_label(x)}"
    else:
        where = f"step {format_number(round(10**x if log_x else x), si=True)}"
    return where + (": " + " · ".join(values) if values else "")


def nearest(curve: Curve, x: float) -> float:
    """The y of the curve's point nearest to x (the later one of a min/max pair at one x)."""
    xs = curve.xs
    i = bisect_left(xs, x)
    if i >= len(xs):
        return curve.ys[-1]
    if i > 0 and x - xs[i - 1] < xs[i] - x:
        i -= 1
    return curve.ys[i]


def merged(runs: list[tuple[str, int]]) -> list[tuple[str, int]]:
    """Neighbouring runs of one ink as one (fewer segments for Textual to walk at paint)."""
    out: list[tuple[str, int]] = []
    for text, ink in runs:
        if out and out[-1][1] == ink:
            out[-1] = (out[-1][0] + text, ink)
        else:
            out.append((text, ink))
    return out


def _centred(text: str, centre: int, width: int) -> str:
    start = max(0, min(centre - len(text) // 2, width - len(text)))
    return (" " * start + text)[:width]


def _placed(ticks: Ticks, lo: float, hi: float, cells: int, offset: int, width: int) -> str:
    row = [" "] * width
    for position, label in zip(ticks.positions, ticks.labels):
        start = label_start(offset + tick_column(position, lo, hi, cells), label, width)
        row[start : start + len(label)] = label
    return "".join(row[:width])
