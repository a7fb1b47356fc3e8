"""Search in logs (less / toolong habit): / on the Logs screen searches the shown lines of both streams, highlights the
matches, n / N go to the next / previous one (the keys are the app's again once the search is cleared), esc clears;
a host's text stays inert (escapes shown, markup never parsed)."""

import pytest
from textual.widgets import Input

from console.app import build_app
from console.state import Section
from console.screens.logs import MATCH_STYLE, LogsScreen, Match, SearchableLog, find_matches, line_matches, step_match
from tests.fixtures.console_states import frozen_state

SIZES = [(100, 30), (170, 45)]
JOB = "train-kimi"
NAMED_KEYS = {"slash", "enter", "escape", "n", "N"}
HOSTILE = "evil \x1b[31mred\x1b[0m [bold]loss[/bold] \u202etxt"

pytestmark = pytest.mark.usefixtures("utc")  # snapshot clocks read in UTC (tests/conftest.py)


def search_state():
    """frozen_state()'s train-kimi (stdout: 40 'step N loss X' lines, stderr: a warning), with stderr lines that match too, one hostile."""
    state = frozen_state()
    stderr = ["step 300 loss 5.700 (stderr)", HOSTILE, "Traceback: loss is NaN at step 390"]
    state.apply({"type": "log", "job": JOB, "stream": "stderr", "lines": stderr})
    return state


async def on_logs(pilot, *keys: str) -> LogsScreen:
    app = pilot.app
    app.select_job(JOB)
    await pilot.pause()
    await pilot.press("3")
    await pilot.pause()
    for key in keys:  # a key name, or text typed character by character
        await pilot.press(*([key] if key in NAMED_KEYS else list(key)))
        await pilot.pause()
    screen = app.screen
    assert isinstance(screen, LogsScreen)
    return screen


def match_styles(log: SearchableLog, line: int) -> list[str]:
    """The texts of a line drawn in the match style."""
    strip = log._render_line_strip(line, log.rich_style)
    return [segment.text for segment in strip if segment.style and segment.style.bgcolor == MATCH_STYLE.bgcolor]


def screen_keys(screen) -> set[str]:
    """The keys the screen's own bindings hold now (n / N only while a search is on)."""
    return {key for key, active in screen.active_bindings.items() if active.node is screen}


# -- pure parts ----------------------------------------------------------------------------------------------------


def test_smart_case_and_the_order_of_matches_across_streams():
    assert line_matches("Loss 5.7", "loss") and not line_matches("Loss 5.7", "Lost") and not line_matches("loss", "Loss")
    lines = {"stdout": ["a loss", "b", "c LOSS"], "stderr": ["loss d"]}
    matches = find_matches(lines, "loss")
    assert [(m.stream, m.line) for m in matches] == [("stdout", 0), ("stdout", 2), ("stderr", 0)]
    assert step_match(matches, None, True) == matches[0] and step_match(matches, None, False) == matches[-1]
    assert step_match(matches, matches[1], True) == matches[2] and step_match(matches, matches[2], True) == matches[0]  # wraps
    assert step_match(matches, matches[0], False) == matches[2] and step_match([], None, True) is None
    assert step_match(matches, Match("stdout", 1, "b"), True) == matches[1]  # from a line that no longer matches


# -- Pilot ------------------------------------------------------------------------------------------------------------


async def test_slash_searches_both_streams_n_and_N_step_through_the_matches_and_esc_clears():
    app = build_app(state=search_state(), poll_interval=None, refresh_throttle=0)
    async with app.run_test(size=(170, 45)) as pilot:
        screen = await on_logs(pilot, "slash", "5.7")
        box = screen.query_one("#logs-search", Input)
        assert box.display and box.value == "5.7"  # the / itself is not typed into the box
        stdout, stderr = screen.query_one("#log-stdout", SearchableLog), screen.query_one("#log-stderr", SearchableLog)
        assert match_styles(stdout, 30) == ["5.7"] and match_styles(stdout, 31) == []  # lit while typing
        await pilot.press("enter")
        await pilot.pause()
        expected = [("stdout", i) for i in range(21, 31)] + [("stderr", 1)]  # 5.790 ... 5.700, then stderr's line
        assert [(m.stream, m.line) for m in find_matches(screen._lines(), "5.7")] == expected
        assert (screen.match.stream, screen.match.line) == ("stdout", 21) and stdout.current == 21 and not screen.follow
        assert stdout.scroll_offset.y <= 21 < stdout.scroll_offset.y + stdout.size.height  # scrolled into view
        title = str(screen.query_one("#logs-title").render())
        assert "search '5.7': 1/11 (stdout line 22)" in title
        for _ in range(10):
            await pilot.press("n")
        await pilot.pause()
        assert (screen.match.stream, screen.match.line) == ("stderr", 1) and stderr.current == 1 and stdout.current is None
        await pilot.press("n")  # wraps to the first
        await pilot.pause()
        assert screen.match.line == 21 and screen.match.stream == "stdout"
        await pilot.press("N")  # and back to the last
        await pilot.pause()
        assert screen.match.stream == "stderr"
        assert not [a for a in app.state.actions if "disabled" in a[1]], "n / N were the search's, not the app's"
        assert {"n", "N", "slash"} <= screen_keys(screen)
        await pilot.press("escape")
        await pilot.pause()
        assert screen.search == "" and screen.match is None and not box.display and stderr.current is None
        assert match_styles(stdout, 30) == []
        assert not {"n", "N"} & screen_keys(screen) and "slash" in screen_keys(screen)
        await pilot.press("n")  # no search: n is the app's again (New run: disabled without a host)
        await pilot.pause()
        assert app.state.actions[-1][1] == "New tiny run is disabled: no host connection"


async def test_a_hosts_text_stays_inert_and_is_searched_as_shown():
    app = build_app(state=search_state(), poll_interval=None, refresh_throttle=0)
    async with app.run_test(size=(170, 45)) as pilot:
        screen = await on_logs(pilot, "slash", "[bold]", "enter")
        stderr = screen.query_one("#log-stderr", SearchableLog)
        assert screen.match is not None and (screen.match.stream, screen.match.line) == ("stderr", 2)
        shown = stderr.lines[2]
        assert "\x1b" not in shown and "\\x1b[31m" in shown and "\\u202e" in shown  # escapes shown, never sent
        assert match_styles(stderr, 2) == ["[bold]"]  # markup is text: found and lit as typed
        strip = stderr._render_line_strip(2, stderr.rich_style)
        assert "".join(segment.text for segment in strip).startswith("evil \\x1b[31mred\\x1b[0m [bold]loss[/bold]")
        assert find_matches(screen._lines(), "\x1b") == []  # what is searched is the text as shown: no escape is in it


async def test_the_current_match_stays_on_its_line_when_the_tail_is_read_again():
    state = search_state()
    app = build_app(state=state, poll_interval=None, refresh_throttle=0)
    async with app.run_test(size=(170, 45)) as pilot:
        screen = await on_logs(pilot, "slash", "Traceback", "enter")
        assert (screen.match.stream, screen.match.line) == ("stderr", 3)
        buffer = state.log(JOB, "stderr")  # the poll's re-read of the other stream: two lines more at the head
        buffer.replace(["older line 1", "older line 2", *buffer.lines])
        app.state_changed({Section.LOGS})
        app.redraw_now()
        await pilot.pause()
        assert (screen.match.stream, screen.match.line) == ("stderr", 5)
        assert screen.query_one("#log-stderr", SearchableLog).current == 5


# -- snapshots ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("size", SIZES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_log_search_snapshot(snap_compare, size):
    async def run_before(pilot):
        await on_logs(pilot, "slash", "loss 5.7", "enter", "n")
        pilot.app.redraw_now()
        await pilot.pause()

    assert snap_compare(build_app(state=search_state(), poll_interval=None, refresh_throttle=0), terminal_size=size, run_before=run_before)
