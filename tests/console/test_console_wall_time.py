"""The wall-time x axis (key t, Training and Grokking): each step drawn at its time since the run's first step, mapped from
the host's `time` buckets and the live records, with elapsed-time ticks (0:00, 1:30:00); zoom still moves in steps."""

import math
import re

import pytest

from console.app import build_app
from console.plotting import StepClock, elapsed_label, time_ticks
from console.screens.grokking import GrokkingScreen
from console.screens.training import TrainingScreen
from console.state import ConsoleState
from console.widgets.curve_plot import CurvePlot
from console.zoom import StepView, step_clock
from tests.fixtures.console_states import GROK_JOB, grok_records, grok_state
from tests.fixtures.console_states import NOW, frozen_state

SIZES = [(100, 30), (170, 45)]
JOB = "train-kimi"
START = NOW - 3 * 3600
SECONDS_PER_STEP = 0.5  # 10 steps a record: 5 s a record
PAUSE_AT, PAUSE_S = 2000, 1800  # the run stood still for 30 minutes after step 2000 (a preemption)
ELAPSED_LABEL = re.compile(r"^\d+:\d\d(:\d\d)?$")

pytestmark = pytest.mark.usefixtures("utc")  # snapshot clocks read in UTC (tests/conftest.py)


def wall_time(step: float) -> float:
    return START + step * SECONDS_PER_STEP + (PAUSE_S if step > PAUSE_AT else 0)


def end_elapsed() -> float:
    return wall_time(4000) - wall_time(10)


def timed_state() -> ConsoleState:
    """frozen_state()'s train-kimi with a wall time on each train record, the first half also in the host's `time` buckets."""
    state = frozen_state()
    records = []
    for i in range(1, 401):
        step = i * 10
        loss = 6.0 * math.exp(-step / 1500) + 1.5 + 0.05 * math.sin(step / 37)
        records.append({"step": step, "split": "train", "loss": loss, "lr": 3e-4 * (1 - step / 4400), "time": wall_time(step)})
        if i % 40 == 0:
            records.append({"step": step, "split": "val", "loss": loss + 0.3, "acc": [0.5 + step / 1e4 - 0.05 * k for k in range(7)]})
    state.apply_metrics_history(JOB, {"records": records, "offset": 999}, reset=True)
    buckets = [  # 100-step buckets of the time series up to step 2000
        {"step_lo": lo, "step_hi": lo + 90, "count": 10, "min": wall_time(lo), "max": wall_time(lo + 90), "first": wall_time(lo), "last": wall_time(lo + 90)}
        for lo in range(10, 2000, 100)
    ]
    state.apply_series(JOB, {"series": {"time": buckets}, "step_range": [10, 2000], "total_records": 410, "log_x": False})
    return state


def timed_grok_state() -> ConsoleState:
    """grok_state()'s grokking run with a wall time on each train record (0.2 s a step)."""
    state = grok_state()
    records = [{**r, "time": START + r["step"] * 0.2} if r["split"] == "train" else r for r in grok_records()]
    state.apply_metrics_history(GROK_JOB, {"records": records, "offset": 99}, reset=True)
    return state


async def shown(pilot, job: str, *keys: str) -> list[CurvePlot]:
    app = pilot.app
    app.select_job(job)
    await pilot.pause()
    for key in keys:
        await pilot.press(key)
        await pilot.pause()
    app.redraw_now()
    await pilot.pause()
    for plot in app.screen.query(CurvePlot):  # replot at the settled size: a plot picks its ticks from its width
        plot._drawn_key = None
        plot.replot()
    await pilot.pause()
    return list(app.screen.query(CurvePlot))


# -- pure parts ----------------------------------------------------------------------------------------------------


def test_elapsed_labels_and_round_time_ticks():
    assert [elapsed_label(s) for s in (0, 59.6, 90, 3599, 5400, 97200)] == ["0:00", "1:00", "1:30", "59:59", "1:30:00", "27:00:00"]
    assert time_ticks(0, 5400).labels == ["0:00", "30:00", "1:00:00", "1:30:00"]
    assert time_ticks(3, 47).labels == ["0:10", "0:20", "0:30", "0:40"]
    assert time_ticks(0, 10 * 86400, max_ticks=4).labels == ["0:00", "120:00:00", "240:00:00"]
    assert time_ticks(0, 3795, max_ticks=2).labels == ["0:00", "1:00:00"]  # two ticks at least: a finer spacing


def test_the_clock_interpolates_never_folds_back_and_holds_its_ends():
    clock = StepClock([(10, 1000.0), (20, 1010.0), (30, 1005.0), (40, 1100.0)])  # step 30 written again, earlier
    assert clock.seconds == [0.0, 10.0, 10.0, 100.0]
    assert clock.elapsed([0, 10, 15, 30, 35, 40, 99]) == [0.0, 0.0, 5.0, 10.0, 55.0, 100.0, 100.0]
    assert not StepClock([]) and StepClock([], key=(1,)).elapsed([]) == []


def test_the_runs_clock_joins_the_hosts_time_buckets_to_the_live_times():
    metrics = timed_state().metrics[JOB]
    clock = step_clock(metrics)
    assert clock.steps[0] == 10 and clock.steps[-1] == 4000
    assert sorted(set(clock.steps) & {1990, 2000, 2010}) == [2000, 2010]  # bucket ends up to 2000, then the live points
    expected = [wall_time(s) - wall_time(10) for s in (10, 500, 1990, 2010, 4000)]
    assert clock.elapsed([10, 500, 1990, 2010, 4000]) == pytest.approx(expected)
    assert clock.elapsed([1000])[0] == pytest.approx(wall_time(1000) - wall_time(10))  # inside a bucket: interpolated


# -- Pilot -----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("size", SIZES, ids=lambda s: f"{s[0]}x{s[1]}")
async def test_t_puts_every_training_plot_on_the_wall_time_axis_and_back(size):
    app = build_app(state=timed_state(), poll_interval=None, refresh_throttle=0)
    async with app.run_test(size=size) as pilot:
        plots = await shown(pilot, JOB, "2", "t")
        screen = app.screen
        assert isinstance(screen, TrainingScreen) and screen.wall_time
        for plot in plots:
            layout = plot.drawn()
            assert plot.options.wall_time and not plot.options.log_x
            assert layout.x_limits == pytest.approx((0.0, end_elapsed()))  # one range for the row: the run's first to last step
            assert layout.x_ticks is not None and len(layout.x_ticks.labels) >= 2
            assert all(ELAPSED_LABEL.match(label) for label in layout.x_ticks.labels), layout.x_ticks.labels
            assert "wall time" in str(plot.render()).splitlines()[-1]
        loss = plots[0]
        train = next(layer.curve for layer in loss._layers if layer.spec.label == "train")
        gap = max(b - a for a, b in zip(train.xs, train.xs[1:]))
        assert gap == pytest.approx(PAUSE_S + 10 * SECONDS_PER_STEP)  # the pause is a gap in time, not in steps
        assert "x wall time (x t)" in str(screen.query_one("#training-title").render())
        await pilot.press("t")
        await pilot.pause()
        app.redraw_now()
        await pilot.pause()
        assert not loss.options.wall_time and loss.drawn().x_limits == (10.0, 4000.0)
        assert "x step (x t)" in str(screen.query_one("#training-title").render())


async def test_zoom_moves_in_steps_on_the_wall_time_axis():
    app = build_app(state=timed_state(), poll_interval=None, refresh_throttle=0)
    async with app.run_test(size=(170, 45)) as pilot:
        loss, _, _ = await shown(pilot, JOB, "2", "t")
        await pilot.press("plus")  # after shown(): its full redraw starts from the whole run
        await pilot.pause()
        view = app.screen.view
        assert isinstance(view, StepView) and view.hi == 4000 and view.lo > 10
        clock = step_clock(app.state.metrics[JOB])
        lo, hi = clock.elapsed([view.lo, view.hi])
        train = next(layer.curve for layer in loss._layers if layer.spec.label == "train")
        assert train.xs and lo <= min(train.xs) and max(train.xs) <= hi
        assert all(ELAPSED_LABEL.match(label) for label in loss.drawn().x_ticks.labels)
        await pilot.press("0")
        await pilot.pause()
        assert app.screen.view is None


async def test_a_run_without_times_says_so_and_draws_no_curve_on_the_time_axis():
    app = build_app(state=frozen_state(), poll_interval=None, refresh_throttle=0)  # frozen_state's records carry no time
    async with app.run_test(size=(170, 45)) as pilot:
        loss, _, _ = await shown(pilot, JOB, "2", "t")
        assert "no wall time in this run's records" in str(app.screen.query_one("#training-title").render())
        assert loss.drawn().x_limits is None and "no data yet" in str(loss.render())


async def test_t_on_grokking_leaves_the_log_step_axis_for_wall_time():
    app = build_app(state=timed_grok_state(), poll_interval=None, refresh_throttle=0)
    async with app.run_test(size=(170, 45)) as pilot:
        plots = await shown(pilot, GROK_JOB, "4")
        assert all(plot.options.log_x and not plot.options.wall_time for plot in plots)
        plots = await shown(pilot, GROK_JOB, "t")
        assert isinstance(app.screen, GrokkingScreen) and not app.screen.view_is_log()
        limits = {plot.drawn().x_limits for plot in plots}
        assert len(limits) == 1 and next(iter(limits)) == pytest.approx((0.0, (30000 - 20) * 0.2))
        assert all(plot.options.wall_time and not plot.options.log_x for plot in plots)
        assert plots[3].options.log_y  # the LR stays on its log y axis
        assert all(ELAPSED_LABEL.match(label) for plot in plots for label in plot.drawn().x_ticks.labels)
        assert "wall time axis (t)" in str(app.screen.query_one("#grok-title").render())


# -- snapshots -------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("size", SIZES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_training_wall_time_snapshot(snap_compare, size):
    async def run_before(pilot):
        await shown(pilot, JOB, "2", "t")

    assert snap_compare(build_app(state=timed_state(), poll_interval=None, refresh_throttle=0), terminal_size=size, run_before=run_before)


@pytest.mark.parametrize("size", SIZES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_grokking_wall_time_snapshot(snap_compare, size):
    async def run_before(pilot):
        await shown(pilot, GROK_JOB, "4", "t")

    assert snap_compare(build_app(state=timed_grok_state(), poll_interval=None, refresh_throttle=0), terminal_size=size, run_before=run_before)
