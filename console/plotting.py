"""Curve preparation for the plots: what a plot is asked to draw (SeriesSpec, CurveOptions), EMA smoothing
(backend/smoothing.py), log10 axes with our own ticks, spike-keeping min/max downsampling, and the wall-time axis
(StepClock: a step's time since the run's first step).

Values on a log axis are transformed here (log10) and the ticks labelled with the original numbers; linear ticks
sit at 1, 2 or 5 times a power of ten (whole numbers on a step axis); wall-time ticks at round durations labelled
as elapsed time (0:00, 30:00, 1:30:00).
"""

from __future__ import annotations

import math
from bisect import bisect_left
from dataclasses import dataclass, field
from typing import Sequence

from backend.smoothing import debiased_ema
from console.state import Series


@dataclass
class Curve:
    """A series ready to plot: x/y already transformed (log10 where asked) and downsampled."""

    xs: list[float]
    ys: list[float]
    source_points: int  # points in the raw series
    hidden_points: int = 0  # points a log axis cannot show (step <= 0, value <= 0)


@dataclass
class Ticks:
    positions: list[float] = field(default_factory=list)
    labels: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class CurveOptions:
    """How a plot draws its curves: log axes, the EMA weight of its smoothing (0: raw), and whether x is the wall
    time since the run's first step (each spec's `clock` maps its steps; log_x is then off)."""

    log_x: bool = False
    log_y: bool = False
    ema_weight: float = 0.0
    wall_time: bool = False


class StepClock:
    """Step -> seconds since the run's first step, interpolated linearly between known (step, wall time) points.

    The points come from the host's `time` buckets (each bucket's first and last) and the live records. Times are
    made non-decreasing in step (a resume from an older checkpoint writes steps again, later), so the axis never
    folds back; a step outside the known points takes the nearest end's time. `key` names the data (cache key).
    """

    def __init__(self, points: Sequence[tuple[float, float]], key: tuple = ()):
        by_step: dict[float, float] = {}
        for step, when in points:
            if math.isfinite(step) and math.isfinite(when):
                by_step[step] = max(when, by_step.get(step, when))
        steps = sorted(by_step)
        times: list[float] = []
        for step in steps:
            times.append(max(by_step[step], times[-1]) if times else by_step[step])
        self.steps = steps
        self.start = times[0] if times else 0.0
        self.seconds = [t - self.start for t in times]
        self.key = key

    def __bool__(self) -> bool:
        return bool(self.steps)

    def elapsed(self, steps: Sequence[float]) -> list[float]:
        """The seconds since the first step at which each of `steps` ran."""
        known, seconds = self.steps, self.seconds
        last = len(known) - 1
        out: list[float] = []
        for step in steps:
            i = bisect_left(known, step)
            if i > last:
                out.append(seconds[last])
            elif known[i] == step or i == 0:
                out.append(seconds[i])
            else:
                lo, hi = known[i - 1], known[i]
                out.append(seconds[i - 1] + (seconds[i] - seconds[i - 1]) * (step - lo) / (hi - lo))
        return out


@dataclass
class SeriesSpec:
    """One curve: the live tail `series`, drawn after the host's `buckets` (whole history or a zoomed range) when given."""

    label: str
    series: Series
    color: str | int  # a plotext colour name or an xterm-256 index
    prefix: str = ""  # whose curve, in the legend ("grok-1 "): shortened first when the legend does not fit
    buckets: list[dict] | None = None
    end_step: float | None = None  # the last step the buckets cover
    step_from: float | None = None  # a zoomed view's range
    step_to: float | None = None
    markers: list[float] = field(default_factory=list)  # steps of NaN/inf values, drawn as red x at the top
    total: int | None = None  # points in the whole history (label), when known
    ema_weight: float | None = None  # this curve's own smoothing (None: the plot's options)
    clock: StepClock | None = None  # its run's step -> wall time, for a wall-time axis (None: no times known)


def minmax_downsample(xs: Sequence[float], ys: Sequence[float], buckets: int) -> tuple[list[float], list[float]]:
    """Keep the min and the max of each of `buckets` equal-width x ranges, in x order.

    xs must be sorted ascending. A one-point spike in a bucket is its min or max, so it survives;
    the first and last points are always kept. Output has at most 2*buckets + 2 points.
    """
    n = len(xs)
    if n != len(ys):
        raise ValueError(f"xs has {n} points, ys has {len(ys)}")
    if buckets < 1:
        raise ValueError(f"buckets must be >= 1, got {buckets}")
    if n <= 2 * buckets + 2:
        return list(xs), list(ys)
    lo, hi = xs[0], xs[-1]
    if hi <= lo:
        return _minmax_by_index(xs, ys, buckets)
    width = (hi - lo) / buckets
    out_x: list[float] = []
    out_y: list[float] = []
    start = 0
    for b in range(1, buckets + 1):
        end = n if b == buckets else bisect_left(xs, lo + b * width, start)
        if end > start:
            _emit_bucket(xs, ys, start, end, out_x, out_y)
        start = end
    _keep_ends(xs, ys, out_x, out_y)
    return out_x, out_y


def _minmax_by_index(xs: Sequence[float], ys: Sequence[float], buckets: int) -> tuple[list[float], list[float]]:
    n = len(xs)
    out_x: list[float] = []
    out_y: list[float] = []
    for b in range(buckets):
        start, end = n * b // buckets, n * (b + 1) // buckets
        if end > start:
            _emit_bucket(xs, ys, start, end, out_x, out_y)
    _keep_ends(xs, ys, out_x, out_y)
    return out_x, out_y


def _emit_bucket(xs, ys, start: int, end: int, out_x: list, out_y: list) -> None:
    segment = ys[start:end]
    low, high = min(segment), max(segment)
    i_low, i_high = start + segment.index(low), start + segment.index(high)
    for i in sorted({i_low, i_high}):
        out_x.append(xs[i])
        out_y.append(ys[i])


def _keep_ends(xs, ys, out_x: list, out_y: list) -> None:
    if out_x and out_x[0] != xs[0]:
        out_x.insert(0, xs[0])
        out_y.insert(0, ys[0])
    if out_x and out_x[-1] != xs[-1]:
        out_x.append(xs[-1])
        out_y.append(ys[-1])


def prepare_curve(
    steps: Sequence[float],
    values: Sequence[float],
    *,
    buckets: int,
    log_x: bool = False,
    log_y: bool = False,
    ema_weight: float = 0.0,
) -> Curve:
    """Raw (step, value) series -> plottable Curve: EMA on the raw values, then log10, then downsample.

    The raw lists are only read (no copy) unless smoothing or a log axis needs new values.
    """
    ys: Sequence[float] = debiased_ema(values, ema_weight) if ema_weight else values
    xs: Sequence[float] = steps
    hidden = 0
    if log_x or log_y:
        keep_x: list[float] = []
        keep_y: list[float] = []
        for x, y in zip(xs, ys):
            if (log_x and x <= 0) or (log_y and y <= 0):
                hidden += 1
                continue
            keep_x.append(math.log10(x) if log_x else x)
            keep_y.append(math.log10(y) if log_y else y)
        xs, ys = keep_x, keep_y
    out_x, out_y = minmax_downsample(xs, ys, buckets) if xs else ([], [])
    return Curve(xs=out_x, ys=out_y, source_points=len(steps), hidden_points=hidden)


def bucket_points(buckets: Sequence[dict], *, mean: bool = False) -> tuple[list[float], list[float]]:
    """The host's buckets as points: (mid, min) and (mid, max) of each, so a one-step spike stays visible;
    (mid, mean) when the curve is smoothed. Buckets with no finite value are left out (they carry markers)."""
    xs: list[float] = []
    ys: list[float] = []
    for bucket in buckets:
        if not bucket.get("count"):
            continue
        mid = (bucket["step_lo"] + bucket["step_hi"]) / 2
        if mean or bucket["count"] == 1 or bucket["min"] == bucket["max"]:
            xs.append(mid)
            ys.append(bucket["mean"] if mean and bucket.get("mean") is not None else bucket["last"])
        else:
            xs += [mid, mid]
            ys += [bucket["min"], bucket["max"]]
    return xs, ys


def history_points(
    buckets: Sequence[dict] | None,
    tail_steps: Sequence[float],
    tail_values: Sequence[float],
    end_step: float | None,
    *,
    mean: bool = False,
    step_from: float | None = None,
    step_to: float | None = None,
    head: tuple[Sequence[float], Sequence[float]] | None = None,
) -> tuple[list[float], list[float]]:
    """Whole-history buckets, then the live tail's raw points after the buckets' last step (or the tail alone).

    `head` is bucket_points(buckets, mean=mean) when the caller has it already."""
    if buckets is None:
        xs, ys = list(tail_steps), list(tail_values)
        end_step = None
    elif head is not None:
        xs, ys = list(head[0]), list(head[1])
    else:
        xs, ys = bucket_points(buckets, mean=mean)
    if end_step is not None:
        start = bisect_left(tail_steps, end_step + 1)
        xs += tail_steps[start:]
        ys += tail_values[start:]
    if step_from is not None or step_to is not None:
        lo = -math.inf if step_from is None else step_from
        hi = math.inf if step_to is None else step_to
        pairs = [(x, y) for x, y in zip(xs, ys) if lo <= x <= hi]
        xs, ys = [x for x, _ in pairs], [y for _, y in pairs]
    return xs, ys


def format_number(value: float, *, si: bool = False) -> str:
    """Short tick label: 1, 20, 3k, 1.5M for steps (si); 0.3, 1e-4 for values."""
    if si and abs(value) >= 1000:
        for scale, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
            if abs(value) >= scale:
                return f"{value / scale:g}{suffix}"
    if value != 0 and (abs(value) < 1e-3 or abs(value) >= 1e5):
        mantissa, exponent = f"{value:.0e}".split("e")
        return f"{mantissa}e{int(exponent)}"
    return f"{value:.3g}"


# Wall-time tick spacings: round seconds, minutes, hours, days.
TIME_TICK_STEPS = (1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200, 10800, 21600, 43200, 86400, 172800, 432000, 864000)


def elapsed_label(seconds: float) -> str:
    """Elapsed time as a clock reads it: 0:00, 1:30 and 59:59 under an hour, 1:30:00 and 27:00:00 from one."""
    total = int(round(seconds))
    sign = "-" if total < 0 else ""
    hours, rest = divmod(abs(total), 3600)
    minutes, secs = divmod(rest, 60)
    return f"{sign}{hours}:{minutes:02d}:{secs:02d}" if hours else f"{sign}{minutes}:{secs:02d}"


def time_ticks(lo: float, hi: float, *, max_ticks: int = 6) -> Ticks:
    """Ticks of a wall-time axis of seconds lo..hi at a round spacing (10 s, 15 min, 6 h...), labelled as elapsed time."""
    if not (math.isfinite(lo) and math.isfinite(hi)):
        return Ticks()
    if hi < lo:
        lo, hi = hi, lo
    if hi == lo:
        return Ticks([lo], [elapsed_label(lo)])
    wanted = (hi - lo) / max(1, max_ticks - 1)
    widest = TIME_TICK_STEPS[-1] * max(1, math.ceil(wanted / TIME_TICK_STEPS[-1]))
    candidates = [s for s in TIME_TICK_STEPS if s < widest] + [widest]
    first = next(i for i, s in enumerate(candidates) if s >= wanted)
    positions: list[float] = []
    for step in reversed(candidates[: first + 1]):  # the widest spacing that still puts two ticks inside
        positions = [float(p) for p in _multiples(lo, hi, step, True)]
        if len(positions) >= 2:
            break
    return Ticks(positions, [elapsed_label(p) for p in positions])


def log_ticks(lo: float, hi: float, *, si: bool = False, max_ticks: int = 8) -> Ticks:
    """Ticks for an axis that holds log10 values lo..hi, labelled with the original numbers."""
    if not (math.isfinite(lo) and math.isfinite(hi)):
        return Ticks()
    if hi < lo:
        lo, hi = hi, lo
    first, last = math.floor(lo), math.ceil(hi)
    inside: list[float] = []
    for mantissas in ((1, 2, 3, 4, 5, 6, 7, 8, 9), (1, 2, 5), (1, 3), (1,)):
        candidates = [math.log10(m) + e for e in range(first, last + 1) for m in mantissas]
        inside = [p for p in candidates if lo - 1e-9 <= p <= hi + 1e-9]
        if len(inside) <= max_ticks:
            break
    if len(inside) < 2:
        inside = sorted({lo, hi})
    stride = max(1, math.ceil(len(inside) / max_ticks))
    positions = inside[::stride]
    return Ticks(positions=positions, labels=[format_number(round(10**p, 12), si=si) for p in positions])


def linear_ticks(lo: float, hi: float, *, max_ticks: int = 6, integer: bool = False, si: bool = False) -> Ticks:
    """Evenly spaced ticks at 1, 2 or 5 times a power of ten inside lo..hi; `integer` (steps) never steps below 1.

    Labels get just enough digits to tell neighbours apart (2.35 / 2.4 / 2.45, not 2.35 / 2.4 / 2.5)."""
    if not (math.isfinite(lo) and math.isfinite(hi)):
        return Ticks()
    if hi < lo:
        lo, hi = hi, lo
    if hi == lo:
        return Ticks([lo], [_labels([lo], si=si)[0]])
    rough = (hi - lo) / max(1, max_ticks - 1)
    magnitude = 10 ** math.floor(math.log10(rough))
    steps = [m * magnitude for m in (10, 5, 2, 1, 0.5, 0.2, 0.1)]
    chosen = [step for step in steps if step >= rough * (1 - 1e-9)][-1]
    positions: list[float] = []
    for step in steps[steps.index(chosen) :]:  # the widest step that still puts two ticks inside
        if integer:
            step = max(1, round(step))
        positions = _multiples(lo, hi, step, integer)
        if len(positions) >= 2 or (integer and step == 1):
            break
    if len(positions) > max_ticks:  # a 1-step floor can give more than asked for: keep every other
        positions = positions[:: math.ceil(len(positions) / max_ticks)]
    return Ticks(positions, _labels(positions, si=si))


def _multiples(lo: float, hi: float, step: float, integer: bool) -> list[float]:
    first = math.ceil(lo / step - 1e-9)
    positions: list[float] = []
    while (first + len(positions)) * step <= hi + abs(step) * 1e-9:
        value = (first + len(positions)) * step
        positions.append(float(round(value)) if integer else float(round(value, 12)))
    return positions


def _labels(values: Sequence[float], *, si: bool) -> list[str]:
    if si and all(v == int(v) for v in values):
        return [format_number(v, si=True) for v in values]
    big = max((abs(v) for v in values), default=0.0)
    exponent = big >= 1e5 or 0 < big < 1e-3
    for digits in range(1, 12):
        labels = [_short(v, digits, exponent) for v in values]
        if len(set(labels)) == len(labels):
            return labels
    return labels


def _short(value: float, digits: int, exponent: bool) -> str:
    if value == 0:
        return "0"
    if exponent:
        mantissa, power = f"{value:.{digits - 1}e}".split("e")
        mantissa = mantissa.rstrip("0").rstrip(".") if "." in mantissa else mantissa
        return f"{mantissa}e{int(power)}"
    decimals = max(0, digits - 1 - math.floor(math.log10(abs(value))))
    text = f"{value:.{decimals}f}"
    return text.rstrip("0").rstrip(".") if "." in text else text


def span(curves: Sequence[Curve], axis: str) -> tuple[float, float] | None:
    """(min, max) of x or y over the plotted points of several curves; None when all are empty."""
    values = [v for c in curves for v in (c.xs if axis == "x" else c.ys)]
    if not values:
        return None
    return min(values), max(values)
