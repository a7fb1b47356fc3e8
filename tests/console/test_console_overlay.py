"""Two runs on the Training screen's axes: `o` cycles the host's other training jobs and watched runs (then off); the
overlay's loss / accuracy / LR come from that job's own whole-history summary, drawn dim under the selected job's."""

import math
import sys
from pathlib import Path

import pytest

from backend.protocol import Request
from console.app import build_app
from console.plotting import bucket_points
from console.screens.training import OVERLAY_COLORS, TrainingScreen
from console.state import ConsoleState
from console.widgets.curve_plot import CurvePlot
from console.zoom import next_overlay, overlay_candidates
from tests.fixtures.ssh import connected, pid_alive, stop_everything, wait_until
from tests.fixtures.console_states import NOW, frozen_state

BASE, CONTINUATION, EXTERNAL = "train-kimi", "grok-kimi", "ext:specforge"
SIZES = [(100, 30), (170, 45)]

pytestmark = pytest.mark.usefixtures("utc")  # snapshot clocks read in UTC (tests/conftest.py)


def job(name: str, kind: str = "train", started: float = NOW - 600) -> dict:
    return {
        "name": name,
        "kind": kind,
        "state": "running",
        "pid": 2000 + len(name),
        "pgid": 2000 + len(name),
        "start_time_ticks": 1,
        "argv": ["eagle3-host", kind],
        "job_dir": f"/root/.eagle3/jobs/{name}",
        "stdout_path": "o",
        "stderr_path": "e",
        "started_at": started,
    }


def continuation_records() -> list[dict]:
    """A grokking continuation of train-kimi: resumed at step 4000 with a constant LR, loss still falling, val acc rising."""
    records = []
    for step in range(4010, 6001, 10):
        loss = 1.62 + 0.3 * math.exp(-(step - 4000) / 600)
        records.append({"step": step, "split": "train", "loss": loss, "lr": 1e-4, "grad_norm": 0.4, "tokens": step * 4096})
        if step % 400 == 0:
            records.append({"step": step, "split": "val", "loss": loss + 0.25, "acc": [0.741 + 0.04 * (step - 4000) / 2000 - 0.05 * k for k in range(7)]})
    return records


def overlay_state() -> ConsoleState:
    """frozen_state() (train-kimi, bench-old) plus train-kimi's grokking continuation, loaded once, and a watched run."""
    state = frozen_state()
    jobs = [{**job(j.name, j.kind, j.started_at), "pid": j.pid, "state": j.state} for j in state.jobs.values()]
    state.apply({"type": "jobs", "jobs": [*jobs, job(CONTINUATION, started=NOW - 300)]})
    state.apply_metrics_history(CONTINUATION, {"records": continuation_records(), "offset": 777}, reset=True)
    state.add_external(EXTERNAL, "/data/specforge/train.log")
    return state


def frozen_app(state: ConsoleState | None = None):
    return build_app(state=state or overlay_state(), poll_interval=None, refresh_throttle=0)


async def on_training(pilot, *keys: str) -> None:
    app = pilot.app
    app.select_job(BASE)
    await pilot.pause()
    await pilot.press("2")
    for key in keys:
        await pilot.press(key)
        await pilot.pause()
    app.redraw_now()
    await pilot.pause()
    for plot in app.screen.query(CurvePlot):  # replot at the settled size: a plot picks its ticks and title from its width
        plot._drawn_key = None
        plot.replot()
    await pilot.pause()


def specs_of(app, plot: str) -> dict[str, object]:
    return {spec.prefix + spec.label: spec for spec in app.screen.query_one(f"#{plot}-plot", CurvePlot).specs}


# -- which jobs, in which order -------------------------------------------------------------------------------------


def test_candidates_are_the_other_training_jobs_and_watched_runs_newest_first_and_the_key_cycles_back_to_off():
    state = overlay_state()
    candidates = overlay_candidates(state, BASE)
    assert candidates == [EXTERNAL, CONTINUATION]  # bench-old (a bench job) and the selected job are not candidates
    assert overlay_candidates(state, CONTINUATION) == [EXTERNAL, BASE]
    sequence, current = [], None
    for _ in range(4):
        current = next_overlay(candidates, current)
        sequence.append(current)
    assert sequence == [EXTERNAL, CONTINUATION, None, EXTERNAL]
    assert next_overlay(candidates, "gone-job") == EXTERNAL and next_overlay([], None) is None


# -- frozen data ----------------------------------------------------------------------------------------------------


async def test_the_overlay_draws_the_second_jobs_own_points_dim_and_names_both_runs():
    app = frozen_app()
    async with app.run_test(size=(170, 45)) as pilot:
        await on_training(pilot, "o", "o")  # off -> the watched run -> the continuation
        screen = app.screen
        assert isinstance(screen, TrainingScreen) and screen.overlay == CONTINUATION
        theirs, ours = app.state.metrics[CONTINUATION], app.state.metrics[BASE]
        loss, acc, lr = specs_of(app, "loss"), specs_of(app, "acc"), specs_of(app, "lr")
        assert list(loss) == ["grok-kimi train", "grok-kimi val", "train", "val"]  # the overlay first: ours is drawn over it
        assert loss["grok-kimi train"].series is theirs.train_loss and loss["train"].series is ours.train_loss
        assert loss["grok-kimi val"].series is theirs.val_loss and lr["grok-kimi lr"].series is theirs.lr
        assert loss["grok-kimi train"].color == OVERLAY_COLORS["train"] and loss["train"].color == "cyan"
        plot = app.screen.query_one("#loss-plot", CurvePlot)
        drawn = plot.curve(loss["grok-kimi train"])
        records = {r["step"]: r["loss"] for r in continuation_records() if r["split"] == "train"}
        assert drawn.xs and set(drawn.xs) <= set(records) and all(records[x] == y for x, y in zip(drawn.xs, drawn.ys))
        assert min(drawn.xs) >= 4010 and max(plot.curve(loss["train"]).xs) <= 4000  # the continuation starts where we end
        acc_points = app.screen.query_one("#acc-plot", CurvePlot).curve(acc["grok-kimi acc@0"])
        assert list(zip(acc_points.xs, acc_points.ys)) == [(step, row[0]) for step, row in theirs.val_acc]
        assert plot.shown_title == "loss: train-kimi vs grok-kimi (dim)"
        assert plot.legend == ["grok-kimi train (200)", "grok-kimi val (5)", "train (400)", "val (10)"]
        title = str(screen.query_one("#training-title").render())
        assert "overlay grok-kimi dim" in title and "(o)" in title
        await pilot.press("o")  # after the last candidate: off
        await pilot.pause()
        assert screen.overlay is None and list(specs_of(app, "loss")) == ["train", "val"] and plot.shown_title == "loss"
        assert "overlay off (o)" in str(screen.query_one("#training-title").render())


async def test_with_nothing_to_overlay_the_key_says_so():
    state = frozen_state()  # train-kimi and a bench job only
    app = frozen_app(state)
    async with app.run_test(size=(170, 45)) as pilot:
        await on_training(pilot, "o")
        assert app.screen.overlay is None
        assert app.state.actions[-1][1] == "nothing to overlay: no other training job or watched run on this host"


@pytest.mark.parametrize("size", SIZES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_overlay_snapshot(snap_compare, size):
    async def run_before(pilot):
        await on_training(pilot, "o", "o")

    assert snap_compare(frozen_app(), terminal_size=size, run_before=run_before)


# -- a real agent: the overlay's curves come from the second job's own summary --------------------------------------


WRITER = (
    "import json, os, time\n"
    "path = os.path.join(os.environ['EAGLE3_JOB_DIR'], 'metrics.jsonl')\n"
    "with open(path, 'a') as f:\n"
    "    for step in range(10, 410, 10):\n"
    "        f.write(json.dumps({{'step': step, 'split': 'train', 'loss': {base} + step / 1000, 'lr': {lr}}}) + '\\n')\n"
    "        if step % 100 == 0:\n"
    "            f.write(json.dumps({{'step': step, 'split': 'val', 'loss': {base} + 1, 'acc': [0.5, 0.3]}}) + '\\n')\n"
    "print('done', flush=True)\n"
    "time.sleep(600)\n"
)


def live_app(tmp_path: Path):
    from console.transport import LocalTransport

    return build_app(LocalTransport(tmp_path / "run", backoff_initial=0.2, backoff_max=1.0), poll_interval=None, refresh_throttle=0, stop_grace=5)


async def test_the_overlay_points_come_from_the_second_jobs_summary_on_the_host(tmp_path):
    app = live_app(tmp_path)
    async with app.run_test(size=(170, 45)) as pilot:
        await connected(app)
        started = []
        for name, base, lr in (("base", 5.0, 1e-3), ("second", 50.0, 2e-4)):
            argv = [sys.executable, "-c", WRITER.format(base=base, lr=lr)]
            started.append((await app.client.request(Request.START_JOB, name=name, kind="train", argv=argv))["job"])
            await wait_until(lambda n=name: n in app.state.jobs, what=f"{name} listed")
            if name == "base":
                app.select_job("base")  # before "second" exists, so the console never selects (and loads) it
        await pilot.press("2")
        await wait_until(lambda: (m := app.state.metrics.get("base")) and len(m.train_loss) == 40, timeout=30, what="base's metrics")
        assert not (app.state.metrics.get("second") and app.state.metrics["second"].history_loaded)  # never selected, never loaded
        await pilot.press("o")
        assert app.screen.overlay == "second"

        def overlay_points():
            spec = specs_of(app, "loss").get("second train")
            return spec and app.screen.query_one("#loss-plot", CurvePlot).curve(spec)

        drawn = await wait_until(lambda: (c := overlay_points()) and len(set(c.xs)) == 40 and c, timeout=30, what="the overlay's curve")
        assert sorted(set(drawn.xs)) == [float(s) for s in range(10, 410, 10)]
        assert all(y == pytest.approx(50.0 + x / 1000) for x, y in zip(drawn.xs, drawn.ys))  # second's losses, not base's
        theirs = app.state.metrics["second"]
        assert not theirs.history_loaded and theirs.summary(False) is not None  # from the summary fetch, not a job load
        summary_xs, _ = bucket_points(theirs.summary(False).buckets["train.loss"])
        assert set(drawn.xs) == set(summary_xs)
        lr = app.screen.query_one("#lr-plot", CurvePlot).curve(specs_of(app, "lr")["second lr"])
        assert set(lr.ys) == {2e-4}
        ours = app.screen.query_one("#loss-plot", CurvePlot).curve(specs_of(app, "loss")["train"])
        assert all(y == pytest.approx(5.0 + x / 1000) for x, y in zip(ours.xs, ours.ys))
        await stop_everything(app)
        assert not any(pid_alive(j["pid"]) for j in started)
