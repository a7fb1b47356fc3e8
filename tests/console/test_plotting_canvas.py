"""The plot canvas and layout without a terminal: a real SmolLM2 run's curves (an H200 capture) land on the rows their
values say, on linear and log axes, with NaN markers, faint raw lines, whole-number step ticks and a mouse read-out."""

import json
import math
import re

import pytest

from console.plotting import CurveOptions, SeriesSpec, linear_ticks, prepare_curve, span
from console.state import Series
from console.widgets.canvas import NO_INK, QUADRANTS, Canvas, dot_index
from console.widgets.curve_plot import FRAME_ROWS, Frame, Layer, PlotLayout, lay_out
from tests.fixtures.env import ROOT

FIXTURE = ROOT / "benchmarks" / "results" / "h200_smollm2_e2e_metrics.jsonl"


def smollm2(split: str) -> Series:
    """loss by step of the SmolLM2-135M end-to-end run on an H200 (100 train records, 6 val records)."""
    records = [json.loads(line) for line in FIXTURE.read_text().splitlines()]
    rows = [(float(r["step"]), float(r["loss"])) for r in records if r["split"] == split]
    return Series(steps=[s for s, _ in rows], values=[v for _, v in rows])


def layer(series: Series, label: str = "train", *, options: CurveOptions = CurveOptions(), color: str = "cyan", faint=False, smoothed=False) -> Layer:
    curve = prepare_curve(series.steps, series.values, buckets=1000, log_x=options.log_x, log_y=options.log_y, ema_weight=0 if faint else options.ema_weight)
    return Layer(SeriesSpec(label, series, color), curve, faint=faint, smoothed=smoothed)


def frame(layers, *, options=CurveOptions(), width=64, height=25, markers=(), cursor=None) -> PlotLayout:
    marker_xs = [math.log10(m) for m in markers] if options.log_x else list(markers)
    x_span = span([item.curve for item in layers], "x")
    if marker_xs and x_span:
        x_span = (min(x_span[0], *marker_xs), max(x_span[1], *marker_xs))
    return lay_out(Frame(list(layers), marker_xs, ["loss"], x_span, options, width, height, cursor))


def text_rows(layout: PlotLayout) -> list[str]:
    return ["".join(text for text, _ in line) for line in layout.lines]


def canvas_cell(layout: PlotLayout, column: int, row: int) -> tuple[str, int]:
    """(character, style index) of canvas cell (column, row from the top)."""
    left, top = layout.canvas_origin
    at = 0
    for text, ink in layout.lines[top + row]:
        if at <= left + column < at + len(text):
            return text[left + column - at], ink
        at += len(text)
    raise IndexError((column, row))


def label_rows(layout: PlotLayout) -> dict[str, int]:
    """y label -> canvas row (from the top) it is printed on."""
    _, top = layout.canvas_origin
    rows = text_rows(layout)[top : top + layout.canvas_size[1]]
    return {row.split("┤")[0].strip(): i for i, row in enumerate(rows) if "┤" in row}


def test_every_point_of_a_real_run_lands_on_the_cell_its_value_says():
    series = smollm2("train")
    layout = frame([layer(series)])
    cells, rows = layout.canvas_size
    assert rows == 25 - FRAME_ROWS
    lo, hi = min(series.values), max(series.values)
    legend_columns = max(map(len, layout.legend)) + 5
    checked = 0
    for step, value in zip(series.steps, series.values):  # 100 points: none downsampled away
        column = round((step - 10) / (1000 - 10) * (2 * cells - 1)) // 2
        row = rows - 1 - round((value - lo) / (hi - lo) * (2 * rows - 1)) // 2
        if row < len(layout.legend) and column < legend_columns:
            continue  # under the legend
        char, ink = canvas_cell(layout, column, row)
        assert char in QUADRANTS[1:] and ink == 1, (step, value, column, row, char)
        checked += 1
    assert checked > 90
    assert canvas_cell(layout, 0, len(layout.legend)) != (" ", NO_INK)  # the steep start just below the legend
    bottom = rows - 1 - round((17.72237491607666 - lo) / (hi - lo) * (2 * rows - 1)) // 2
    assert bottom == rows - 1


def test_linear_y_labels_sit_on_the_rows_of_their_values():
    series = smollm2("train")
    layout = frame([layer(series)])
    rows = layout.canvas_size[1]
    lo, hi = min(series.values), max(series.values)
    shown = label_rows(layout)
    assert {"20", "25", "30", "35", "40"} <= set(shown)
    for label, row in shown.items():
        expected = (hi - float(label)) / (hi - lo) * (rows - 1)  # rows from the top, by proportion
        assert abs(row - expected) <= 1, (label, row, expected)


def test_log_y_spaces_labels_by_their_logarithm_and_labels_original_values():
    series = smollm2("train")
    options = CurveOptions(log_y=True)
    layout = frame([layer(series, options=options)], options=options)
    rows = layout.canvas_size[1]
    lo, hi = math.log10(min(series.values)), math.log10(max(series.values))
    shown = label_rows(layout)
    assert {"20", "30", "40"} <= set(shown)
    for label, row in shown.items():
        assert abs(row - (hi - math.log10(float(label))) / (hi - lo) * (rows - 1)) <= 1, (label, row)
    linear = label_rows(frame([layer(series)]))
    assert shown["30"] < linear["30"]  # a log axis squeezes the high values together: 30 sits higher up


def test_log_step_axis_and_points_it_cannot_show():
    val = smollm2("val")  # its first eval is at step 0
    options = CurveOptions(log_x=True, log_y=True)
    item = layer(val, "val", options=options)
    assert item.curve.hidden_points == 1
    layout = frame([item], options=options)
    assert layout.x_ticks is not None and "1k" in layout.x_ticks.labels and "200" in layout.x_ticks.labels
    assert text_rows(layout)[-1].strip() == "step (log)"
    train = layer(smollm2("train"), options=CurveOptions(log_x=True))
    ticks = frame([train], options=CurveOptions(log_x=True)).x_ticks
    assert ticks is not None and {"10", "100", "1k"} <= set(ticks.labels)


def test_nan_markers_are_red_x_on_the_top_row_at_their_steps():
    series = smollm2("train")
    layout = frame([layer(series)], markers=[500.0, 990.0])
    cells, _ = layout.canvas_size
    for step in (500.0, 990.0):
        column = dot_index(step, 10, 1000, 2 * cells) // 2
        assert canvas_cell(layout, column, 0) == ("x", 0), step
    assert layout.styles[0].color is not None and layout.styles[0].color.name == "red"
    assert layout.legend == ["train (100)", "NaN/inf (2)"]
    assert "xx NaN/inf (2)" in text_rows(layout)[layout.canvas_origin[1] + 1]


def test_a_smoothed_curve_keeps_its_raw_line_faint_and_says_ema_in_the_legend():
    series = smollm2("train")
    smooth = CurveOptions(ema_weight=0.9)
    layout = frame([layer(series, faint=True), layer(series, options=smooth, smoothed=True)])
    assert [style.dim for style in layout.styles[1:]] == [True, False]
    assert layout.legend == ["train EMA (100)"]
    inks = {ink for line in layout.lines for _, ink in line}
    assert {1, 2} <= inks  # both drawn


def test_step_ticks_are_whole_numbers_at_every_width():
    for lo, hi in ((1, 7), (0, 3), (10, 1000), (20, 30000), (1, 1_000_001), (3990, 4007)):
        for max_ticks in (2, 4, 8, 20):
            ticks = linear_ticks(lo, hi, max_ticks=max_ticks, integer=True, si=True)
            assert ticks.positions and all(p == int(p) for p in ticks.positions), (lo, hi, max_ticks, ticks)
            assert len(set(ticks.labels)) == len(ticks.labels)
    series = smollm2("train")
    for width in range(20, 120, 7):
        layout = frame([layer(series)], width=width)
        assert layout.x_ticks is not None and all(p == int(p) for p in layout.x_ticks.positions)
        assert text_rows(layout)[-2].split() == layout.x_ticks.labels  # each label drawn whole


def test_linear_value_labels_tell_neighbours_apart():
    assert linear_ticks(2.31, 2.49).labels == ["2.35", "2.4", "2.45"]
    assert linear_ticks(1e-7, 3e-4, max_ticks=4).labels == ["1e-4", "2e-4", "3e-4"]
    assert linear_ticks(0.741, 0.7446, max_ticks=5).labels == ["0.741", "0.742", "0.743", "0.744"]


def test_read_out_names_each_curves_value_at_the_column_under_the_mouse():
    train, val = smollm2("train"), smollm2("val")
    layers = [layer(train), layer(val, "val", color="orange")]
    plain = frame(layers)
    left, top = plain.canvas_origin
    cells, _ = plain.canvas_size
    column = dot_index(400, 0, 1000, 2 * cells) // 2  # x runs from val's step 0 to 1000
    layout = frame(layers, cursor=(left + column, top + 3))
    readout = text_rows(layout)[-1].strip()
    step = int(readout.split(":")[0].removeprefix("step "))
    assert abs(step - 400) <= 1000 / cells
    train_at = min(zip(train.steps, train.values), key=lambda p: abs(p[0] - step))[1]
    assert readout == f"step {step}: train {train_at:.3g} · val {21.12857231949315:.3g}"
    assert text_rows(frame(layers, cursor=(0, 0)))[-1].strip() == "step"  # off the canvas: the axis label


def test_canvas_lines_have_no_gaps_and_runs_merge_one_ink():
    canvas = Canvas(10, 4)
    canvas.polyline([0, 19, 19], [0, 7, 0], 3)
    for column in range(10):
        assert any(canvas.char_at(column, row) != " " for row in range(4)), column
    assert all(canvas.char_at(9, row) != " " for row in range(4))  # the vertical drop
    assert canvas.char_at(0, 3) in "▖▄▌▙▟█▗▞▚"
    runs = canvas.runs(0)
    assert "".join(text for text, _ in runs) == "".join(canvas.char_at(c, 0) for c in range(10))
    assert all(a[1] != b[1] for a, b in zip(runs, runs[1:]))
    canvas.text(2, 0, "ab", 5)
    assert canvas.char_at(2, 0) == "a" and (canvas.runs(0)[1] == ("ab", 5) or ("ab", 5) in canvas.runs(0))
    assert dot_index(0, 0, 1, 8) == 0 and dot_index(1, 0, 1, 8) == 7 and dot_index(5, 0, 1, 8) == 7 and dot_index(-1, 0, 1, 8) == 0


@pytest.mark.parametrize("size", [(4, 1), (10, 5), (12, 6)])
def test_tiny_plots_still_lay_out(size):
    layout = frame([layer(smollm2("train"))], width=size[0], height=size[1])
    assert len(layout.lines) <= size[1]
    assert all(len(row) <= size[0] for row in text_rows(layout))


def test_many_curves_share_a_compact_legend_and_an_overlay_with_the_same_labels_is_one_dim_row():
    acc = [Series(steps=[100.0, 200.0, 300.0], values=[0.8 - 0.05 * k, 0.82 - 0.05 * k, 0.85 - 0.05 * k]) for k in range(7)]
    ours = [layer(series, f"acc@{k}") for k, series in enumerate(acc)]
    assert frame(ours, width=60, height=20).legend == ["acc@ ▞▞0 ▞▞1 ▞▞2 ▞▞3 ▞▞4 ▞▞5 ▞▞6"]
    theirs = [layer(series, f"acc@{k}") for k, series in enumerate(acc)]
    for item in theirs:
        item.spec.prefix = "grok-1 "
    assert frame(theirs + ours, width=60, height=20).legend == ["acc@ ▞▞0 ▞▞1 ▞▞2 ▞▞3 ▞▞4 ▞▞5 ▞▞6", "dim: grok-1"]
    assert frame(ours, width=30, height=20).legend == ["acc@ ▞▞0 ▞▞1 ▞▞2 ▞▞3", "  ▞▞4 ▞▞5 ▞▞6"]  # wrapped at the width
    assert frame(ours, width=30, height=8).legend == []  # 2 rows of a 3-row canvas would hide the curves
    few = [layer(smollm2("train"), "train"), layer(smollm2("val"), "val")]
    assert frame(few).legend == ["train (100)", "val (6)"]  # up to four: one a row, with their counts


def test_the_wall_time_axis_reads_elapsed_time_under_the_mouse():
    train = layer(Series(steps=[0.0, 1800.0, 5400.0], values=[3.0, 2.0, 1.0]))
    options = CurveOptions(wall_time=True)
    layout = frame([train], options=options, width=64, height=20)
    assert layout.x_ticks.labels[0] == "0:00" and layout.x_ticks.labels[-1] == "1:30:00"
    assert text_rows(layout)[-1].strip() == "wall time since the first step"
    left, top = layout.canvas_origin
    last = frame([train], options=options, width=64, height=20, cursor=(left + layout.canvas_size[0] - 1, top + 1))
    assert re.fullmatch(r"at 1:29:\d\d: train 1", text_rows(last)[-1].strip())  # the last column: the end of the run
