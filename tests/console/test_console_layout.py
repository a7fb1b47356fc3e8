"""Layout at 100x30 and 170x45: every key of every screen is on screen in the footer, tables keep their key columns,
and snapshots of Dashboard, Training, Logs, Grokking and Bench result, every modal, the ? help and a filtered
Dashboard at both sizes (frozen data and time)."""

import pytest
from textual.widgets import DataTable, Footer
from textual.widgets._footer import FooterKey

from console.actions import ACTIONS, MULTI_HOST_ACTIONS
from console.app import build_app
from console.screens.help import HelpModal
from console.widgets.hosts import NARROW_WIDTH
from tests.fixtures.console_states import chain_records, chain_state
from tests.fixtures.console_states import GROK_JOB, grok_state
from tests.fixtures.console_states import multinode_states
from tests.fixtures.console_states import frozen_state
from tests.fixtures.ssh import screen_shown

SIZES = [(100, 30), (170, 45)]
SCREENS = {"1": "dashboard", "2": "training", "3": "logs", "4": "grokking", "5": "chain"}
SCREEN_KEYS = {
    "dashboard": {"h", "/", ">", "<", "u"},
    "training": {"x", "y", "e", "o", "t", "+", "-", ",", ".", "0"},
    "logs": {"f", "o", "/"},
    "grokking": {"t", "+", "-", ",", ".", "0"},
    "chain": set(),
}
APP_KEYS = {a.key for a in ACTIONS if a.screen is None and a.name not in MULTI_HOST_ACTIONS}  # a one-host console's keys
MULTI_HOST_KEYS = {a.key for a in ACTIONS if a.name in MULTI_HOST_ACTIONS}
MULTI_HOST_SCREENS = {"1": "dashboard", "6": "hosts"}


pytestmark = pytest.mark.usefixtures("utc")  # snapshot clocks read in UTC (tests/conftest.py)


def app_for(screen: str, **kwargs):
    state = grok_state() if screen == "grokking" else chain_state(chain_records()) if screen == "chain" else frozen_state()
    return build_app(state=state, poll_interval=None, refresh_throttle=0, **kwargs)


def job_for(screen: str) -> str:
    return GROK_JOB if screen == "grokking" else "train-kimi"


async def show(pilot, key: str) -> None:
    app = pilot.app
    app.select_job(job_for(SCREENS[key]))
    await pilot.pause()
    await pilot.press(key)
    await pilot.pause()
    app.redraw_now()
    await pilot.pause()
    await pilot.wait_for_scheduled_animations()
    for plot in app.screen.query("CurvePlot"):  # replot at the settled size: a plot picks its ticks from its width
        plot._drawn_key = None
        plot.replot()
    await pilot.pause()
    await pilot.pause()


def visible_footer_keys(app) -> set[str]:
    """Keys whose footer entry lies wholly inside the terminal and is not covered by the docked palette key."""
    footer = app.screen.query_one(Footer)
    width = app.screen.size.width
    palette = [k.region for k in footer.query(FooterKey) if k.has_class("-command-palette")]
    shown = set()
    for key in footer.query(FooterKey):
        region = key.region
        if key.has_class("-command-palette") or region.width == 0 or region.right > width:
            continue
        if any(region.overlaps(p) for p in palette):
            continue
        shown.add(key.key_display)
    return shown


@pytest.mark.parametrize("size", SIZES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("key", list(SCREENS))
async def test_every_key_is_in_the_footer(size, key):
    app = app_for(SCREENS[key])
    async with app.run_test(size=size) as pilot:
        await show(pilot, key)
        assert getattr(app.screen, "MODE", None) == SCREENS[key]
        shown = visible_footer_keys(app)
        missing = (APP_KEYS | SCREEN_KEYS[SCREENS[key]]) - shown
        assert not missing, f"{SCREENS[key]} at {size}: keys not on screen: {sorted(missing)} (shown {sorted(shown)})"
        footer = app.screen.query_one(Footer)
        assert footer.region.height <= 2 and footer.region.bottom == size[1]


@pytest.mark.parametrize("size", SIZES, ids=lambda s: f"{s[0]}x{s[1]}")
async def test_the_jobs_table_keeps_its_key_columns(size):
    app = app_for("dashboard")
    async with app.run_test(size=size) as pilot:
        await show(pilot, "1")
        table = app.screen.query_one("#jobs", DataTable)
        right = table.region.right
        x = table.region.x
        labels = []
        for column in table.ordered_columns:
            label = " ".join(str(column.label).split())  # a narrow table's header takes two lines ("train\nloss")
            labels.append(label)
            if label in ("job", "state", "cpu%", "rss", "exit", "step", "train loss"):
                assert x + column.get_render_width(table) <= right, f"{label} column cut at {size}"
            if label == "detail":  # room for "exit 0"; the selected job's whole exit reason is in Latest metrics
                assert x + 6 <= right, f"no room for the detail column at {size}"
            x += column.get_render_width(table)
        assert {"job", "state", "cpu%", "rss", "exit", "step", "train loss", "detail"} <= set(labels)
        assert "pid" in labels or size[0] < NARROW_WIDTH  # the stop modal shows the pids; a narrow table drops them


async def test_readonly_hides_every_destructive_key_from_the_footer():
    app = app_for("dashboard", readonly=True)
    async with app.run_test(size=(100, 30)) as pilot:
        await show(pilot, "1")
        shown = visible_footer_keys(app)
        destructive = {a.key for a in ACTIONS if a.destructive}
        assert destructive == {"n", "m", "s", "b", "c", "g", "a"}
        assert not shown & destructive and {"1", "w", "r", "q", "h"} <= shown


# -- snapshots: each screen at both sizes ----------------------------------------------------------


# Every case is strict: curve_plot hands plotext only tick labels that cannot touch, so none depends on the set order
# plotext places them in (PYTHONHASHSEED; tests/console/test_console_plotting.py draws every label at every width).
SNAPSHOT_CASES = [pytest.param(key, size, id=f"{SCREENS[key]}-{size[0]}x{size[1]}") for key in SCREENS for size in SIZES]


@pytest.mark.parametrize("key,size", SNAPSHOT_CASES)
def test_screen_snapshot(snap_compare, key, size):
    async def run_before(pilot):
        await show(pilot, key)

    assert snap_compare(app_for(SCREENS[key]), terminal_size=size, run_before=run_before)


# -- the modals at both sizes: every plan and form fits, its buttons on screen --------------------------------------

CHECKPOINT = "/root/.eagle3/jobs/train-kimi/checkpoints/epoch_1_step_3000"


def modal_for(name: str):
    """Each modal as its flow opens it on the frozen state's train-kimi (plans and forms as the flows build them)."""
    from backend.commands import chain_argv
    from backend.protocol import GpuHolder
    from console.screens.grok_modal import GrokModal
    from console.screens.modals import AdoptModal, ResumeModal, StopAndBenchModal, StopModal, WatchModal, bench_plan_text
    from console.screens.unwatch_modal import UnwatchModal
    from tests.fixtures.console_states import STOP_PLAN

    checkpoints = [{"path": CHECKPOINT, "epoch": 1, "step": 3000, "latest": True}]
    if name == "stop":
        return StopModal("train-kimi", STOP_PLAN, 30.0)
    if name == "stop-and-bench":
        text = bench_plan_text(
            "train-kimi", STOP_PLAN, checkpoints, True, "sglang", "serve.engine of profile kimi-k2.5", 120.0, "1,4", 8, chain_argv("train-kimi")
        )
        return StopAndBenchModal("train-kimi", text, can_start=True)
    if name == "resume":
        return ResumeModal("train-kimi", CHECKPOINT, "resume-epoch-1-step-3000", ["eagle3-host", "train", "--profile", "kimi-k2.5", "--resume", CHECKPOINT])
    if name == "adopt":
        foreign = [GpuHolder(pid=448, owned=False, user="bob", cmdline="python3 serve.py --port 8000", used_memory_mib=40960.0)]
        return AdoptModal(foreign, 448)
    if name == "watch":
        return WatchModal()
    if name == "grok":
        return GrokModal("train-kimi", "kimi-k2.5", checkpoints, lr=1e-4, weight_decay=0.1, taken={"train-kimi"})
    assert name == "unwatch"
    return UnwatchModal("ext:specforge", "/data/sf/runs")


MODALS = ["stop", "stop-and-bench", "resume", "adopt", "watch", "grok", "unwatch"]
MODAL_CASES = [pytest.param(name, size, id=f"{name}-{size[0]}x{size[1]}") for name in MODALS for size in SIZES]


@pytest.mark.parametrize("name,size", MODAL_CASES)
async def test_every_modals_buttons_are_on_screen(name, size):
    app = app_for("dashboard")
    async with app.run_test(size=size) as pilot:
        app.select_job("train-kimi")
        await pilot.pause()
        app.push_screen(modal_for(name))
        await pilot.pause()
        await pilot.pause()
        buttons = list(app.screen.query("Button"))
        assert buttons, f"{name}: no buttons"
        for button in buttons:
            region = button.region
            assert region.width > 0 and region.height > 0, f"{name} at {size}: {button.id} has no room"
            assert region.right <= size[0] and region.bottom <= size[1], f"{name} at {size}: {button.id} ends at {region} (off screen)"
            centre = region.center
            shown, _ = app.screen.get_widget_at(*centre)
            assert shown is button or button in shown.ancestors, f"{name} at {size}: {button.id} is covered or scrolled away ({shown!r} at {centre})"


@pytest.mark.parametrize("name,size", MODAL_CASES)
def test_modal_snapshot(snap_compare, name, size):
    async def run_before(pilot):
        pilot.app.select_job("train-kimi")
        await pilot.pause()
        pilot.app.push_screen(modal_for(name))
        await pilot.pause()
        for field in pilot.app.screen.query("Input"):
            field.cursor_blink = False
        await pilot.pause()

    assert snap_compare(app_for("dashboard"), terminal_size=size, run_before=run_before)


# -- several hosts: the Hosts view and the Dashboard with a host column and a multi-node job ---------------------------


def multi_host_app():
    return build_app(state=multinode_states(stalled=True), poll_interval=None, refresh_throttle=0)


async def show_multi_host(pilot, key: str) -> None:
    pilot.app.select_job("mn-1", "gpu-a")
    await pilot.pause()
    await pilot.press(key)
    await pilot.pause()
    pilot.app.redraw_now()
    await pilot.pause()


@pytest.mark.parametrize("size", SIZES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("key", list(MULTI_HOST_SCREENS))
async def test_a_multi_host_console_shows_every_key_too(size, key):
    app = multi_host_app()
    async with app.run_test(size=size) as pilot:
        await show_multi_host(pilot, key)
        assert getattr(app.screen, "MODE", None) == MULTI_HOST_SCREENS[key]
        missing = (APP_KEYS | MULTI_HOST_KEYS | SCREEN_KEYS.get(MULTI_HOST_SCREENS[key], set())) - visible_footer_keys(app)
        assert not missing, f"{MULTI_HOST_SCREENS[key]} at {size}: keys not on screen: {sorted(missing)}"


@pytest.mark.parametrize(
    "key,size", [(k, s) for k in MULTI_HOST_SCREENS for s in SIZES], ids=[f"{MULTI_HOST_SCREENS[k]}-{s[0]}x{s[1]}" for k in MULTI_HOST_SCREENS for s in SIZES]
)
def test_multi_host_snapshot(snap_compare, key, size):
    async def run_before(pilot):
        await show_multi_host(pilot, key)

    assert snap_compare(multi_host_app(), terminal_size=size, run_before=run_before)


# -- the ? help and a Dashboard filtered with / (issue 26) ---------------------------------------------------------


@pytest.mark.parametrize("size", SIZES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_help_snapshot(snap_compare, size):
    async def run_before(pilot):
        await show(pilot, "1")
        await pilot.press("question_mark")
        await screen_shown(pilot.app, HelpModal, "the help screen")
        await pilot.pause()

    assert snap_compare(app_for("dashboard"), terminal_size=size, run_before=run_before)


@pytest.mark.parametrize("size", SIZES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_filtered_dashboard_snapshot(snap_compare, size):
    """/ kimi: the jobs table and the GPU holders both keep only what holds it (bob's server is hidden, and counted)."""

    async def run_before(pilot):
        await show(pilot, "1")
        await pilot.press("slash", *"kimi", "enter")
        await pilot.pause()
        pilot.app.redraw_now()
        await pilot.pause()

    assert snap_compare(app_for("dashboard"), terminal_size=size, run_before=run_before)
