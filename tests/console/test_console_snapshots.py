"""Snapshot tests of each screen with frozen data: fixed clock, no live timers, no cursor blink, UTC.

Regenerate the baselines with `pytest tests/console/test_console_snapshots.py --snapshot-update` and commit
tests/console/__snapshots__/test_console_snapshots/*.svg.
"""

import pytest
from textual.widgets import Input

from console.app import build_app
from console.screens.modals import AdoptModal, ResumeModal, StopModal
from console.state import RECONNECTING, ConnectionStatus, ConsoleState
from backend.protocol import GpuHolder
from tests.fixtures.console_states import NOW, STOP_PLAN, compile_workers_state, frozen_state

SIZE = (160, 48)


def frozen_app(state: ConsoleState | None = None):
    app = build_app(state=state or frozen_state(), poll_interval=None, refresh_throttle=0)
    return app


pytestmark = pytest.mark.usefixtures("utc")  # snapshot clocks read in UTC (tests/conftest.py)


async def select_and_draw(pilot, *keys: str) -> None:
    app = pilot.app
    app.select_job("train-kimi")
    await pilot.pause()
    for key in keys:
        await pilot.press(key)
        await pilot.pause()
    app.redraw_now()
    await pilot.pause()


def test_dashboard(snap_compare):
    assert snap_compare(frozen_app(), terminal_size=SIZE, run_before=select_and_draw)


def test_dashboard_disconnected_shows_stale_data(snap_compare):
    state = frozen_state()
    state.set_connection(
        ConnectionStatus(
            state=RECONNECTING,
            detail="reconnect attempt 2 failed: cannot reach gpu-host: [Errno 111] Connection refused",
            since=NOW - 1,
            attempt=3,
            retry_in=2.0,
        )
    )
    assert snap_compare(frozen_app(state), terminal_size=SIZE, run_before=select_and_draw)


def test_dashboard_without_nvidia_driver(snap_compare):
    assert snap_compare(frozen_app(frozen_state(gpus=False)), terminal_size=SIZE, run_before=select_and_draw)


def test_training(snap_compare):
    async def run_before(pilot):
        await select_and_draw(pilot, "2")

    assert snap_compare(frozen_app(), terminal_size=SIZE, run_before=run_before)


def test_training_log_axes_and_ema(snap_compare):
    async def run_before(pilot):
        await select_and_draw(pilot, "2", "x", "y", "e")

    assert snap_compare(frozen_app(), terminal_size=SIZE, run_before=run_before)


def test_logs(snap_compare):
    async def run_before(pilot):
        await select_and_draw(pilot, "3")

    assert snap_compare(frozen_app(), terminal_size=SIZE, run_before=run_before)


def test_stop_modal(snap_compare):
    async def run_before(pilot):
        await select_and_draw(pilot)
        pilot.app.push_screen(StopModal("train-kimi", STOP_PLAN, 30.0))
        await pilot.pause()

    assert snap_compare(frozen_app(), terminal_size=SIZE, run_before=run_before)


def test_adopt_modal_with_a_mistyped_pid(snap_compare):
    async def run_before(pilot):
        await select_and_draw(pilot)
        foreign = [GpuHolder(pid=448, owned=False, user="bob", cmdline="python3 serve.py --port 8000", used_memory_mib=40960.0)]
        pilot.app.push_screen(AdoptModal(foreign, 448))
        await pilot.pause()
        for widget in pilot.app.screen.query(Input):
            widget.cursor_blink = False
        await pilot.press("4", "4", "9", "enter")
        await pilot.pause()

    assert snap_compare(frozen_app(), terminal_size=SIZE, run_before=run_before)


def test_dashboard_groups_a_jobs_compile_workers_under_its_row(snap_compare):
    assert snap_compare(frozen_app(compile_workers_state()), terminal_size=SIZE, run_before=select_and_draw)


def test_dashboard_workers_expanded(snap_compare):
    async def run_before(pilot):
        await select_and_draw(pilot, "h")

    assert snap_compare(frozen_app(compile_workers_state(3)), terminal_size=SIZE, run_before=run_before)


def test_dashboard_readonly(snap_compare):
    app = build_app(state=frozen_state(), poll_interval=None, refresh_throttle=0, readonly=True)
    assert snap_compare(app, terminal_size=SIZE, run_before=select_and_draw)


def test_resume_modal(snap_compare):
    async def run_before(pilot):
        await select_and_draw(pilot)
        checkpoint = "/root/.eagle3/jobs/train-kimi/checkpoints/epoch_2_step_4012"
        pilot.app.push_screen(
            ResumeModal("train-kimi", checkpoint, "resume-epoch-2-step-4012", ["eagle3-host", "train", "--profile", "kimi-k2.5", "--resume", checkpoint])
        )
        await pilot.pause()

    assert snap_compare(frozen_app(), terminal_size=SIZE, run_before=run_before)
