"""Pilot tests: keys, screens, the command palette, guarded actions and their modals, against the real local agent."""

import asyncio
import dataclasses
import io
import os
import re
import signal
import subprocess
import sys

import pytest
from rich.console import Console
from textual.command import CommandList, CommandPalette
from textual.widgets import DataTable, Input

from backend.jobs.registry import safe_module_argv
from backend.protocol import Request
from console.actions import ACTIONS, MULTI_HOST_ACTIONS
from console.app import build_app
from console.session import LOG_TAIL_LINES
from console.screens.base import ConsoleView
from console.screens.dashboard import DashboardScreen
from console.screens.logs import TAIL_LINES, LogsScreen, lines_label
from console.screens.modals import AdoptModal, ResumeModal, StopModal, checkpoint_line, pids_phrase, stop_plan_text, training_phases
from console.screens.training import TrainingScreen
from tests.fixtures.ssh import connected, job_argv, pid_alive, screen_shown, stop_everything, wait_until
from tests.fixtures.console_states import STOP_PLAN, frozen_state, job_wire
from tests.fixtures.console_apps import banner_text, live_app

SIZE = (150, 45)


def frozen_app():
    return build_app(state=frozen_state(), poll_interval=None, refresh_throttle=0)


@pytest.fixture
def own_processes():
    """Processes a test spawns itself; killed at the end if still there."""
    procs: list[subprocess.Popen] = []
    yield procs
    for proc in procs:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def plain(renderable, width: int = 200) -> str:
    """A Rich renderable as the plain text a terminal of `width` columns shows."""
    console = Console(width=width, record=True, file=io.StringIO())
    console.print(renderable)
    return console.export_text()


# -- frozen data, no host ------------------------------------------------------------------------


def test_the_stop_plan_says_which_process_will_not_handle_sigterm_and_why_no_checkpoint():
    plan = {
        "jobs": ["traced"],
        "will_signal": [
            {
                "pid": 77,
                "job": "traced",
                "cmdline": "python -m backend train",
                "role": "leader",
                "state": "stopped by a debugger: cannot handle SIGTERM until the debugger lets it go",
            }
        ],
        "stale": [],
        "foreign_gpu_holders": [],
        "checkpoint_first": False,
        "checkpoint_note": "traced's leader is stopped by a debugger: its SIGTERM stays pending until the debugger lets it go, so it writes no checkpoint and gets SIGKILL after the grace",
    }
    text = str(stop_plan_text(plan, 30.0))
    assert "this process is stopped by a debugger: cannot handle SIGTERM" in text
    assert "Checkpoint first: NO. traced's leader is stopped by a debugger" in text and "no training job in this stop" not in text


def test_the_app_has_every_member_of_the_view_its_screens_are_typed_against():
    assert isinstance(frozen_app(), ConsoleView)


async def test_keys_switch_screens_and_toggle_the_plot_options():
    app = frozen_app()
    async with app.run_test(size=SIZE) as pilot:
        app.select_job("train-kimi")
        await pilot.pause()
        assert isinstance(app.screen, DashboardScreen)
        table = app.screen.query_one("#jobs", DataTable)
        assert table.row_count == 2 and table.get_row_at(table.cursor_row)[0] == "train-kimi"
        await pilot.press("2")
        assert isinstance(app.screen, TrainingScreen)
        plot = app.screen.query_one("#loss-plot")
        assert not plot.options.log_x
        await pilot.press("x", "y", "e")
        await pilot.pause()
        assert plot.options.log_x and plot.options.log_y and plot.options.ema_weight == 0.9
        train = plot.curve(plot.specs[0])
        assert train.source_points == 400 and max(train.xs) == pytest.approx(3.602, abs=1e-3)  # log10(4000)
        assert "x log step (x t)" in str(app.screen.query_one("#training-title").render())  # the title names the x axis
        await pilot.press("3")
        assert isinstance(app.screen, LogsScreen)
        assert app.screen.query_one("#log-stdout").line_count == 40
        await pilot.press("f")
        assert not app.screen.query_one("#log-stdout").auto_scroll
        await pilot.press("1")
        assert isinstance(app.screen, DashboardScreen)


async def test_job_selection_follows_the_jobs_table_and_the_bracket_keys():
    app = frozen_app()
    async with app.run_test(size=SIZE) as pilot:
        app.select_job("train-kimi")
        await pilot.pause()
        await pilot.press("]")
        assert app.selected_job == "bench-old"
        await pilot.press("[")
        assert app.selected_job == "train-kimi"
        table = app.screen.query_one("#jobs", DataTable)
        table.focus()
        await pilot.press("down")
        await pilot.pause()
        assert app.selected_job == "bench-old"
        assert "bench-old" in str(app.screen.query_one("#latest").render())


async def test_redraws_wait_while_a_modal_is_open():
    app = frozen_app()
    async with app.run_test(size=SIZE) as pilot:
        app.select_job("train-kimi")
        await pilot.pause()
        table = app.screen.query_one("#jobs", DataTable)
        app.push_screen(StopModal("train-kimi", STOP_PLAN, 30.0))
        await pilot.pause()
        await pilot.press("2", "s")  # app keys are off while the modal is up
        assert isinstance(app.screen, StopModal) and len(app.screen_stack) == 2
        app.handle_event({"type": "jobs", "jobs": []})
        await pilot.pause()
        assert table.row_count == 2  # frozen behind the modal
        await pilot.press("escape")
        await pilot.pause()
        assert table.row_count == 0


async def test_a_poll_tick_or_redraw_that_comes_once_the_screens_are_gone_does_nothing():
    """At shutdown Textual empties the screen stack before it stops the app's timers: a poll tick or a redraw due then
    found no screen and raised ScreenStackError, which failed the app (and, now and then, the test that ran it)."""
    app = frozen_app()
    async with app.run_test(size=SIZE) as pilot:
        app.select_job("train-kimi")
        await pilot.pause()
    assert app.screen_stack == [] and app.shown_screen is None and not app.modal_open
    app._poll_tick()
    app.handle_event({"type": "jobs", "jobs": []})
    app._redraw()
    app.redraw_now()
    app.signals.request("train-kimi")


async def test_without_a_host_guarded_actions_are_disabled_and_say_why():
    app = frozen_app()
    async with app.run_test(size=SIZE) as pilot:
        app.select_job("train-kimi")
        await pilot.pause()
        for action in ("stop_job", "adopt", "start_training"):
            assert app.check_action(action, ()) is None
        await pilot.press("s")
        await pilot.pause()
        assert not isinstance(app.screen, StopModal)
        assert app.state.actions[-1][1] == "Stop job is disabled: no host connection"


async def test_command_palette_lists_every_action_and_runs_them_through_the_guard():
    app = frozen_app()
    async with app.run_test(size=SIZE) as pilot:
        app.select_job("train-kimi")
        await pilot.press("2")
        await pilot.press("ctrl+p")
        await pilot.pause()
        assert isinstance(app.screen, CommandPalette)
        await wait_until(lambda: app.screen.query_one(CommandList).option_count > 0, what="palette entries")
        prompts = [str(app.screen.query_one(CommandList).get_option_at_index(i).prompt) for i in range(app.screen.query_one(CommandList).option_count)]
        joined = "\n".join(prompts)
        for action in ACTIONS:
            if action.screen in (None, TrainingScreen) and action.name not in MULTI_HOST_ACTIONS:
                assert action.label in joined, action.label
            elif action.name in MULTI_HOST_ACTIONS:
                assert action.label not in joined, f"{action.label} offered by a one-host console"
        assert "disabled: no host connection" in joined
        await pilot.press(*"log step")
        await pilot.pause(0.3)
        await pilot.press("enter")
        await wait_until(lambda: isinstance(app.screen, TrainingScreen) and app.screen.log_step, what="palette toggled log step")
        await pilot.press("ctrl+p")
        await pilot.press(*"stop job")
        await pilot.pause(0.3)
        await pilot.press("enter")
        await wait_until(lambda: app.state.actions[-1][1] == "Stop job is disabled: no host connection", what="the guard's message")


# -- the real agent ------------------------------------------------------------------------------


async def test_stop_modal_lists_the_pids_and_stop_really_ends_the_job(tmp_path):
    app = live_app(tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        await connected(app)
        job = (await app.client.request(Request.START_JOB, name="victim", kind="train", argv=job_argv(sys.executable)))["job"]
        await wait_until(lambda: "victim" in app.state.jobs, what="the job listed")
        app.select_job("victim")
        await wait_until(lambda: app.state.metrics.get("victim") and app.state.metrics["victim"].records, what="its steps logged")

        await pilot.press("s")
        modal = await screen_shown(app, StopModal, "the stop modal")
        assert modal.pids == [job["pid"]]
        text = str(modal.query_one("#stop-plan").render())
        assert str(job["pid"]) in text and "Checkpoint first: YES" in text and "Foreign GPU holders, left alone" in text
        await pilot.press("escape")
        await wait_until(lambda: "cancelled" in app.state.actions[-1][1], what="cancel noted")
        assert pid_alive(job["pid"])

        await pilot.press("s")
        await screen_shown(app, StopModal, "the stop modal again")
        await pilot.press("y")
        await wait_until(lambda: app.state.actions[-1][1].startswith("stop victim:"), timeout=60, what="the stop verdicts")
        assert f"{job['pid']} exited_on_term" in app.state.actions[-1][1]
        assert not pid_alive(job["pid"])
        await wait_until(lambda: app.state.jobs["victim"].state != "running", what="the job table to show the stop")


async def test_adopt_refuses_a_mistyped_pid_and_adopts_the_confirmed_one(tmp_path, own_processes):
    foreign = subprocess.Popen(["sleep", "300"], start_new_session=True)
    own_processes.append(foreign)
    app = live_app(tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        await connected(app)
        other = (await app.client.request(Request.START_JOB, name="other", kind="other", argv=["sleep", "300"]))["job"]
        await wait_until(lambda: "other" in app.state.jobs, what="the other job listed")
        app.select_job("other")
        await pilot.press("a")
        modal = await screen_shown(app, AdoptModal, "the adopt modal")
        modal.query_one("#adopt-pid", Input).value = str(foreign.pid)
        modal.query_one("#adopt-confirm", Input).value = str(foreign.pid + 1)
        modal.query_one("#adopt-confirm", Input).focus()
        await pilot.press("enter")
        await pilot.pause()
        assert app.screen is modal  # still open
        assert "must match. Nothing adopted." in str(modal.query_one("#adopt-error").render())
        assert [j["name"] for j in (await app.client.request(Request.LIST_JOBS))["jobs"]] == ["other"]

        modal.query_one("#adopt-confirm", Input).value = str(foreign.pid)
        await pilot.press("enter")
        await wait_until(lambda: any("adopt" in text for _, text in app.state.actions), what="the adoption")
        assert [t for _, t in app.state.actions if "adopt" in t] == [f"adopted pid {foreign.pid} as adopted-{foreign.pid}"]
        jobs = {j["name"]: j for j in (await app.client.request(Request.LIST_JOBS))["jobs"]}
        assert jobs[f"adopted-{foreign.pid}"]["adopted"] is True and jobs[f"adopted-{foreign.pid}"]["pid"] == foreign.pid
        await wait_until(lambda: app.selected_job == f"adopted-{foreign.pid}", what="the adopted job selected")
        await pilot.press("s")  # plans the stop of the job just adopted, not of the one selected before
        await screen_shown(app, StopModal, "the stop modal")
        assert app.screen.pids == [foreign.pid]
        await pilot.press("escape")
        await stop_everything(app)
        assert not pid_alive(foreign.pid) or foreign.poll() is not None
        assert not pid_alive(other["pid"])


async def test_new_run_key_starts_eagle3_host_train_with_the_profile(tmp_path):
    app = live_app(tmp_path, profile="no-such-profile")  # fails fast instead of training on a shared CPU
    async with app.run_test(size=SIZE) as pilot:
        await connected(app)
        await pilot.press("n")
        # any note, not the last: the run fails in a second or two and its exit alert may already follow the start note
        await wait_until(lambda: any(text.startswith("started train-no-such-profile-") for _, text in app.state.actions), what="the start")
        name = app.selected_job
        job = await wait_until(lambda: app.state.jobs.get(name), what="the new job listed")
        assert job.kind == "train" and job.argv[1:] == safe_module_argv("backend", ["train", "--profile", "no-such-profile"])[1:]
        await wait_until(lambda: app.state.jobs[name].state == "exited", timeout=60, what="the failing run to exit")
        await stop_everything(app)


async def test_actions_are_disabled_while_disconnected_and_come_back(tmp_path):
    app = live_app(tmp_path, backoff=1.5, backoff_max=1.5)
    async with app.run_test(size=SIZE) as pilot:
        await connected(app)
        job = (await app.client.request(Request.START_JOB, name="keeps-running", kind="other", argv=job_argv(sys.executable)))["job"]
        app.select_job("keeps-running")
        agent_pid = app.state.hello.agent_pid
        os.kill(agent_pid, signal.SIGKILL)  # the console's own agent child: the link drops
        await wait_until(lambda: app.state.stale, what="the drop")
        await pilot.pause()
        for action in ("stop_job", "adopt", "start_training"):
            assert app.check_action(action, ()) is None
        assert app.check_action("resync", ()) is True  # r retries at once while disconnected (tests/console/test_console_habits.py)
        assert "stop, stop & bench, resume, grok, adopt and start are disabled" in banner_text(app)
        await pilot.press("s")
        await pilot.pause()
        assert not isinstance(app.screen, StopModal)
        assert app.state.actions[-1][1] == "Stop job is disabled: disconnected from the host"

        await wait_until(lambda: app.state.connection.connected and app.state.hello.agent_pid != agent_pid, what="the reconnect")
        await wait_until(lambda: app.state.jobs.get("keeps-running") and app.state.jobs["keeps-running"].state == "running", what="re-attached")
        assert pid_alive(job["pid"]) and app.check_action("stop_job", ()) is True
        await pilot.pause()
        assert "connected" in banner_text(app)
        await stop_everything(app)


# -- screens that say only what is true (issue 12) -------------------------------------------------


def one_pid_plan(job: str) -> dict:
    return {
        "jobs": [job],
        "will_signal": [{"pid": 1234, "job": job, "cmdline": "python -m backend train", "role": "leader"}],
        "stale": [],
        "foreign_gpu_holders": [],
        "checkpoint_first": True,
    }


def state_with_a_job_in_setup():
    """The frozen host plus `train-setup`: a training job whose (loaded) metrics hold no record yet."""
    state = frozen_state()
    state.jobs["train-setup"] = dataclasses.replace(state.jobs["train-kimi"], name="train-setup", pid=1300, pgid=1300)
    state.apply_metrics_history("train-setup", {"records": [], "offset": 0}, reset=True)
    return state


def test_the_pid_count_agrees_with_its_noun():
    assert [pids_phrase(n) for n in (0, 1, 2)] == ["No PID gets", "This PID gets", "These 2 PIDs get"]
    assert str(stop_plan_text(one_pid_plan("t"), 30.0)).startswith("This PID gets SIGTERM, then SIGKILL")
    assert str(stop_plan_text(STOP_PLAN, 30.0)).startswith("These 2 PIDs get SIGTERM")


def test_checkpoint_first_says_what_the_trainer_will_really_do():
    state = state_with_a_job_in_setup()
    assert training_phases(state, ["train-kimi", "train-setup", "bench-old", "gone"]) == {"train-kimi": True, "train-setup": False}
    del state.metrics["train-setup"]
    assert training_phases(state, ["train-setup"]) == {"train-setup": None}  # metrics not loaded yet: not known
    assert str(checkpoint_line(STOP_PLAN, {"train-kimi": True})).startswith("Checkpoint first: YES")
    setup = str(checkpoint_line(STOP_PLAN, {"train-setup": False}))
    assert setup.startswith("Checkpoint first: NO") and "WITHOUT a checkpoint" in setup and "YES" not in setup
    unknown = str(checkpoint_line(STOP_PLAN, {"train-setup": None}))
    assert unknown.startswith("Checkpoint first: only if training steps have begun") and "during setup" in unknown
    assert str(checkpoint_line(STOP_PLAN, None)) == unknown  # callers without the console state (the bench plan)
    assert str(checkpoint_line({**STOP_PLAN, "checkpoint_first": False}, None)).startswith("Checkpoint first: no")


async def test_stop_modal_for_a_job_in_setup_promises_no_checkpoint_and_counts_one_pid():
    app = build_app(state=state_with_a_job_in_setup(), poll_interval=None, refresh_throttle=0)
    async with app.run_test(size=SIZE) as pilot:
        app.push_screen(StopModal("train-setup", one_pid_plan("train-setup"), 30.0))
        await pilot.pause()
        text = str(app.screen.query_one("#stop-plan").render())
        assert "This PID gets SIGTERM" in text and "1 PIDs" not in text
        assert "Checkpoint first: NO" in text and "Checkpoint first: YES" not in text
        assert str(app.screen.query_one("#confirm").label) == "Stop 1 PID (y)"


async def test_logs_title_counts_the_lines_shown_not_every_poll_that_re_read_them():
    assert TAIL_LINES == LOG_TAIL_LINES
    state = frozen_state()
    for _ in range(8):  # the stream that is not followed live is re-read on every poll
        state.log("train-kimi", "stderr").replace(["a", "b", "c", "d"])
    app = build_app(state=state, poll_interval=None, refresh_throttle=0)
    async with app.run_test(size=SIZE) as pilot:
        app.select_job("train-kimi")
        await pilot.press("3")
        await pilot.pause()
        title = str(app.screen.query_one("#logs-title").render())
        assert "stderr 4 lines" in title and "stdout 40 lines" in title and "32" not in title
        assert app.screen.query_one("#log-stderr").line_count == 4
    assert lines_label("stdout", None) == "stdout 0 lines"


async def test_palette_hints_show_each_key_once_and_plainly():
    app = frozen_app()
    async with app.run_test(size=SIZE) as pilot:
        app.select_job("train-kimi")
        await pilot.press("ctrl+p")
        palette = await screen_shown(app, CommandPalette, "the palette")
        await wait_until(lambda: palette.query_one(CommandList).option_count > 0, what="palette entries")
        options = palette.query_one(CommandList)
        shown = "\n".join(str(options.get_option_at_index(i).prompt) for i in range(options.option_count))
        assert "key [ · select the previous job" in shown and "key ] · select the next job" in shown
        assert "key n · start a training job" in shown and "key s · stop the selected job" in shown
        assert "[[]" not in shown and "[]]" not in shown


async def test_stop_modal_of_a_real_training_job_still_in_setup_says_no_checkpoint(tmp_path):
    app = live_app(tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        await connected(app)
        setup = [sys.executable, "-c", "import time; time.sleep(600)"]  # a trainer that has not reached its first step
        await app.client.request(Request.START_JOB, name="in-setup", kind="train", argv=setup)
        await wait_until(lambda: "in-setup" in app.state.jobs, what="the job listed")
        app.select_job("in-setup")
        await wait_until(lambda: app.state.metrics.get("in-setup") and app.state.metrics["in-setup"].history_loaded, what="its (empty) metrics loaded")
        await pilot.press("s")
        modal = await screen_shown(app, StopModal, "the stop modal")
        text = str(modal.query_one("#stop-plan").render())
        assert "This PID gets SIGTERM" in text and "Checkpoint first: NO" in text and "in-setup has logged no training step" in text
        await pilot.press("escape")
        await stop_everything(app)


# -- operator conventions: --readonly, resume from the stop's checkpoint, --notify; holders grouped per job ----------


class FakeClient:
    """Answers the requests a stop and a resume make, as the agent would; records what was sent."""

    def __init__(self, checkpoints_after: list[dict]):
        self.sent: list[tuple[str, dict]] = []
        self.listings = [[{"path": "/r/jobs/train-kimi/checkpoints/epoch_1_step_2000", "epoch": 1, "step": 2000, "latest": True}], checkpoints_after]

    async def request(self, kind, /, timeout=None, **params):
        self.sent.append((kind, params))
        if kind == Request.STOP_PLAN:
            return STOP_PLAN
        if kind == Request.LIST_CHECKPOINTS:
            return {"checkpoints": self.listings.pop(0) if len(self.listings) > 1 else self.listings[0]}
        if kind == Request.STOP_JOB:
            return {"verdicts": [{"pid": 1234, "outcome": "exited_on_term"}]}
        if kind == Request.START_JOB:
            return {
                "job": {
                    "name": params["name"],
                    "kind": "train",
                    "state": "running",
                    "pid": 777,
                    "pgid": 777,
                    "start_time_ticks": 1,
                    "argv": params["argv"],
                    "job_dir": "/r/jobs/x",
                    "stdout_path": "o",
                    "stderr_path": "e",
                    "started_at": 1.0,
                }
            }
        if kind == Request.SNAPSHOT:
            return {}
        if kind == Request.HOLDERS:
            return {"holders": []}
        return {}

    def pending_kinds(self):
        return []

    async def close(self):
        return None


NEW_CKPT = "/r/jobs/train-kimi/checkpoints/epoch_2_step_4012"


async def test_a_stop_that_wrote_a_checkpoint_offers_one_key_to_resume_from_it():
    app = frozen_app()
    async with app.run_test(size=SIZE) as pilot:
        app.select_job("train-kimi")
        await pilot.pause()
        client = FakeClient(
            [
                {"path": "/r/jobs/train-kimi/checkpoints/epoch_1_step_2000", "epoch": 1, "step": 2000, "latest": False},
                {"path": NEW_CKPT, "epoch": 2, "step": 4012, "latest": True},
            ]
        )
        app.client = client
        assert app.disabled_reason("resume") == "no stop has written a checkpoint yet"
        await pilot.press("s")
        await screen_shown(app, StopModal, "the stop modal")
        await pilot.press("y")
        await wait_until(lambda: app.resume_target is not None, what="the checkpoint the stop wrote")
        assert any(line == f"stop train-kimi: 1234 exited_on_term; it wrote {NEW_CKPT}: press c to resume from it" for _, line in app.state.actions)
        assert app.disabled_reason("resume") is None
        await pilot.press("c")
        await screen_shown(app, ResumeModal, "the resume modal")
        argv = ["eagle3-host", "train", "--profile", "tiny", "--resume", NEW_CKPT]
        assert app.screen.argv == argv and " ".join(argv) in str(app.screen.query_one("#resume-plan").render())
        await pilot.press("y")
        await wait_until(lambda: any(kind == Request.START_JOB for kind, _ in client.sent), what="start_job")
        start = next(params for kind, params in client.sent if kind == Request.START_JOB)
        assert start == {"name": "resume-epoch-2-step-4012", "kind": "train", "argv": argv}
        await wait_until(lambda: app.selected_job == "resume-epoch-2-step-4012", what="the new job selected")


async def test_resuming_a_grok_run_keeps_its_own_schedule_weight_decay_and_max_steps():
    """The grok run had constant LR, weight decay 0.1 and 600 steps: its resume must not fall back to the profile's."""
    app = frozen_app()
    grok = ["eagle3-host", "train", "--profile", "tiny", "--resume", "/r/jobs/train-kimi/checkpoints/epoch_1_step_2000", "--schedule", "constant"]
    grok += ["--lr", "0.0003", "--weight-decay", "0.1", "--grokfast-alpha", "0.98", "--max-steps", "600", "--out=/r/jobs/old"]
    app.state.jobs["train-kimi"] = dataclasses.replace(app.state.jobs["train-kimi"], argv=grok)
    async with app.run_test(size=SIZE) as pilot:
        app.select_job("train-kimi")
        await pilot.pause()
        client = FakeClient([{"path": NEW_CKPT, "epoch": 2, "step": 4012, "latest": True}])
        app.client = client
        await pilot.press("s")
        await screen_shown(app, StopModal, "the stop modal")
        await pilot.press("y")
        await wait_until(lambda: app.resume_target is not None, what="the checkpoint the stop wrote")
        await pilot.press("c")
        await screen_shown(app, ResumeModal, "the resume modal")
        assert app.screen.argv == [
            *["eagle3-host", "train", "--profile", "tiny", "--resume", NEW_CKPT, "--schedule", "constant"],
            *["--lr", "0.0003", "--weight-decay", "0.1", "--grokfast-alpha", "0.98", "--max-steps", "600"],
        ]


async def test_the_jobs_tables_loss_column_is_train_loss_even_when_a_val_record_came_last():
    app = frozen_app()
    async with app.run_test(size=(170, 45)) as pilot:
        app.select_job("train-kimi")
        metrics = app.state.metrics["train-kimi"]
        train_loss = metrics.latest_train["loss"]
        metrics.add({"split": "val", "step": 4000, "loss": 9.5})
        app.state_changed({"metrics"})
        app.redraw_now()
        await pilot.pause()
        table = app.screen.query_one("#jobs", DataTable)
        labels = [str(c.label) for c in table.ordered_columns]
        row = dict(zip(labels, (str(cell) for cell in table.get_row_at(0))))
        assert row["train loss"] == f"{train_loss:.4g}" and "loss" not in labels


async def test_logs_follow_the_stream_the_job_writes_to_and_a_finished_job_opens_at_its_tail():
    app = frozen_app()
    lines = [f"bench line {i}" for i in range(300)]
    app.state.apply({"type": "log", "job": "bench-old", "stream": "stdout", "lines": lines})
    async with app.run_test(size=SIZE) as pilot:
        app.select_job("train-kimi")  # the trainer logs to stderr: that is the followed stream, with two thirds of the room
        await pilot.press("3")
        await pilot.pause()
        assert app.log_stream == "stderr"
        stdout, stderr = app.screen.query_one("#log-stdout"), app.screen.query_one("#log-stderr")
        assert stderr.size.height > stdout.size.height
        assert "stderr (followed live)" in str(app.screen.query_one("#title-stderr").render())
        await pilot.press("o")
        await pilot.pause()
        assert app.log_stream == "stdout" and stdout.size.height > stderr.size.height
        await pilot.press("1")
        app.select_job("bench-old")  # a bench prints to stdout; it has ended: its log opens at the tail, not the head
        await pilot.pause()
        await pilot.press("3")
        await pilot.pause()
        await pilot.pause()
        assert app.log_stream == "stdout"
        log = app.screen.query_one("#log-stdout")
        assert log.line_count == 300 and log.max_scroll_y > 0 and log.scroll_y == log.max_scroll_y


async def test_every_screen_names_itself_and_with_no_jobs_says_n_starts_one():
    from console.state import ConsoleState
    from textual.widgets._header import HeaderTitle

    app = build_app(state=ConsoleState(target="gpu-host"), poll_interval=None, refresh_throttle=0)
    names = {"1": "Dashboard (1)", "2": "Training (2)", "3": "Logs (3)", "4": "Grokking (4)", "5": "Stop & bench (5)"}  # 6: Hosts, with several hosts
    async with app.run_test(size=SIZE) as pilot:
        for key, name in names.items():
            await pilot.press(key)
            await pilot.pause()
            assert f"eagle3-console · {name}" in str(app.screen.query_one(HeaderTitle).render()), key
            if key in "234":
                title = {"2": "#training-title", "3": "#logs-title", "4": "#grok-title"}[key]
                assert "no jobs yet: n starts a training run" in str(app.screen.query_one(title).render())
        await pilot.press("1")
        await pilot.pause()
        assert "no jobs yet: n starts a training run" in str(app.screen.query_one("#latest").render())


async def test_a_job_that_exits_non_zero_shows_its_last_stderr_line_as_the_reason(tmp_path):
    """A host Python without torch: "exited 1" alone said nothing; the job's last stderr line says why."""
    app = live_app(tmp_path)
    crash = "import sys; print('loading the target', file=sys.stderr); sys.exit(\"ModuleNotFoundError: No module named 'torch'\")"
    async with app.run_test(size=(170, 45)) as pilot:
        await connected(app)
        await app.client.request(Request.START_JOB, name="no-torch", kind="train", argv=[sys.executable, "-c", crash])
        await wait_until(lambda: app.state.exit_reasons.get("no-torch"), timeout=30, what="the exit reason")
        app.select_job("no-torch")
        app.redraw_now()
        await pilot.pause()
        table = app.screen.query_one("#jobs", DataTable)
        row = [str(cell) for cell in table.get_row_at(table.get_row_index(next(k for k in table.rows if k.value.endswith("no-torch"))))]
        assert row[-1] == "exit 1: ModuleNotFoundError: No module named 'torch'"
        assert "exit 1: ModuleNotFoundError: No module named 'torch'" in str(app.screen.query_one("#latest").render())
        assert any(line == "no-torch exited 1: ModuleNotFoundError: No module named 'torch'" for _, line in app.state.actions)


async def test_the_palettes_screenshot_works_without_a_downloads_dir(tmp_path, monkeypatch):
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.delenv("XDG_DOWNLOAD_DIR", raising=False)
    monkeypatch.delenv("XDG_CONFIG_HOME", raising=False)
    app = frozen_app()
    async with app.run_test(size=SIZE) as pilot:
        app.deliver_screenshot("shot.svg")
        await wait_until(lambda: (home / "shot.svg").exists(), timeout=10, what="the screenshot in the home dir")
        await pilot.pause()
    assert not (home / "Downloads").exists() and "eagle3-console" in (home / "shot.svg").read_text()


async def test_the_metrics_panel_never_says_epoch_none_and_rounds_a_fractional_epoch():
    app = frozen_app()
    async with app.run_test(size=SIZE) as pilot:
        app.select_job("train-kimi")
        metrics = app.state.metrics["train-kimi"]
        for epoch, shown in ((None, "epoch -"), (1.3125, "epoch 1.31"), (2, "epoch 2")):
            metrics.add({"split": "train", "step": 4100, "epoch": epoch, "loss": 1.5})
            app.state_changed({"metrics"})
            app.redraw_now()
            await pilot.pause()
            panel = str(app.screen.query_one("#latest").render())
            assert f"step 4100  {shown}\n" in panel, panel


async def test_the_stop_modal_cuts_a_long_command_line_after_a_whole_word():
    long = "python -m backend train --profile kimi-k2.5 --data /data/shards/kimi --max-steps 40000 --eval-interval 500 --seed 7"
    plan = {**STOP_PLAN, "will_signal": [{"pid": 1234, "job": "train-kimi", "cmdline": long, "role": "leader"}]}
    app = frozen_app()
    async with app.run_test(size=SIZE) as pilot:
        app.push_screen(StopModal("train-kimi", plan, 30.0))
        await pilot.pause()
        shown = str(app.screen.query_one("#stop-plan").render())
        assert "python -m backend train --profile kimi-k2.5 --data /data/shards/kimi --max-steps 40000 …\n" in shown


async def test_question_mark_lists_every_key_and_slash_filters_the_jobs_table():
    from console.screens.help import HelpModal

    app = frozen_app()
    async with app.run_test(size=SIZE) as pilot:
        app.select_job("train-kimi")
        await pilot.pause()
        await pilot.press("question_mark")
        modal = await screen_shown(app, HelpModal, "the help screen")
        keys = plain(modal.text)
        for action in ACTIONS:
            if action.name not in MULTI_HOST_ACTIONS:
                assert re.search(rf"^ *{re.escape(action.key)} {re.escape(action.label)} ", keys, re.MULTILINE), action.name
        assert "+ - , . 0" in keys and "Dashboard (1)" in keys and "(off: no host connection)" in keys
        await pilot.press("question_mark")
        await pilot.pause()
        assert isinstance(app.screen, DashboardScreen)
        table = app.screen.query_one("#jobs", DataTable)
        assert table.row_count == 2
        await pilot.press("slash")
        await pilot.pause()
        await pilot.press(*"bench")
        await pilot.pause()
        assert table.row_count == 1 and str(table.get_row_at(0)[0]) == "bench-old"
        assert "filter 'bench': 1 of 2" in str(app.screen.query_one("#jobs-title").render())
        await pilot.press("enter")  # keeps the filter, back to the table
        await pilot.pause()
        assert table.row_count == 1 and app.focused is table
        await pilot.press("slash")
        await pilot.press("escape")  # clears it
        await pilot.pause()
        assert table.row_count == 2 and str(app.screen.query_one("#jobs-title").render()) == "Jobs"


async def test_a_stop_without_a_new_checkpoint_offers_no_resume():
    app = frozen_app()
    async with app.run_test(size=SIZE) as pilot:
        app.select_job("train-kimi")
        await pilot.pause()
        app.client = FakeClient([{"path": "/r/jobs/train-kimi/checkpoints/epoch_1_step_2000", "epoch": 1, "step": 2000, "latest": True}])
        await pilot.press("s")
        await screen_shown(app, StopModal, "the stop modal")
        await pilot.press("y")
        await wait_until(lambda: app.state.actions[-1][1].startswith("stop train-kimi:"), what="the stop verdicts")
        assert "no new checkpoint was written (the latest is still" in app.state.actions[-1][1]
        assert app.resume_target is None
        await pilot.press("c")
        await pilot.pause()
        assert not isinstance(app.screen, ResumeModal)
        assert "Resume ckpt is disabled: no stop has written a checkpoint yet" in app.state.actions[-1][1]


def test_resume_argv_lives_beside_grok_argv():
    from backend.commands import resume_argv, resume_job_name

    assert resume_argv("kimi-k2.5", "/x/checkpoints/epoch_0_step_300/") == [
        "eagle3-host",
        "train",
        "--profile",
        "kimi-k2.5",
        "--resume",
        "/x/checkpoints/epoch_0_step_300",
    ]
    assert resume_job_name("/x/checkpoints/epoch_0_step_300") == "resume-epoch-0-step-300"


async def test_readonly_disables_and_hides_every_destructive_action():
    app = build_app(state=frozen_state(), poll_interval=None, refresh_throttle=0, readonly=True)
    async with app.run_test(size=SIZE) as pilot:
        app.select_job("train-kimi")
        await pilot.pause()
        assert "READ-ONLY" in banner_text(app)
        destructive = [a for a in ACTIONS if a.destructive]
        assert {a.name for a in destructive} == {"start_training", "start_multinode", "stop_job", "stop_and_bench", "resume", "grok", "adopt"}
        for action in destructive:
            assert app.check_action(action.name, ()) is False  # hidden, not greyed
            assert app.disabled_reason(action.name) == "read-only console (--readonly)"
        await pilot.press("s")
        await pilot.pause()
        assert not isinstance(app.screen, StopModal)
        assert "Stop job is disabled: read-only console (--readonly)" in app.state.actions[-1][1]
        await app.run_console_action("adopt")  # the palette's entry point refuses too
        assert not isinstance(app.screen, AdoptModal)
        await pilot.press("ctrl+p")
        await pilot.pause()
        palette = app.screen
        assert isinstance(palette, CommandPalette)
        await pilot.pause(0.3)
        titles = [str(option.prompt) for option in palette.query_one(CommandList).options]
        joined = "\n".join(titles)
        for action in destructive:
            assert action.label not in joined
        assert "Resync" in joined and "Watch run" in joined


async def test_notify_sends_bell_and_osc_9_and_777_on_each_alert_once():
    app = build_app(state=frozen_state(), poll_interval=None, refresh_throttle=0, notify_terminal=True)
    async with app.run_test(size=SIZE) as pilot:
        app.handle_event({"type": "jobs", "jobs": [job_wire("train-a", "running")]})  # the first list: no news
        app.handle_event({"type": "jobs", "jobs": [job_wire("train-a", "running")]})
        assert app.alerting.terminal_writes == []
        app.handle_event({"type": "jobs", "jobs": [job_wire("train-a", "exited", 1)]})
        assert len(app.alerting.terminal_writes) == 1
        sent = app.alerting.terminal_writes[0]
        assert sent.startswith("\a") and "\x1b]9;eagle3: job train-a exited with exit code 1\x07" in sent
        assert "\x1b]777;notify;eagle3-console;job train-a exited with exit code 1\x07" in sent
        app.handle_event({"type": "jobs", "jobs": [job_wire("train-a", "exited", 1)]})
        assert len(app.alerting.terminal_writes) == 1

        app.handle_event(
            {
                "type": "stages",
                "job": "chain-train-a",
                "records": [{"stage": "canary", "status": "failed", "time": 5.0, "elapsed": 1.0, "detail": "canary RED: accept length 1.00; zero acceptance"}],
            }
        )
        assert "canary RED in chain-train-a" in app.alerting.terminal_writes[-1] and len(app.alerting.terminal_writes) == 2

        app.state.signals["train-a"] = {"onset": {"detected": True, "step": 14000}}
        app.state_changed({"signals"})
        app.state_changed({"signals"})
        assert "grokking onset in train-a at step 14000" in app.alerting.terminal_writes[-1] and len(app.alerting.terminal_writes) == 3

        disk = {"path": "/root/.eagle3", "label": "run_dir", "total_bytes": 100, "used_bytes": 95, "free_bytes": 5}
        app.handle_event({"type": "disk", "disks": [disk]})
        app.handle_event({"type": "disk", "disks": [disk]})
        assert "disk low: run_dir /root/.eagle3 (95% used)" in app.alerting.terminal_writes[-1] and len(app.alerting.terminal_writes) == 4
        await pilot.pause()


async def test_without_notify_alerts_stay_in_the_console():
    app = frozen_app()
    async with app.run_test(size=SIZE) as pilot:
        app.handle_event({"type": "jobs", "jobs": [job_wire("train-a", "running")]})
        app.handle_event({"type": "jobs", "jobs": [job_wire("train-a", "stopped")]})
        await pilot.pause()
        assert app.alerting.terminal_writes == [] and app.alerting.alerts == ["job train-a stopped"]


def test_an_h200_training_job_with_17_compile_workers_is_one_holder_row():
    from console.widgets.gpu_panel import gpu_text
    from tests.fixtures.console_states import compile_workers_state

    state = compile_workers_state(17)
    collapsed = gpu_text(state).plain
    assert collapsed.count("train-kimi pid 1234") == 1 and "pid 1305" not in collapsed
    assert "(+17 workers, 1 uses 512 MiB; h shows them)" in collapsed
    assert "60.0 GiB" in collapsed
    expanded = gpu_text(state, expanded=True).plain
    assert expanded.count("└ pid ") == 17 and "└ pid 1300 " in expanded
    lines = [line for line in expanded.splitlines() if "└ pid 1301 " in line]
    assert lines and lines[0].endswith("no GPU memory")


async def test_h_expands_and_collapses_the_workers_on_the_dashboard():
    from tests.fixtures.console_states import compile_workers_state

    app = build_app(state=compile_workers_state(5), poll_interval=None, refresh_throttle=0)
    async with app.run_test(size=SIZE) as pilot:
        panel = app.screen.query_one("#gpus")
        assert "└ pid" not in str(panel.render())
        await pilot.press("h")
        await pilot.pause()
        assert str(panel.render()).count("└ pid") == 5
        await pilot.press("h")
        await pilot.pause()
        assert "└ pid" not in str(panel.render())


async def test_a_worker_that_fails_without_a_message_still_says_what_failed():
    app = frozen_app()
    async with app.run_test(size=SIZE) as pilot:

        async def times_out():
            raise asyncio.TimeoutError()

        app.run_worker(times_out(), name="load train-kimi", group="job:local", exit_on_error=False)
        await wait_until(lambda: app.state.actions and "failed" in app.state.actions[-1][1], what="the failure note")
        assert app.state.actions[-1][1] == "load train-kimi failed: TimeoutError (no message)"
        await pilot.pause()
