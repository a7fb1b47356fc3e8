"""Curves of a job's whole history: the host's buckets (the whole run, or a zoomed step range) joined to the live tail, with
NaN/inf markers; a run's step -> wall-time clock; val accuracy per draft position; which other job's curves the Training
screen can overlay."""

from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass

from console.state import ConsoleState, JobMetrics, Series, Summary
from console.format import MIB, figure
from console.plotting import SeriesSpec, StepClock

MIN_VIEW_STEPS = 16
TIME_KEY = "time"  # the host index's series of each train step's wall time (epoch seconds)
ACC_PREFIX = "val.acc."  # the host index's series of val accuracy per draft position: val.acc.0, val.acc.1, ...
OVERLAY_KINDS = ("train",)  # besides watched runs (external), the jobs whose curves the Training screen can overlay


@dataclass(frozen=True)
class StepView:
    """A zoomed step range [lo, hi]; `follow` keeps its right edge on the newest step as the run grows."""

    lo: int
    hi: int
    follow: bool = False


def view_summary(metrics: JobMetrics, log_x: bool, view: StepView | None) -> Summary | None:
    """The buckets to draw: the zoom reply when it matches the view, else the whole-history summary."""
    zoom = metrics.zoom
    if view is not None and zoom is not None and zoom.log_x == log_x and (zoom.step_from, zoom.step_to) == (view.lo, view.hi):
        return zoom
    return metrics.summary(log_x)


def history_spec(
    label: str,
    metrics: JobMetrics,
    key: str,
    tail: Series,
    color: str | int,
    *,
    log_x: bool,
    view: StepView | None,
    ema_weight: float | None = None,
    clock: StepClock | None = None,
) -> SeriesSpec:
    summary = view_summary(metrics, log_x, view)
    buckets, end, markers = None, None, []
    if summary is not None and key in summary.buckets:
        buckets, end, markers = summary.buckets[key], summary.end_step, summary.nonfinite_steps(key)
    markers += tail.nonfinite_after(end)
    if view is not None:
        markers = [m for m in markers if view.lo <= m <= view.hi]
    return SeriesSpec(
        label,
        tail,
        color,
        buckets=buckets,
        end_step=end,
        step_from=view.lo if view else None,
        step_to=view.hi if view else None,
        markers=markers,
        total=metrics.history_points(key),
        ema_weight=ema_weight,
        clock=clock,
    )


def step_clock(metrics: JobMetrics, view: StepView | None = None) -> StepClock:
    """The run's step -> wall-time map: the first and last time of each whole-history bucket (and of the zoomed range's
    finer buckets when they are held), then the live records after them. Empty when the run logs no times."""
    whole, zoom = _time_summaries(metrics, view)
    points: list[tuple[float, float]] = []
    for summary in (whole, zoom):
        for bucket in summary.buckets[TIME_KEY] if summary is not None else []:
            if bucket.get("count"):
                points += [(bucket["step_lo"], bucket["first"]), (bucket["step_hi"], bucket["last"])]
    tail = metrics.wall_time
    end = whole.end_step if whole is not None else None
    start = 0 if end is None else bisect_right(tail.steps, end)
    points += zip(tail.steps[start:], tail.values[start:])
    return StepClock(points, clock_key(metrics, view))


def clock_key(metrics: JobMetrics, view: StepView | None) -> tuple:
    """What step_clock reads (a new summary, zoom reply or live time changes it): the clock's cache key."""
    whole, zoom = _time_summaries(metrics, view)
    return (id(metrics), *(id(s.buckets[TIME_KEY]) if s is not None else None for s in (whole, zoom)), metrics.wall_time.version)


def _time_summaries(metrics: JobMetrics, view: StepView | None) -> tuple[Summary | None, Summary | None]:
    """The whole-history summary and the zoom reply of `view`, each only when it holds the time series."""
    whole = metrics.summary(False)
    zoom = metrics.zoom if view is not None and metrics.zoom is not None and (metrics.zoom.step_from, metrics.zoom.step_to) == (view.lo, view.hi) else None
    return _with_time(whole), _with_time(zoom)


def _with_time(summary: Summary | None) -> Summary | None:
    return summary if summary is not None and TIME_KEY in summary.buckets else None


def acc_positions(metrics: JobMetrics) -> int:
    """How many draft positions the run's val accuracy has: the host index's val.acc.N series, or the rows held here."""
    summary = metrics.summary(False)
    indexed = [
        int(key[len(ACC_PREFIX) :]) + 1 for key in (summary.buckets if summary else {}) if key.startswith(ACC_PREFIX) and key[len(ACC_PREFIX) :].isdigit()
    ]
    return max([*indexed, *(len(acc) for _, acc in metrics.val_acc)], default=0)


def run_span(metrics: JobMetrics | None) -> tuple[int, int] | None:
    """First and last step of the run: the host's index, stretched by the live tail."""
    if metrics is None:
        return None
    summary = metrics.summary(False)
    ends: list[float] = list(summary.step_range) if summary is not None and summary.step_range else []
    ends += [s for series in (metrics.train_loss, metrics.val_loss) for s in (series.steps[:1] + series.steps[-1:])]
    return (int(min(ends)), int(max(ends))) if ends else None


def zoomed(view: StepView | None, span: tuple[int, int], factor: float) -> StepView | None:
    """Zoom in (factor < 1) or out (> 1) keeping the right edge; None once it covers the whole run."""
    lo, hi = (view.lo, view.hi) if view else span
    follow = view.follow if view else True
    width = max(MIN_VIEW_STEPS, int((hi - lo) * factor))
    new_lo = max(span[0], hi - width)
    if new_lo <= span[0] and hi >= span[1]:
        return None
    return StepView(new_lo, hi, follow)


def panned(view: StepView | None, span: tuple[int, int], fraction: float) -> StepView | None:
    """Move the view by a fraction of its width, clamped to the run; reaching the end follows the run again."""
    if view is None:
        return None
    width = view.hi - view.lo
    lo = min(max(span[0], view.lo + int(width * fraction)), max(span[0], span[1] - width))
    hi = lo + width
    return StepView(lo, hi, follow=hi >= span[1])


def followed(view: StepView | None, span: tuple[int, int] | None) -> StepView | None:
    """A following view moved so its right edge is the newest step."""
    if view is None or not view.follow or span is None or view.hi >= span[1]:
        return view
    width = view.hi - view.lo
    return StepView(span[1] - width, span[1], True)


def view_label(view: StepView | None) -> str:
    if view is None:
        return "whole run"
    return f"steps {view.lo}–{view.hi}" + (" (following)" if view.follow else "")


def history_text(metrics) -> str:
    """How much of the run is known: the host's record count, or the points held here."""
    if metrics is None:
        return "no metrics yet"
    if metrics.total_records is not None:
        return f"{metrics.total_records:,} records"
    return f"{len(metrics.train_loss)} train / {len(metrics.val_loss)} val points"


def indexing_text(metrics) -> str:
    """'indexing 35% (120/340 MiB)' while the host scans a history it had not seen; empty once caught up."""
    progress = metrics.progress if metrics else {}
    if not progress or progress.get("caught_up", True):
        return ""
    done, total = progress.get("indexed_bytes") or 0, progress.get("file_bytes") or 0
    percent_done = f"{100 * done / total:.0f}%" if total else "?"
    return f"indexing the history {percent_done} ({figure(done, MIB, 0)}/{figure(total, MIB, 0)} MiB), newest records shown meanwhile"


def overlay_candidates(state: ConsoleState, selected: str | None) -> list[str]:
    """The host's other training jobs and watched runs, newest first (the jobs table's order)."""
    return [name for name, info in reversed(list(state.jobs.items())) if name != selected and (info.kind in OVERLAY_KINDS or state.is_external(name))]


def next_overlay(candidates: list[str], current: str | None) -> str | None:
    """The key cycles off -> each candidate -> off; an overlay that is gone (or now selected) starts over."""
    if current not in candidates:
        return candidates[0] if candidates else None
    index = candidates.index(current) + 1
    return candidates[index] if index < len(candidates) else None


def acc_tail(metrics: JobMetrics, position: int = 0) -> Series:
    """The val accuracy at one TTT position as a series, from the val records held here (the accuracy table's rows)."""
    series = Series()
    for step, acc in metrics.val_acc:
        if len(acc) > position:
            series.append(step, acc[position])
    return series
