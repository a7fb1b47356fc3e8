"""Operator habits from htop, nvitop and k9s (issue 26): per-job CPU % and RSS, sort keys, one / filter for jobs and GPU
holders, unwatching an ext: run, hurrying a reconnect with r; and the ext:/adopted rows that read wrong before."""

import asyncio
import os
import signal

import pytest
from textual.widgets import DataTable

from backend.protocol import Request
from console.app import build_app
from console.screens.unwatch_modal import UnwatchModal
from console.state import RECONNECTING, ConnectionStatus
from console.transport import Transport, TransportError
from console.widgets.hosts import rss_cell
from tests.fixtures.ssh import connected, screen_shown, wait_until
from tests.fixtures.console_states import NOW, frozen_state, wire_jobs
from tests.fixtures.console_apps import banner_text, live_app

WIDE = (170, 45)


def job(name: str, **fields) -> dict:
    return {
        "name": name,
        "kind": "train",
        "state": "running",
        "pid": 2000,
        "pgid": 2000,
        "start_time_ticks": 1,
        "argv": ["eagle3-host", "train"],
        "job_dir": f"/root/.eagle3/jobs/{name}",
        "stdout_path": "/o",
        "stderr_path": "/e",
        "started_at": NOW - 100,
        **fields,
    }


def habits_state():
    """frozen_state's two jobs, a third with more memory and less CPU, a watched run and an adopted process."""
    state = frozen_state()
    jobs = wire_jobs(state) + [
        job("serve-big", kind="serve", cpu_pct=45.0, rss_bytes=40 << 30, started_at=NOW - 50),
        job("adopted-777", kind="adopted", adopted=True, pid=777, pgid=777, cpu_pct=3.0, rss_bytes=1 << 20, started_at=NOW - 20),
    ]
    state.add_external("ext:specforge", "/data/sf/runs")
    state.apply({"type": "jobs", "jobs": jobs})
    return state


def frozen(state=None):
    return build_app(state=state or habits_state(), poll_interval=None, refresh_throttle=0)


def rows(app) -> list[list[str]]:
    table = app.screen.query_one("#jobs", DataTable)
    return [[str(cell) for cell in table.get_row_at(i)] for i in range(table.row_count)]


def column(app, label: str) -> list[str]:
    table = app.screen.query_one("#jobs", DataTable)
    labels = [" ".join(str(c.label).split()) for c in table.ordered_columns]
    index = next(i for i, name in enumerate(labels) if name.split(" ")[0] == label)
    return [row[index] for row in rows(app)]


def title(app, widget: str = "#jobs-title") -> str:
    return str(app.screen.query_one(widget).render())


# -- 1. CPU % and RSS ------------------------------------------------------------------------------------


def test_rss_reads_like_htops_res_column():
    assert [rss_cell(v) for v in (None, 512, 4 << 10, 512 << 20, 10_522_669_875, 40 << 30, 3 << 40)] == ["-", "512B", "4.0K", "512M", "9.8G", "40G", "3.0T"]


def test_the_console_refuses_a_jobs_cpu_or_rss_that_is_not_a_number():
    state = frozen_state()
    state.apply({"type": "jobs", "jobs": [job("a", cpu_pct="NaN"), job("b", rss_bytes=1.5), job("c", cpu_pct=12.5, rss_bytes=1 << 30)]})
    assert list(state.jobs) == ["c"] and state.jobs["c"].cpu_pct == 12.5 and state.jobs["c"].rss_bytes == 1 << 30
    assert "left out 2 of 3 jobs: jobs[0].cpu_pct: expected a number, got string" in state.notes[-1][1]


@pytest.mark.parametrize("size", [(100, 30), WIDE], ids=["100x30", "170x45"])
async def test_the_jobs_table_shows_each_jobs_cpu_and_rss(size):
    app = frozen()
    async with app.run_test(size=size) as pilot:
        await pilot.pause()
        assert column(app, "job")[:3] == ["ext:specforge", "adopted-777", "serve-big"]
        assert column(app, "cpu%")[:5] == ["-", "3%", "45%", "312%", "-"]  # a watched run and a finished job have none
        assert column(app, "rss")[:5] == ["-", "1.0M", "40G", "9.8G", "-"]


# -- 2. sort keys ------------------------------------------------------------------------------------------


async def test_sort_keys_cycle_the_column_reverse_it_and_the_header_says_which():
    app = frozen()
    async with app.run_test(size=WIDE) as pilot:
        await pilot.pause()
        newest_first = column(app, "job")
        seen = {}
        for _ in range(6):
            await pilot.press("greater_than_sign")
            await pilot.pause()
            seen[title(app)] = column(app, "job")
        assert seen["Jobs · by CPU % ▼"] == ["train-kimi", "serve-big", "adopted-777", "ext:specforge", "bench-old"]
        assert seen["Jobs · by RSS ▼"] == ["serve-big", "train-kimi", "adopted-777", "ext:specforge", "bench-old"]
        assert seen["Jobs · by step ▼"][0] == "train-kimi"  # the only one with a step
        assert seen["Jobs · by name ▼"] == ["adopted-777", "bench-old", "ext:specforge", "serve-big", "train-kimi"]
        assert seen["Jobs · by state ▼"][-2:] == ["ext:specforge", "bench-old"]  # running first, watching, then exited
        assert seen["Jobs"] == newest_first  # back at the default: started, newest first
        await pilot.press("greater_than_sign")  # CPU
        await pilot.press("less_than_sign")
        await pilot.pause()
        assert title(app) == "Jobs · by CPU % ▲" and column(app, "job")[:3] == ["adopted-777", "serve-big", "train-kimi"]
        labels = [str(c.label) for c in app.screen.query_one("#jobs", DataTable).ordered_columns]
        assert "cpu% ▲" in labels  # the sorted column is marked in the header too


async def test_brackets_walk_the_jobs_in_the_tables_sorted_order():
    app = frozen()
    async with app.run_test(size=WIDE) as pilot:
        for _ in range(2):  # started -> CPU % -> RSS
            await pilot.press("greater_than_sign")
            await pilot.pause()
        assert title(app) == "Jobs · by RSS ▼"
        order = column(app, "job")
        app.select_job(order[0])
        await pilot.pause()
        walked = []
        for _ in range(len(order) - 1):
            await pilot.press("right_square_bracket")
            await pilot.pause()
            walked.append(app.selected_job)
        assert walked == order[1:]
        await pilot.press("left_square_bracket")
        await pilot.pause()
        assert app.selected_job == order[-2]


# -- 3. one / filter for the jobs table and the GPU holders -----------------------------------------------


async def test_slash_filters_the_gpu_holders_with_the_same_text_as_the_jobs():
    app = frozen()
    async with app.run_test(size=WIDE) as pilot:
        app.select_job("train-kimi")
        await pilot.pause()
        await pilot.press("slash", *"bob")
        await pilot.pause()
        gpus = str(app.screen.query_one("#gpus").render())
        assert "foreign bob pid 448" in gpus and "ours    train-kimi" not in gpus
        assert "(1 of 2 holders hidden by the filter)" in gpus  # GPU0's line stays, saying what the filter hid
        assert title(app, "#gpus-title") == "GPUs · filter 'bob': 1 of 2 holders"
        assert app.screen.query_one("#jobs", DataTable).row_count == 0  # no job holds "bob"
        await pilot.press("backspace", "backspace", "backspace", *"kimi")
        await pilot.pause()
        gpus = str(app.screen.query_one("#gpus").render())
        assert "ours    train-kimi pid 1234" in gpus and "bob" not in gpus
        assert column(app, "job") == ["train-kimi"]
        await pilot.press("escape")
        await pilot.pause()
        assert title(app, "#gpus-title") == "GPUs" and "bob" in str(app.screen.query_one("#gpus").render())


# -- 4. unwatching an ext: run ------------------------------------------------------------------------------


async def test_u_unwatches_the_selected_ext_run_after_saying_nothing_on_the_host_is_touched(tmp_path):
    log = tmp_path / "train.log"
    log.write_text("epoch 1 step 200 loss 8.38 acc0 0.246 lr 1.2e-04\n")
    app = live_app(tmp_path)
    async with app.run_test(size=WIDE) as pilot:
        await connected(app)
        await pilot.press("u")
        await pilot.pause()
        assert "Unwatch is disabled: no job selected" in app.state.actions[-1][1]
        await pilot.press("w")
        await pilot.pause()
        await pilot.press(*str(log), "tab", *"mine", "enter")
        await wait_until(lambda: "ext:mine" in app.state.metrics and app.state.metrics["ext:mine"].records, what="the watched run's records")
        assert app.selected_job == "ext:mine"
        await pilot.press("u")
        modal = await screen_shown(app, UnwatchModal, "the unwatch question")
        said = str(modal.query_one("#unwatch-plan").render())
        assert "Nothing on the host is touched" in said and str(log) in said
        await pilot.press("escape")  # the default: keep watching
        await pilot.pause()
        assert "ext:mine" in app.state.jobs and app.state.actions[-1][1] == "unwatch cancelled; still watching ext:mine"
        await pilot.press("u")
        await screen_shown(app, UnwatchModal, "the unwatch question")
        await pilot.press("y")
        await wait_until(lambda: "ext:mine" not in app.state.jobs, what="the run leaving the jobs table")
        assert "ext:mine" not in app.state.metrics and "ext:mine" not in app.state.externals
        assert "nothing on the host was touched" in app.state.actions[-1][1] and log.exists()
        with pytest.raises(Exception, match="not_found"):  # the agent no longer reads it
            await app.client.request(Request.UNWATCH_EXTERNAL, name="ext:mine")


async def test_u_is_off_on_a_job_that_is_not_a_watched_run():
    app = frozen()
    async with app.run_test(size=WIDE) as pilot:
        app.select_job("train-kimi")
        await pilot.pause()
        assert app.disabled_reason("unwatch_external") in ("no host connection", "train-kimi is not a watched run (w watches one)")
        app.state.set_connection(ConnectionStatus(state="connected"))
        app.client = object()  # a connection as the guard sees it; nothing is sent
        assert app.disabled_reason("unwatch_external") == "train-kimi is not a watched run (w watches one)"
        app.select_job("ext:specforge")
        assert app.disabled_reason("unwatch_external") is None


# -- 6. r hurries a reconnect ---------------------------------------------------------------------------------


class FlakyTransport(Transport):
    """A transport whose link never comes back: each try fails at once, so only the waits between tries take time."""

    label = "flaky"

    def __init__(self):
        super().__init__(backoff_initial=0.05, backoff_max=60.0)
        self.tries: list[float] = []

    async def _open_session(self):
        self.tries.append(asyncio.get_running_loop().time())
        raise TransportError("cannot reach flaky")


async def test_retry_now_tries_at_once_and_resets_the_backoff():
    transport = FlakyTransport()
    task = asyncio.create_task(transport._reconnect("the agent's output ended"))
    await wait_until(lambda: len(transport.tries) >= 6, what="six tries")  # waits 0.05, 0.1, ... 1.6 s now
    await wait_until(lambda: transport.waiting_to_retry, what="the wait before try 7")
    asked = asyncio.get_running_loop().time()
    assert transport.retry_now()
    await wait_until(lambda: len(transport.tries) >= 7, timeout=1.0, what="the hurried try")
    assert transport.tries[6] - asked < 0.5
    await wait_until(lambda: len(transport.tries) >= 8, timeout=1.0, what="the next try, after the first backoff again")
    assert transport.tries[7] - transport.tries[6] < 0.5
    transport._closing = True
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    assert not transport.retry_now()  # nothing waiting: nothing to hurry


async def test_r_while_disconnected_reconnects_at_once_and_the_banner_says_when_the_next_try_is(tmp_path):
    app = live_app(tmp_path, backoff=20.0, backoff_max=30.0)  # without r, the first retry waits 16-24 s
    async with app.run_test(size=WIDE) as pilot:
        await connected(app)
        agent = app.state.hello.agent_pid
        os.kill(agent, signal.SIGKILL)  # the console's own agent child: the link drops
        await wait_until(lambda: app.state.connection.next_try_at is not None, what="the wait before the first retry")
        await pilot.pause()
        banner = banner_text(app)
        assert "next try at " in banner and "r retries now" in banner
        assert app.check_action("resync", ()) is True  # r is on while disconnected; stop and start stay off
        assert app.check_action("stop_job", ()) is None
        pressed = asyncio.get_running_loop().time()
        await pilot.press("r")
        await wait_until(lambda: app.state.connection.connected and app.state.hello.agent_pid != agent, timeout=15, what="the hurried reconnect")
        assert asyncio.get_running_loop().time() - pressed < 12.0  # not the 16 s backoff
        assert "reconnecting to local now" in [text for _, text in app.state.actions]


def test_the_banner_of_a_try_under_way_says_so():
    state = frozen_state()
    state.set_connection(ConnectionStatus(state=RECONNECTING, since=NOW - 1, attempt=4))
    from console.widgets.banner import banner_text as text_of

    assert "(attempt 4, trying now) · r retries now" in str(text_of(state))


# -- 7. rows that read wrong before ----------------------------------------------------------------------------


async def test_a_watched_run_shows_no_pid_0_and_an_adopted_job_no_adopted_twice():
    app = frozen()
    async with app.run_test(size=WIDE) as pilot:
        await pilot.pause()
        by_name = {row[0]: row for row in rows(app)}
        watched, adopted = by_name["ext:specforge"], by_name["adopted-777"]
        assert watched[column_index(app, "pid")] == "-" and "0" not in watched[column_index(app, "pid")]
        assert watched[column_index(app, "state")] == "watching"
        assert adopted[column_index(app, "kind")] == "adopted" and "(adopted)" not in " ".join(adopted)
        assert adopted[column_index(app, "pid")] == "777"


def column_index(app, label: str) -> int:
    table = app.screen.query_one("#jobs", DataTable)
    return [" ".join(str(c.label).split()).split(" ")[0] for c in table.ordered_columns].index(label)
