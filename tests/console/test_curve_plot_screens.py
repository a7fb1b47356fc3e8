"""The plots through the Training and Grokking screens (Pilot): one x range per row of plots, EMA that keeps the raw
line faint and leaves sparse evals raw, whole-number step ticks, a read-out under the mouse, and painting by Strips."""

import pytest
from textual.geometry import Region

from console.app import build_app
from console.widgets.curve_plot import CurvePlot
from tests.fixtures.console_states import GROK_JOB, grok_state
from tests.fixtures.console_states import frozen_state

pytestmark = pytest.mark.usefixtures("utc")


async def on_screen(pilot, job: str, key: str, *keys: str) -> list[CurvePlot]:
    app = pilot.app
    app.select_job(job)
    await pilot.pause()
    for pressed in (key, *keys):
        await pilot.press(pressed)
        await pilot.pause()
    app.redraw_now()
    await pilot.pause()
    return list(app.screen.query(CurvePlot))


@pytest.mark.parametrize("size", [(100, 30), (170, 45)])
async def test_the_three_training_plots_share_one_step_range(size):
    app = build_app(state=frozen_state(), poll_interval=None, refresh_throttle=0)
    async with app.run_test(size=size) as pilot:
        loss, acc, lr = await on_screen(pilot, "train-kimi", "2")
        assert acc.own_x_span == (400.0, 4000.0) and loss.own_x_span == (10.0, 4000.0)  # evals start at step 400
        assert loss.drawn().x_limits == acc.drawn().x_limits == lr.drawn().x_limits == (10.0, 4000.0)
        await pilot.press("x")  # log step: the shared range follows the axis
        await pilot.pause()
        app.redraw_now()
        await pilot.pause()
        assert loss.drawn().x_limits == acc.drawn().x_limits == lr.drawn().x_limits == pytest.approx((1.0, 3.60206))


async def test_grokking_plots_share_one_step_range():
    app = build_app(state=grok_state(), poll_interval=None, refresh_throttle=0)
    async with app.run_test(size=(170, 45)) as pilot:
        plots = await on_screen(pilot, GROK_JOB, "4")
        assert len(plots) == 4
        limits = {plot.drawn().x_limits for plot in plots}
        assert len(limits) == 1 and None not in limits


async def test_ema_keeps_the_raw_line_faint_and_leaves_sparse_evals_raw():
    state = frozen_state()
    app = build_app(state=state, poll_interval=None, refresh_throttle=0)
    async with app.run_test(size=(170, 45)) as pilot:
        loss, acc, lr = await on_screen(pilot, "train-kimi", "2", "e")
        metrics = state.metrics["train-kimi"]
        faint = [(layer.spec.label, layer.faint, layer.smoothed) for layer in loss._layers]
        assert faint == [("train", True, False), ("train", False, True), ("val", False, False)]
        assert loss.legend == ["train EMA (400)", "val (10)"]
        val = next(layer for layer in loss._layers if layer.spec.label == "val")
        assert val.curve.ys == metrics.val_loss.values  # 10 evals drawn as they are
        assert [layer.spec.label for layer in acc._layers] == [f"acc@{k}" for k in range(7)]  # sparse: no faint lines
        for position, acc_layer in enumerate(acc._layers):
            table_acc = [acc_row[position] for _, acc_row in metrics.val_acc]
            assert acc_layer.curve.ys == pytest.approx(table_acc)  # the plot reads what the table says
            assert max(acc_layer.curve.ys) == pytest.approx(max(table_acc))
        dim = [style.dim for style in loss.drawn().styles[1:]]
        assert dim == [True, False, False]
        assert [layer.faint for layer in lr._layers] == [True, False]  # LR is dense: smoothed, raw behind


@pytest.mark.parametrize("size", [(100, 30), (170, 45)])
@pytest.mark.parametrize("keys", [(), ("x",)], ids=["linear", "log-step"])
async def test_step_ticks_are_whole_numbers(size, keys):
    app = build_app(state=frozen_state(), poll_interval=None, refresh_throttle=0)
    async with app.run_test(size=size) as pilot:
        plots = await on_screen(pilot, "train-kimi", "2", *keys)
        for plot in plots:
            ticks = plot.x_ticks
            assert ticks is not None and len(ticks.labels) >= 2, plot.id
            steps = [10**p if "x" in keys else p for p in ticks.positions]
            assert all(abs(s - round(s)) < 1e-6 for s in steps), (plot.id, ticks)
            rows = plot.render().plain.splitlines()
            assert rows[-2].split() == ticks.labels  # drawn, whole


async def test_the_mouse_reads_values_off_the_curves():
    state = frozen_state()
    app = build_app(state=state, poll_interval=None, refresh_throttle=0)
    async with app.run_test(size=(170, 45)) as pilot:
        loss, _, _ = await on_screen(pilot, "train-kimi", "2")
        layout = loss.drawn()
        (left, top), (cells, rows) = layout.canvas_origin, layout.canvas_size
        column = cells // 2
        await pilot.hover(loss, offset=(left + column, top + rows - 2))
        await pilot.pause()
        readout = loss.render().plain.splitlines()[-1].strip()
        metrics = state.metrics["train-kimi"]
        step_text, values = readout.split(": ")
        step = float(step_text.removeprefix("step ").replace("k", "e3"))
        assert abs(step - 2005) <= 4000 / cells
        train = min(zip(metrics.train_loss.steps, metrics.train_loss.values), key=lambda p: abs(p[0] - step))
        val = min(zip(metrics.val_loss.steps, metrics.val_loss.values), key=lambda p: abs(p[0] - step))
        assert values.startswith("train ") and " · val " in values
        shown_train = float(values.split(" · ")[0].removeprefix("train "))
        assert shown_train == pytest.approx(train[1], rel=0.03) or abs(train[0] - step) < 4000 / cells
        assert float(values.split(" · val ")[1]) == pytest.approx(val[1], rel=0.01)
        await pilot.hover("#acc-table")
        await pilot.pause()
        assert loss.render().plain.splitlines()[-1].strip() == "step"


async def test_a_plot_paints_through_strips_of_its_own_width():
    app = build_app(state=frozen_state(), poll_interval=None, refresh_throttle=0)
    async with app.run_test(size=(170, 45)) as pilot:
        plots = await on_screen(pilot, "train-kimi", "2")
        for plot in plots:
            width, height = plot.size
            strips = plot.render_lines(Region(0, 0, width, height))
            assert len(strips) == height and all(strip.cell_length == width for strip in strips)
            assert [strip.text.rstrip() for strip in strips] == [row.rstrip() for row in plot.render().plain.splitlines()]
            colours = {segment.style.color.name for strip in strips for segment in strip if segment.style and segment.style.color}
            assert len(colours) >= (3 if plot.id == "loss-plot" else 2), (plot.id, colours)  # the axes, train, val


async def test_live_points_after_the_hosts_buckets_redraw_only_the_tail():
    """200k steps summarised by the host (512 buckets with a one-step spike), then live points: the bucket part is
    prepared once per summary, each live point only adds to the tail, and spikes on both sides stay drawn."""
    from textual.app import App

    from backend.metrics.series import Series as IndexSeries, query
    from console.state import Series
    from console.plotting import CurveOptions, SeriesSpec

    class OnePlot(App):
        def compose(self):
            yield CurvePlot("loss", id="plot")

    steps = list(range(1, 200_001))
    values = [3.0 - s / 100_000 for s in steps]
    values[123_456] = 40.0  # one bad batch, inside the host's buckets
    index = IndexSeries()
    index.add(steps, values)
    buckets = query(index, 1, 200_000, 512)
    tail = Series(steps=[float(s) for s in steps[-500:]], values=values[-500:])
    app = OnePlot()
    async with app.run_test(size=(90, 24)):
        plot = app.query_one(CurvePlot)
        spec = SeriesSpec("train", tail, "cyan", buckets=buckets, end_step=200_000.0)
        plot.set_data([spec], CurveOptions())
        first = plot.curve(spec)
        head = plot._heads["train\0" + "0.0"][1]
        assert max(first.ys) == 40.0 and first.xs == sorted(first.xs) and len(first.xs) <= 2 * plot.buckets() + 2
        for step, value in ((200_001.0, 1.0), (200_002.0, 55.0), (200_003.0, 1.0)):  # a live spike
            tail.steps.append(step)
            tail.values.append(value)
            tail.version += 1
            plot.set_data([spec], CurveOptions())
        curve = plot.curve(spec)
        assert plot._heads["train\0" + "0.0"][1] is head  # the history was not prepared again
        assert curve.xs[: len(head.xs)] == head.xs and curve.xs[-3:] == [200_001.0, 200_002.0, 200_003.0]
        assert max(curve.ys) == 55.0 and 40.0 in curve.ys


async def test_after_live_points_the_painted_rows_are_this_frames_rows():
    """Only the rows that changed are refreshed after a redraw: what Textual paints (its line cache included) must
    still be exactly this frame's picture, frame after frame and under the mouse."""
    state = frozen_state()
    app = build_app(state=state, poll_interval=None, refresh_throttle=0)
    async with app.run_test(size=(170, 45)) as pilot:
        plots = await on_screen(pilot, "train-kimi", "2")
        metrics = state.metrics["train-kimi"]
        for step in (4010, 4020, 4030):
            metrics.add({"step": step, "split": "train", "loss": 9.5 if step == 4020 else 1.9, "lr": 1e-6})
            app.screen.show_state({"metrics"})
            await pilot.pause()
            for plot in plots:
                painted = [strip.text.rstrip() for strip in plot.render_lines(Region(0, 0, *plot.size))]
                assert painted == [row.rstrip() for row in plot.render().plain.splitlines()], (plot.id, step)
        loss = plots[0]
        await pilot.hover(loss, offset=(20, 10))
        await pilot.pause()
        painted = [strip.text.rstrip() for strip in loss.render_lines(Region(0, 0, *loss.size))]
        assert painted[-1].strip().startswith("step ") and ": train " in painted[-1]
        assert painted == [row.rstrip() for row in loss.render().plain.splitlines()]
