"""Curve preparation: min/max downsampling keeps spikes, EMA, log10 axes with our own tick labels."""

import math

import pytest
from textual.app import App

from console.plotting import Curve, CurveOptions, SeriesSpec, Ticks, format_number, log_ticks, minmax_downsample, prepare_curve, span
from console.state import Series
from console.widgets.curve_plot import CurvePlot, spaced_x_ticks, spaced_y_ticks


def test_downsample_keeps_a_single_point_spike_and_bounds_the_output():
    xs = list(range(100_000))
    ys = [1.0] * 100_000
    ys[54_321] = 50.0  # one bad batch
    ys[77_777] = -3.0  # and one dip
    out_x, out_y = minmax_downsample(xs, ys, 200)
    assert len(out_x) <= 2 * 200 + 2
    assert max(out_y) == 50.0 and out_x[out_y.index(50.0)] == 54_321
    assert min(out_y) == -3.0 and out_x[out_y.index(-3.0)] == 77_777
    assert out_x[0] == 0 and out_x[-1] == 99_999
    assert out_x == sorted(out_x)


def test_downsample_buckets_are_equal_width_in_x_not_in_count():
    # dense early points and sparse late points (as on a log-step axis): the late spike is its own bucket
    xs = [i / 1000 for i in range(10_000)] + [10.0 + i for i in range(10)]
    ys = [0.0] * len(xs)
    ys[-3] = 9.0
    out_x, out_y = minmax_downsample(xs, ys, 20)
    assert 9.0 in out_y
    assert len(out_x) <= 42


def test_downsample_passes_short_series_through_and_rejects_bad_input():
    assert minmax_downsample([1, 2, 3], [4, 5, 6], 10) == ([1, 2, 3], [4, 5, 6])
    with pytest.raises(ValueError, match="xs has 2 points, ys has 1"):
        minmax_downsample([1, 2], [1], 10)
    with pytest.raises(ValueError, match="buckets"):
        minmax_downsample([1, 2], [1, 2], 0)


def test_downsample_of_identical_x_falls_back_to_index_buckets():
    xs = [5.0] * 1000
    ys = [float(i % 7) for i in range(1000)]
    out_x, out_y = minmax_downsample(xs, ys, 10)
    assert len(out_x) <= 22 and min(out_y) == 0.0 and max(out_y) == 6.0


def test_prepare_curve_takes_log10_and_counts_points_a_log_axis_cannot_show():
    curve = prepare_curve([0, 1, 10, 100], [1.0, 0.1, -1.0, 10.0], buckets=50, log_x=True, log_y=True)
    assert curve.xs == [0.0, 2.0]  # step 0 and value -1 cannot be shown
    assert curve.ys == pytest.approx([-1.0, 1.0])
    assert curve.hidden_points == 2 and curve.source_points == 4


def test_prepare_curve_smooths_before_the_log_and_downsamples_100k_points():
    steps = list(range(1, 100_001))
    values = [1.0 + (i % 10) * 0.01 for i in steps]
    curve = prepare_curve(steps, values, buckets=150, log_x=True, ema_weight=0.9)
    assert len(curve.xs) <= 302
    assert curve.xs[0] == 0.0 and curve.xs[-1] == pytest.approx(5.0)


def test_log_ticks_label_original_values():
    ticks = log_ticks(0.0, 5.0, si=True)  # steps 1 .. 100k
    labels = dict(zip(ticks.labels, ticks.positions))
    assert "1" in labels and "100k" in labels
    assert labels["100k"] == pytest.approx(5.0)
    narrow = log_ticks(math.log10(1.9), math.log10(7.5))  # a loss between 1.9 and 7.5
    assert len(narrow.positions) >= 3
    assert narrow.labels[0] == "2"
    small = log_ticks(-6.0, -3.5)  # a learning rate 1e-6 .. 3e-4
    assert "1e-6" in small.labels
    assert log_ticks(float("nan"), 1.0).positions == []


def test_format_number_and_span():
    assert format_number(20000, si=True) == "20k"
    assert format_number(1.5e6, si=True) == "1.5M"
    assert format_number(0.0003) == "3e-4"
    assert format_number(2.0) == "2"
    assert span([Curve([1, 2], [3, 9], 2), Curve([0], [5], 1)], "y") == (3, 9)
    assert span([Curve([], [], 0)], "x") is None


# -- tick labels at every width: each label handed to plotext is drawn, so none depends on PYTHONHASHSEED ----------


def test_spaced_ticks_drop_labels_that_would_touch():
    ticks = Ticks([2.0, 3.0, 4.0], ["100", "1k", "10k"])  # a 15-column log-step canvas: 1k lands 3 columns after 100
    assert spaced_x_ticks(ticks, 1.3, 4.48, 15).labels == ["100", "10k"]
    assert spaced_x_ticks(ticks, 1.3, 4.48, 40).labels == ["100", "1k", "10k"]
    assert spaced_x_ticks(Ticks([4.0, 2.0], ["10k", "100"]), 1.3, 4.48, 40).labels == ["100", "10k"]  # any order in
    rows = spaced_y_ticks(Ticks([-6.0, -5.7, -5.0, -4.0], ["1e-6", "2e-6", "1e-5", "1e-4"]), -6.0, -3.0, 4)
    assert rows.labels == ["1e-6", "1e-5", "1e-4"]  # 2e-6 would share 1e-6's row


class OnePlot(App):
    def compose(self):
        yield CurvePlot("weight norm", id="plot")


def drawn_rows(plot: CurvePlot) -> list[str]:
    return plot.render().plain.splitlines()


@pytest.mark.parametrize("log_y", [False, True], ids=["linear-y", "log-y"])
async def test_every_tick_label_chosen_is_drawn_at_every_width(log_y):
    """plotext places the labels in a set's order and drops one that touches a label placed before it: when every
    label we hand it is drawn, in order, the order it tried them in made no difference."""
    steps = list(range(20, 30001, 20))
    series = Series(steps=[float(s) for s in steps], values=[12.0 + 95.0 * math.exp(-s / 3000) for s in steps])
    options = CurveOptions(log_x=True, log_y=log_y)
    app = OnePlot()
    async with app.run_test(size=(14, 9)) as pilot:
        plot = app.query_one(CurvePlot)
        plot.set_data([SeriesSpec("total", series, "cyan")], options)
        for width in range(14, 72, 4):
            for height in (9, 30):
                await pilot.resize_terminal(width, height)
                await pilot.pause()
                assert plot.size == (width, height)
                plot._drawn_key = None
                plot.replot()
                rows = drawn_rows(plot)
                axis = next(i for i, row in enumerate(rows) if "└" in row)
                assert plot.x_ticks is not None and len(plot.x_ticks.labels) >= (2 if width >= 20 else 1), (width, height)
                assert rows[axis + 1].split() == plot.x_ticks.labels, (width, height, rows[axis + 1])
                if log_y:
                    shown = [row.split("┤")[0].strip() for row in rows[:axis] if "┤" in row and row.strip()[:1].isdigit()]
                    assert plot.y_ticks is not None and sorted(shown) == sorted(plot.y_ticks.labels), (width, height, shown)
