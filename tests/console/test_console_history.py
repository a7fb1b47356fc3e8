"""Long histories end to end: the trainer's writer -> agent index -> local transport -> console state -> screen.

A NaN loss written by backend.metrics.records.MetricsWriter is counted and drawn as a marker; a history the agent
never saw is indexed in the background with progress while the newest records show at once; zoom keys ask
the host for the zoomed range.
"""

import math
import random
import sys

from backend.metrics.records import MetricsWriter
from backend.protocol import Request
from console.screens.grokking import GrokkingScreen
from console.screens.training import TrainingScreen
from console.widgets.curve_plot import CurvePlot
from console.widgets.panels import latest_metrics_text
from tests.fixtures.ssh import connected, stop_everything, wait_until
from tests.fixtures.console_apps import live_app
from tests.fixtures.metrics_records import trainer_record, val_record

NAN_WRITER = """\
import math, os, time
from backend.metrics.records import MetricsWriter
writer = MetricsWriter(os.path.join(os.environ["EAGLE3_JOB_DIR"], "metrics.jsonl"))
for step in range(1, 41):
    loss = math.nan if step in (17, 31) else (math.inf if step == 23 else 4.0 / step)
    writer.write({"step": step, "split": "train", "loss": loss, "lr": 1e-4, "grad_norm": 1.0})
    if step % 10 == 0:
        writer.write({"step": step, "split": "val", "loss": 1.0, "acc": [0.5, 0.25]})
time.sleep(600)
"""


def loss_markers(app) -> list[float]:
    plot = app.screen.query_one("#loss-plot", CurvePlot)
    return sorted({m for spec in plot.specs for m in spec.markers})


async def test_nan_loss_from_the_trainers_writer_is_counted_and_marked(tmp_path):
    app = live_app(tmp_path)
    async with app.run_test(size=(160, 48)) as pilot:
        await connected(app)
        await app.client.request(Request.START_JOB, name="nan-run", kind="train", argv=[sys.executable, "-c", NAN_WRITER])
        app.select_job("nan-run")
        await pilot.press("2")
        await wait_until(
            lambda: (
                app.state.metrics.get("nan-run") and app.state.metrics["nan-run"].nonfinite_count("train.loss", app.state.metrics["nan-run"].train_loss) == 3
            ),
            what="3 non-finite losses in the state",
        )
        await pilot.pause(0.3)
        app.redraw_now()
        await pilot.pause()
        assert isinstance(app.screen, TrainingScreen)
        title = str(app.screen.query_one("#training-title").render())
        assert "3 NaN/inf loss values" in title
        assert loss_markers(app) == [17.0, 23.0, 31.0]
        assert "3 NaN/inf loss values in the run" in str(latest_metrics_text(app.state, "nan-run"))  # the Dashboard's panel
        await pilot.press("r")
        assert app.state.actions[-1][1].startswith("resyncing")  # the key says what it does
        await stop_everything(app)


def write_history(path, steps: int) -> None:
    rng = random.Random(0)
    writer = MetricsWriter(path)
    for step in range(1, steps + 1):
        writer.write(trainer_record(step, rng, math.nan if step == 1234 else None))
        if step % 500 == 0:
            writer.write(val_record(step, rng))


async def test_a_history_the_agent_never_saw_is_indexed_and_zoomable(tmp_path):
    run = tmp_path / "run"
    app = live_app(tmp_path)
    async with app.run_test(size=(160, 48)) as pilot:
        await connected(app)
        # A job whose metrics.jsonl already holds a long history when the agent first meets it.
        job = await app.client.request(Request.START_JOB, name="long", kind="train", argv=[sys.executable, "-c", "import time; time.sleep(600)"])
        job_dir = job["job"]["job_dir"]
        await app.client.request(Request.SHUTDOWN)
        await wait_until(lambda: not app.state.connection.connected, what="the agent to go")
        write_history(f"{job_dir}/metrics.jsonl", 30_000)
        await wait_until(lambda: app.state.connection.connected, timeout=60, what="the reconnect")
        app.select_job("long")
        await pilot.press("2")
        await wait_until(
            lambda: app.state.metrics.get("long") and app.state.metrics["long"].total_records == 30_060, timeout=120, what="the whole history indexed"
        )
        metrics = app.state.metrics["long"]
        assert len(metrics.train_loss) <= 2000, "only the tail is held as raw points"
        assert metrics.nonfinite_count("train.loss", metrics.train_loss) == 1
        assert [row[0] for row in metrics.val_acc][-1] == 30_000
        summary = metrics.summary(False)
        assert summary.step_range == (1, 30_000) and 100 < len(summary.buckets["train.loss"]) <= 512
        assert (run / "jobs" / "long" / "metrics.index").exists() or any(run.rglob("metrics.index"))

        current = lambda: app.state.metrics["long"]  # noqa: E731 - a reload replaces the job's metrics object
        await pilot.press("plus", "plus")  # zoom twice: a quarter of the run, following its end
        await wait_until(lambda: current().zoom is not None and current().zoom.step_from == app.screen.view.lo, timeout=60, what="the zoom reply")
        assert app.screen.view is not None and app.screen.view.hi == 30_000
        assert current().zoom.buckets["train.loss"][0]["step_lo"] >= app.screen.view.lo - 128
        await pilot.press("comma")  # earlier: the view stops following
        assert app.screen.view.hi < 30_000 and not app.screen.view.follow
        await pilot.press("0")
        assert app.screen.view is None

        await pilot.press("4")
        assert isinstance(app.screen, GrokkingScreen)
        await wait_until(lambda: current().summaries.get(True) is not None, timeout=60, what="the log-spaced summary")
        assert current().summaries[True].log_x and current().summaries[True].buckets["train.loss"][0]["step_lo"] == 1
        await stop_everything(app)
