"""The Grokking screen (host-side signals, data scaling), the grok-run modal's argv, and watching an external run."""

import json
import math
import re
import sys
import time
from pathlib import Path

import pytest
from textual.widgets import Input, OptionList

from backend.jobs.registry import safe_module_argv
from backend.commands import profile_shape as host_profile_shape
from backend.profiles import load_profile
from backend.protocol import Request
from backend.metrics.signals import compute_signals
from console.app import build_app
from backend.commands import grok_argv, grok_job_name
from console.screens.grok_modal import GrokModal, GrokParamError, parse_grok_params
from console.screens.modals import WatchModal
from console.screens.chain import result_panel_text
from console.format import accept_length
from console.widgets.grok_panels import acceptance_text, data_scaling_text, norms_text, signals_text
from tests.fixtures.ssh import connected, job_argv, pid_alive, screen_shown, stop_everything, wait_until
from tests.fixtures.console_states import amber_records
from tests.fixtures.console_states import DATA_SCALING_ESTIMATE, GROK_JOB, grok_state

SIZE = (160, 48)


DATA_SCALING_MEASURED = {
    "kind": "measured",
    "path": "/data/shards",
    "samples": 12000,
    "tokens": 24_000_000,
    "bytes": 12000 * 2_400_000,
    "bytes_per_sample": 2_400_000.0,
    "free_bytes": 400 * 1024**3,
    "keep_free_bytes": 1024**3,
    "more_samples_fit": 178_500,
    "fit_multiple_of_current": 14.875,
    "seconds_per_sample": 0.25,
    "estimated_seconds_for_fit": 44625.0,
}


def frozen_app(state=None):
    return build_app(state=state or grok_state(), poll_interval=None, refresh_throttle=0)


pytestmark = pytest.mark.usefixtures("utc")  # snapshot clocks read in UTC (tests/conftest.py)


# -- pure parts ----------------------------------------------------------------------------------


def test_grok_argv_and_job_name():
    checkpoint = "/root/.eagle3/jobs/train-1/checkpoints/epoch_0_step_300"
    assert grok_argv("tiny", checkpoint, 1e-4, 0.1, 0.98, 50) == [
        "eagle3-host",
        "train",
        "--profile",
        "tiny",
        "--resume",
        checkpoint,
        "--schedule",
        "constant",
        "--lr",
        "0.0001",
        "--weight-decay",
        "0.1",
        "--grokfast-alpha",
        "0.98",
        "--max-steps",
        "50",
    ]
    assert grok_job_name(checkpoint) == "grok-epoch-0-step-300"


def test_grok_params_are_checked_field_by_field():
    assert parse_grok_params("1e-4", "0.1", "") == (1e-4, 0.1, None)
    assert parse_grok_params(" 3e-4 ", "0", "0.98") == (3e-4, 0.0, 0.98)
    for args, field in [
        (("0", "0.1", ""), "learning rate"),
        (("x", "0.1", ""), "learning rate"),
        (("1e-4", "-1", ""), "weight decay"),
        (("1e-4", "0.1", "1.5"), "Grokfast alpha"),
        (("nan", "0.1", ""), "learning rate"),
    ]:
        with pytest.raises(GrokParamError, match=field):
            parse_grok_params(*args)


def test_data_scaling_panel_says_estimate_or_measured():
    estimate = str(data_scaling_text(DATA_SCALING_ESTIMATE, "tiny"))
    assert "ESTIMATE" in estimate and "profile tiny" in estimate and "2,208,000" in estimate and "unknown until" in estimate
    measured = str(data_scaling_text(DATA_SCALING_MEASURED, "tiny"))
    assert "MEASURED" in measured and "12.0k samples" in measured and "178,500" in measured and "12h23m" in measured
    assert "unavailable" in str(data_scaling_text({"error": "no such dir"}))


# The pre-clip grad norms and train losses the default tiny profile logged (every 5th step of 300, clip 0.5, seed 0):
# every record is above the clip, the loss falls smoothly and val acc_0 reached 0.853 (issue 12).
TINY_GRAD_NORMS = [
    9.72,
    11.47,
    8.14,
    3.97,
    2.5,
    3.2,
    2.47,
    1.72,
    1.91,
    1.7,
    2.55,
    2.2,
    1.82,
    1.68,
    1.8,
    2.04,
    2.42,
    2.93,
    2.06,
    1.91,
    2.46,
    1.86,
    2.36,
    2.06,
    3.33,
    2.51,
    3.71,
    1.74,
    1.79,
    1.61,
    1.59,
    1.92,
    2.33,
    1.64,
    1.7,
    1.93,
    2.0,
    1.47,
    2.05,
    1.67,
    2.13,
    2.16,
    1.82,
    2.14,
    3.12,
    1.44,
    2.02,
    1.53,
    1.74,
    0.96,
    1.76,
    1.48,
    0.98,
    2.48,
    1.79,
    1.27,
    1.81,
    2.13,
    1.21,
    1.05,
]
TINY_LOSSES = [
    20.26,
    16.4,
    13.46,
    11.43,
    10.81,
    10.95,
    10.07,
    10.18,
    10.06,
    9.78,
    10.63,
    9.96,
    9.06,
    8.96,
    9.0,
    8.32,
    9.06,
    8.55,
    8.34,
    8.56,
    8.49,
    7.97,
    7.92,
    7.68,
    7.26,
    7.62,
    7.83,
    7.31,
    7.37,
    7.25,
    6.94,
    7.19,
    7.13,
    7.16,
    7.06,
    6.6,
    6.96,
    6.66,
    6.95,
    6.83,
    6.88,
    7.0,
    6.79,
    6.77,
    6.6,
    6.65,
    6.28,
    6.52,
    6.66,
    6.65,
    6.38,
    6.53,
    6.4,
    6.38,
    6.39,
    6.49,
    6.51,
    6.64,
    6.33,
    6.25,
]


def grad_records(norms: list[float]) -> list[dict]:
    return [{"step": 5 * (i + 1), "split": "train", "loss": loss, "lr": 3e-3, "grad_norm": norm} for i, (norm, loss) in enumerate(zip(norms, TINY_LOSSES))]


def test_a_clip_that_binds_on_every_step_is_no_warning_a_rising_grad_norm_is():
    healthy = compute_signals(grad_records(TINY_GRAD_NORMS), clip=0.5)
    grads = healthy["grad_norm"]
    assert grads["clip_fraction"] == 1.0 and grads["median"] == pytest.approx(1.86) and grads["median_before"] == pytest.approx(2.5)
    assert not [w for w in healthy["warnings"] if "grad norm" in w.lower() or "clip" in w]
    panel = norms_text(healthy)
    assert "clipped at 0.5: 100.0% of the last 50 records" in str(panel) and "median 1.86 over the last 50 records (2.5 the 50" in str(panel)
    assert not [span for span in panel.spans if "red" in str(span.style)]  # a fact shown plainly, not an alarm
    rising = compute_signals(grad_records([0.4] * 20 + [0.4 * 1.08**i for i in range(40)]), clip=0.5)  # 0.4 -> 8
    warning = [w for w in rising["warnings"] if w.startswith("Grad norm rising")]
    assert warning and "vs 0.4 before" in warning[0] and "above the clip 0.5" in warning[0]
    assert f"! {warning[0]}" in str(signals_text(rising))


def test_tau_hat_and_accept_lengths_are_printed_one_way_on_every_screen():
    assert [accept_length(v) for v in (1.0, 1, 3.9444, 1.405, 12.0, None, "x", True, math.nan, math.inf)] == [
        "1.00",
        "1.00",
        "3.94",
        "1.41",
        "12.00",
        "-",
        "-",
        "-",
        "nan",
        "inf",
    ]
    grok = str(acceptance_text({"tau_hat": 1.0, "tau_hat_step": 13, "tau_hat_acceptance": 2.9444, "per_position": []}))
    assert "τ̂ 1.00 (val acc at step 13) · from acceptance rate 2.94" in grok and "replayed" not in grok
    replayed = str(acceptance_text({"tau_hat": 2.47, "tau_hat_step": 5800, "accept_replayed": 2.104, "per_position": []}))
    assert "τ̂ 2.47 (val acc at step 5,800) · chain rounds replayed 2.10" in replayed
    records = amber_records()  # issue 12's 13-step draft: τ̂ 1.0, accept length 1.41
    for record in records:
        if record["stage"] == "result" and record["status"] == "ok":
            record["result"]["throughput"] = [{"concurrency": 1, "output_tok_per_s": 80.0, "accept_length": 1.0, "accept_length_mean_of_request_means": 1.4}]
    chain = result_panel_text(records).plain
    assert "accept length 1.41  vs τ̂ 1.00 (from validation accuracy)" in chain
    assert "1.41 pooled over verify steps (SGLang, vLLM)   1.43 mean of per-request means" in chain
    assert "accept length pooled / per-request" in chain and "1.00 / 1.40" in chain  # the throughput table's columns
    shown = re.findall(r"(?:τ̂|accept length) (\d[\d.]*)", chain + grok)  # every number after either label
    assert len(shown) >= 4 and all(re.fullmatch(r"\d+\.\d\d", value) for value in shown), shown


# -- frozen data, no host ------------------------------------------------------------------------


async def test_grokking_screen_draws_host_signals_and_log_step_curves():
    app = frozen_app()
    async with app.run_test(size=SIZE) as pilot:
        app.select_job(GROK_JOB)
        await pilot.press("4")
        await pilot.pause()
        screen = app.screen
        assert screen.MODE == "grokking"
        loss = screen.query_one("#grok-loss")
        assert loss.options.log_x and [s.label for s in loss.specs] == ["train raw", "train EMA", "val EMA"]
        assert max(loss.curve(loss.specs[0]).xs) == pytest.approx(math.log10(30000))
        weight = screen.query_one("#grok-weight")
        assert [s.label for s in weight.specs] == ["total", "fc", "lm_head", "midlayer"]
        alerts = str(screen.query_one("#grok-alerts").render())
        assert "GROKKING ONSET" in alerts and "LR AT ITS FLOOR" in alerts
        signals = str(screen.query_one("#grok-signals").render())
        assert "val slope" in signals and "z " in signals and "plateau since step" in signals and "tokens past it" in signals
        assert "τ̂" in str(screen.query_one("#grok-acceptance").render())
        assert "lm_head" in str(screen.query_one("#grok-norms").render())
        assert "ESTIMATE" in str(screen.query_one("#grok-data").render())
        assert app.signals.fetches == 0  # no host: nothing asked


def test_grokking_screen_snapshot(snap_compare):
    async def run_before(pilot):
        pilot.app.select_job(GROK_JOB)
        await pilot.pause()
        await pilot.press("4")
        await pilot.pause()
        pilot.app.redraw_now()
        await pilot.pause()

    assert snap_compare(frozen_app(), terminal_size=SIZE, run_before=run_before)


async def test_grok_modal_builds_the_exact_argv_and_refuses_bad_fields():
    checkpoints = [
        {"path": "/r/jobs/t/checkpoints/epoch_0_step_100", "epoch": 0, "step": 100, "latest": False},
        {"path": "/r/jobs/t/checkpoints/epoch_0_step_300", "epoch": 0, "step": 300, "latest": True},
        {"path": "/r/jobs/t/checkpoints/epoch_1_step_400", "epoch": 1, "step": 400, "latest": False},
    ]
    app = frozen_app()
    results = []
    async with app.run_test(size=SIZE) as pilot:
        modal = GrokModal("t", "tiny", checkpoints, lr=0.003, weight_decay=0.1)
        app.push_screen(modal, results.append)
        await pilot.pause()
        assert modal.query_one("#grok-checkpoints", OptionList).highlighted == 1  # the latest one
        modal.query_one("#grok-lr", Input).value = "1e-4"
        modal.query_one("#grok-alpha", Input).value = "2"
        await pilot.press("enter")
        await pilot.pause()
        assert "Grokfast alpha" in str(modal.query_one("#grok-error").render()) and not results
        modal.query_one("#grok-alpha", Input).value = "0.98"
        modal.query_one("#grok-checkpoints", OptionList).highlighted = 0
        await pilot.pause()
        assert "--grokfast-alpha 0.98" in str(modal.query_one("#grok-argv").render())
        modal.query_one("#grok-lr", Input).focus()
        await pilot.press("enter")
        await pilot.pause()
    assert results == [
        {"name": "grok-epoch-0-step-100", "checkpoint": checkpoints[0]["path"], "argv": grok_argv("tiny", checkpoints[0]["path"], 1e-4, 0.1, 0.98)}
    ]


async def test_grok_and_watch_are_disabled_without_a_host():
    state = grok_state()
    state.add_external("ext:specforge", "/runs/specforge/train.log")
    app = frozen_app(state)
    async with app.run_test(size=SIZE) as pilot:
        app.select_job(GROK_JOB)
        await pilot.pause()
        for action in ("grok", "watch_external", "stop_and_bench"):
            assert app.check_action(action, ()) is None
        await pilot.press("g")
        await pilot.pause()
        assert not isinstance(app.screen, GrokModal)
        assert app.state.actions[-1][1] == "Grok run is disabled: no host connection"
        app.select_job("ext:specforge")
        await pilot.press("s")
        await pilot.pause()
        assert app.state.actions[-1][1] == "Stop job is disabled: no host connection"


# -- the real agent ------------------------------------------------------------------------------


def live_app(tmp_path, **kwargs):
    from console.transport import LocalTransport

    transport = LocalTransport(tmp_path / "run", backoff_initial=0.2, backoff_max=1.0)
    return build_app(transport, poll_interval=None, refresh_throttle=0, stop_grace=5, **kwargs)


WRITER = (
    "import json, os, time\n"
    "path = os.path.join(os.environ['EAGLE3_JOB_DIR'], 'metrics.jsonl')\n"
    "for step in range(1, {steps} + 1):\n"
    "    with open(path, 'a') as f:\n"
    "        f.write(json.dumps({{'step': step * 10, 'split': 'train', 'loss': 5.0 / step, 'lr': 1e-3, 'grad_norm': 0.4,"
    " 'weight_norm': 100.0 - step, 'tokens': step * 1000}}) + '\\n')\n"
    "        if step % 5 == 0:\n"
    "            f.write(json.dumps({{'step': step * 10, 'split': 'val', 'loss': 6.0 / step, 'acc': [0.5, 0.3]}}) + '\\n')\n"
    "    time.sleep({pause})\n"
    "print('done', flush=True)\n"
    "time.sleep(600)\n"
)


async def test_signals_follow_new_metrics_at_a_modest_rate_and_data_scaling_is_estimated(tmp_path):
    app = live_app(tmp_path, signals_interval=2.0)
    events = []
    async with app.run_test(size=SIZE) as pilot:
        await connected(app)
        steps = 40
        argv = [sys.executable, "-c", WRITER.format(steps=steps, pause=0.1), "--profile", "tiny"]
        job = (await app.client.request(Request.START_JOB, name="writer", kind="train", argv=argv))["job"]
        app.select_job("writer")
        await pilot.press("4")
        original = app.session_event

        def counting(session, event, changed):
            if isinstance(event, dict) and event.get("type") == "metrics" and event.get("job") == "writer":
                events.append(len(event.get("records") or []))
            original(session, event, changed)

        app.session_event = counting
        hooked = time.monotonic()
        total = steps + steps // 5
        await wait_until(lambda: app.state.signals.get("writer", {}).get("n_records") == total, timeout=60, what="signals computed over every record")
        # Throttled to one request per signals_interval (2 s) plus the selection's and the screen's own, however many
        # metrics events came (on a loaded machine the history load may carry every record and no event comes at all).
        assert 1 <= app.signals.fetches <= 2 + math.ceil((time.monotonic() - hooked) / 2.0)
        if len(events) >= 10:
            assert app.signals.fetches < len(events), "one request per metrics event"
        signals = app.state.signals["writer"]
        assert signals["latest"]["tokens"] == steps * 1000 and signals["tau_hat"] == pytest.approx(1 + 0.5 + 0.15)
        report = await wait_until(lambda: app.state.data_scaling.get("writer"), what="data scaling")
        assert report["kind"] == "estimated" and report["shape"] == host_profile_shape(load_profile("tiny"))
        assert report["more_samples_fit"] > 0 and report["bytes_per_sample"] == pytest.approx((384 + 259) * 4 * 128 + 9 * 128)
        assert "ESTIMATE" in str(app.screen.query_one("#grok-data").render())
        await pilot.pause(2.5)  # a request scheduled by the last metrics event runs now
        fetched = app.signals.fetches
        await pilot.pause(2.5)
        assert app.signals.fetches == fetched, "no new metrics: no new request"
        await stop_everything(app)
        assert not pid_alive(job["pid"])


async def test_data_scaling_is_measured_from_the_runs_data_dir(tmp_path):
    data = tmp_path / "shards"
    data.mkdir()
    (data / "meta.json").write_text(
        json.dumps({"created": time.time() - 50, "splits": {"train": {"samples": 40, "tokens": 5120}, "val": {"samples": 10, "tokens": 1280}}})
    )
    (data / "train-00000.safetensors").write_bytes(b"\0" * 40_000)
    (data / "val-00000.safetensors").write_bytes(b"\0" * 10_000)
    app = live_app(tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        await connected(app)
        argv = [*job_argv(sys.executable), "--profile", "tiny", "--data", str(data)]
        job = (await app.client.request(Request.START_JOB, name="offline", kind="train", argv=argv))["job"]
        await wait_until(lambda: "offline" in app.state.jobs, what="the job listed")
        app.select_job("offline")
        await pilot.press("4")
        report = await wait_until(lambda: app.state.data_scaling.get("offline"), what="data scaling")
        assert report["kind"] == "measured" and report["path"] == str(data) and report["bytes_per_sample"] == 1000.0
        panel = str(app.screen.query_one("#grok-data").render())
        assert "MEASURED" in panel and "50 samples" in panel and "1000 B" in panel and "at the measured" in panel
        await stop_everything(app)
        assert not pid_alive(job["pid"])


SPECFORGE_LOG = "".join(
    f"03/16/2026 10:00:{i:02d} - INFO - specforge.utils - Eval - Step {step} [{step + 1}/10], position {k},  Acc: {acc:.2f}\n"
    + f"03/16/2026 10:00:{i:02d} - INFO - specforge.utils - Eval - Step {step} [{step + 1}/10], position {k}, pLoss: {2.0 / (i + 1) + k:.3f}\n"
    for i, step in enumerate(range(50, 550, 50))
    for k, acc in enumerate([0.5 + i * 0.02, 0.3 + i * 0.02])
)


async def test_watch_an_external_run_read_only_on_the_training_and_grokking_screens(tmp_path):
    log = tmp_path / "specforge-train.log"
    log.write_text(SPECFORGE_LOG)
    app = live_app(tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        await connected(app)
        await pilot.press("w")
        modal = await screen_shown(app, WatchModal, "the watch modal")
        modal.query_one("#watch-path", Input).value = str(log)
        modal.query_one("#watch-name", Input).value = "sf"
        modal.query_one("#watch-path", Input).focus()
        await pilot.press("enter")
        await wait_until(lambda: app.selected_job == "ext:sf", what="the external run selected")
        await wait_until(lambda: (m := app.state.metrics.get("ext:sf")) and len(m.train_loss) >= 9, timeout=30, what="external metrics")
        assert app.state.jobs["ext:sf"].kind == "external"
        await pilot.press("2")
        await pilot.pause()
        assert len(app.screen.query_one("#loss-plot").specs[0].series) >= 9
        await pilot.press("4")
        await wait_until(lambda: app.state.signals.get("ext:sf"), what="signals of the external run")
        assert "(external, read-only)" in str(app.screen.query_one("#grok-title").render())
        for key, label in (("s", "Stop job"), ("b", "Stop & bench"), ("g", "Grok run")):
            await pilot.press(key)
            await pilot.pause()
            assert app.state.actions[-1][1] == f"{label} is disabled: ext:sf is an external run, watched read-only"
        assert (await app.client.request(Request.LIST_JOBS))["jobs"] == []  # nothing was started or adopted
        assert log.read_text() == SPECFORGE_LOG  # nothing written there


TRAINER_STDERR = "".join(f"[train] step {s}/300 loss {7 - s / 100:.4f} acc0 {0.5 + s / 1000:.3f} lr 4.40e-04 grad 0.5 0.1 s/step\n" for s in range(20, 320, 20))


async def watch_with_modal(app, pilot, path, name, line_format=""):
    await pilot.press("w")
    modal = await screen_shown(app, WatchModal, "the watch modal")
    modal.query_one("#watch-path", Input).value = str(path)
    modal.query_one("#watch-name", Input).value = name
    modal.query_one("#watch-format", Input).value = line_format
    modal.query_one("#watch-path", Input).focus()
    await pilot.press("enter")


async def test_watch_reads_plain_text_logs_says_the_format_and_warns_on_an_unknown_one(tmp_path):
    own, script, notes = tmp_path / "stderr.log", tmp_path / "train.out", tmp_path / "notes.txt"
    own.write_text(TRAINER_STDERR)
    script.write_text("".join(f"epoch 1 step {s} loss {9 - s / 100:.2f} acc0 0.246 lr 1.2e-04\n" for s in range(100, 400, 50)))
    notes.write_text("it=1 L=3.5\nit=2 L=3.25\n")
    app = live_app(tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        await connected(app)
        await watch_with_modal(app, pilot, own, "own")
        await wait_until(lambda: (m := app.state.metrics.get("ext:own")) and len(m.train_loss) >= 15, timeout=30, what="the trainer's lines")
        assert any(f"watching {own} as ext:own (read as text;" in line for _, line in app.state.actions)
        assert app.state.job_details["ext:own"] == f"watching {own} (read-only, text)"
        await watch_with_modal(app, pilot, script, "script")
        await wait_until(lambda: (m := app.state.metrics.get("ext:script")) and len(m.train_loss) >= 6, timeout=30, what="the script's lines")
        await watch_with_modal(app, pilot, notes, "notes")
        await wait_until(lambda: any("ext:notes: no line in the first" in line for _, line in app.state.actions), what="the unknown-format warning")
        assert "text: a plain-text log" in next(line for _, line in app.state.actions if "ext:notes: no line" in line)
        await watch_with_modal(app, pilot, notes, "notes2", r"it=(?P<step>\d+) L=(?P<loss>\S+)")
        await wait_until(lambda: (m := app.state.metrics.get("ext:notes2")) and len(m.train_loss) == 2, timeout=30, what="the regex's records")
        assert app.state.external_formats["ext:notes2"] == r"it=(?P<step>\d+) L=(?P<loss>\S+)"


async def test_a_freshly_watched_tensorboard_runs_training_screen_shows_its_records_without_r(tmp_path):
    """The whole run arrives in the first polls, then nothing: the Training screen's history must follow without r."""
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(str(tmp_path / "tb"))
    for step in range(0, 300, 10):
        writer.add_scalar("train/loss", 5 - step / 100, step)
        writer.add_scalar("train/lr", 1e-4, step)
    writer.close()
    app = live_app(tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        await connected(app)
        await watch_with_modal(app, pilot, tmp_path / "tb", "tb")
        await wait_until(lambda: app.selected_job == "ext:tb", what="the watched run selected")
        await pilot.press("2")
        title = lambda: str(app.screen.query_one("#training-title").render())
        await wait_until(lambda: "ext:tb · 30 records" in title(), timeout=20, what="the Training screen's record count", context=title)


async def test_a_watched_specforge_runs_tags_without_a_schema_key_reach_the_dashboard(tmp_path):
    """eval/simulated_acc_len (SpecForge's own accept-length estimate) and train/acceptance_rate used to be dropped."""
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(str(tmp_path / "sf"))
    for step in (10, 20):
        writer.add_scalar("train/loss", 3.0, step)
        writer.add_scalar("train/acceptance_rate", 0.5, step)
        writer.add_scalar("eval/avg_loss", 3.5, step)
        writer.add_scalar("eval/simulated_acc_len", 1.75, step)
    writer.close()
    app = live_app(tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        await connected(app)
        await watch_with_modal(app, pilot, tmp_path / "sf", "sf")
        await wait_until(lambda: app.selected_job == "ext:sf", what="the watched run selected")
        panel = lambda: str(app.screen.query_one("#latest").render())
        await wait_until(lambda: "eval/simulated_acc_len 1.75" in panel(), timeout=20, what="the extras on the Dashboard", context=panel)
        assert "train/acceptance_rate 0.5" in panel()


async def test_grokking_judges_a_run_by_its_own_run_dir_and_a_watched_run_not_by_the_consoles_profile(tmp_path):
    log = tmp_path / "specforge-train.log"
    log.write_text(SPECFORGE_LOG)
    elsewhere = tmp_path / "elsewhere"
    app = live_app(tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        await connected(app)
        argv = [sys.executable, "-c", WRITER.format(steps=5, pause=0.0), "--profile", "tiny", "--run-dir", str(elsewhere)]
        job = (await app.client.request(Request.START_JOB, name="moved", kind="train", argv=argv))["job"]
        await wait_until(lambda: "moved" in app.state.jobs, what="the job listed")
        app.select_job("moved")
        await pilot.press("4")
        report = await wait_until(lambda: app.state.data_scaling.get("moved"), what="data scaling")
        assert report["path"].startswith(str(elsewhere)), report  # the profile's data dir moved with the job's --run-dir
        await pilot.press("1")
        await watch_with_modal(app, pilot, log, "sf")
        await wait_until(lambda: app.selected_job == "ext:sf", what="the watched run selected")
        await pilot.press("4")
        await wait_until(lambda: app.state.signals.get("ext:sf"), what="signals of the watched run")
        data = await wait_until(lambda: app.state.data_scaling.get("ext:sf"), what="the data panel of the watched run")
        assert "watched run: its data dir and sample shapes are not known here" in data["error"]
        app.redraw_now()
        await pilot.pause()
        norms = str(app.screen.query_one("#grok-norms").render())
        assert "clip threshold: not known for a watched run" in norms and "clipped at" not in norms
        await stop_everything(app)
        assert not pid_alive(job["pid"])


async def test_per_position_train_columns_keep_a_value_when_the_hosts_history_has_only_acc0():
    """After a console restart the host's signals come from its whole-history index, which keeps train acc[0] only:
    the other train columns turned to "-"; they now show the latest raw train record's values, starred."""
    state = grok_state()
    signals = state.signals[GROK_JOB]
    for row in signals["per_position"][1:]:
        row["train_acc"] = row["train_ploss"] = None
    latest = state.metrics[GROK_JOB].latest_train
    app = frozen_app(state)
    async with app.run_test(size=SIZE) as pilot:
        app.select_job(GROK_JOB)
        await pilot.pause()
        await pilot.press("4")
        await pilot.pause()
        app.redraw_now()
        await pilot.pause()
        panel = str(app.screen.query_one("#grok-acceptance").render())
        row = next(line for line in panel.splitlines() if line.startswith(" 1 "))
        assert row.split()[1] == f"{100 * latest['acc'][1]:.1f}%*", panel
        assert "* latest raw train value" in panel and " - " not in row


async def test_grok_key_starts_the_training_job_with_the_grok_argv(tmp_path):
    app = live_app(tmp_path, profile="no-such-profile")  # the started run fails fast instead of training on a shared CPU
    async with app.run_test(size=SIZE) as pilot:
        await connected(app)
        base = (await app.client.request(Request.START_JOB, name="base", kind="train", argv=[*job_argv(sys.executable), "--profile", "no-such-profile"]))["job"]
        checkpoints = Path(base["job_dir"]) / "checkpoints"
        for name in ("epoch_0_step_100", "epoch_0_step_200"):
            (checkpoints / name).mkdir(parents=True)
            (checkpoints / name / "config.json").write_text("{}")  # complete as far as the layout checks
            (checkpoints / name / "model.safetensors").write_bytes(b"")
        (checkpoints / "latest").write_text("epoch_0_step_200\n")
        await wait_until(lambda: "base" in app.state.jobs, what="the base job listed")
        app.select_job("base")
        await pilot.press("g")
        modal = await screen_shown(app, GrokModal, "the grok modal")
        await pilot.pause()
        modal.query_one("#grok-lr", Input).value = "2e-4"
        modal.query_one("#grok-wd", Input).value = "0.5"
        modal.query_one("#grok-alpha", Input).value = "0.9"
        modal.query_one("#grok-lr", Input).focus()
        await pilot.press("enter")
        name = "grok-epoch-0-step-200"
        job = await wait_until(lambda: app.state.jobs.get(name), what="the grok run listed")
        expected = grok_argv("no-such-profile", str(checkpoints / "epoch_0_step_200"), 2e-4, 0.5, 0.9)
        assert job.kind == "train" and job.argv[1:] == safe_module_argv("backend", expected[1:])[1:]
        await wait_until(lambda: app.selected_job == name, what="the grok run selected")
        assert any(text.startswith(f"started {name} (pid ") for _, text in app.state.actions)  # its exit alert may follow already
        await wait_until(lambda: app.state.jobs[name].state == "exited", timeout=60, what="the failing run to exit")
        app.select_job("base")
        await pilot.press("g")  # the same checkpoint again: a new name, the first grok run is not archived
        modal = await screen_shown(app, GrokModal, "the grok modal again")
        await pilot.pause()
        modal.query_one("#grok-lr", Input).value = "2e-4"
        modal.query_one("#grok-wd", Input).value = "0.5"
        modal.query_one("#grok-alpha", Input).value = "0.9"
        modal.query_one("#grok-lr", Input).focus()
        await pilot.press("enter")
        second = await wait_until(lambda: app.state.jobs.get(f"{name}-2"), what="the second grok run listed")
        assert second.argv[-8:] == job.argv[-8:] and app.state.jobs[name].state == "exited"
        await stop_everything(app)
        assert not pid_alive(base["pid"])
