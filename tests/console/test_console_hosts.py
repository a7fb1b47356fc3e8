"""Several hosts in one console: real loopback OpenSSH servers stand in for GPU hosts (each its own port, HOME and run
dir); the Hosts view, the jobs table across hosts, actions on the selected job's host, one host going STALE alone; and a
multi-node job shown as one row whose nodes and ranks say which one stopped reporting."""

import asyncio
import os
import signal
import sys
from pathlib import Path

import pytest
from textual.widgets import DataTable

from backend.protocol import Request
from console.app import build_app
from console.flows.stop import merge_stop_plans
from console.screens.hosts import HostsScreen
from console.screens.modals import MultiNodeModal, StopModal
from console.state import CONNECTED, FAILED, RECONNECTING
from console.transport import SSHTransport
from console.nodes import nodes_of
from tests.fixtures.ssh import RealSSHD, free_port, job_argv, pid_alive, screen_shown, sshd_available, wait_until
from tests.fixtures.console_states import multinode_states

needs_sshd = pytest.mark.skipif(not sshd_available(), reason="OpenSSH sshd not installed (/usr/sbin/sshd); CI installs openssh-server")


pytestmark = pytest.mark.usefixtures("isolated_home")


@pytest.fixture
def three_hosts(tmp_path):
    """Three sshd on 127.0.0.1 that accept one client key; known_hosts pins all three host keys."""
    servers = [RealSSHD(tmp_path / f"sshd-{i}").start() for i in range(3)]
    for server in servers[1:]:
        (server.root / "authorized_keys").write_text(servers[0].client_pub.read_text())
    known = tmp_path / "known_hosts"
    known.write_text("".join(f"[127.0.0.1]:{s.port} {s.env().host_public_key}\n" for s in servers))
    yield servers, known
    for server in servers:
        server.stop()


def transports(servers, known, tmp_path) -> list[SSHTransport]:
    env = servers[0].env()
    return [
        SSHTransport(
            "127.0.0.1",
            port=s.port,
            user=env.user,
            identity=str(env.client_key),
            known_hosts=str(known),
            python=sys.executable,
            run_dir=str(tmp_path / f"host-run-{i}"),
            backoff_initial=0.2,
            backoff_max=1.0,
        )
        for i, s in enumerate(servers)
    ]


def table_rows(app, selector: str) -> list[list[str]]:
    table = app.screen.query_one(selector, DataTable)
    return [[str(cell) for cell in table.get_row_at(i)] for i in range(table.row_count)]


@needs_sshd
@pytest.mark.sshd
async def test_three_hosts_one_console_actions_follow_the_selected_jobs_host_and_one_dead_host_goes_stale_alone(three_hosts, tmp_path):
    servers, known = three_hosts
    app = build_app(transports(servers, known, tmp_path), poll_interval=1.0, refresh_throttle=0, stop_grace=5)
    a, b, c = app.sessions
    async with app.run_test(size=(170, 45)) as pilot:
        await wait_until(lambda: all(s.connected and s.state.hello for s in app.sessions), timeout=60, what="three agents over sshd")
        assert len({s.state.hello.agent_pid for s in app.sessions}) == 3
        assert [s.state.hello.run_dir for s in app.sessions] == [str(tmp_path / f"host-run-{i}") for i in range(3)]
        job = (await b.request(Request.START_JOB, name="on-b", kind="train", argv=job_argv(sys.executable)))["job"]
        await wait_until(lambda: "on-b" in b.state.jobs, what="b's jobs event")

        await pilot.press("6")
        await screen_shown(app, HostsScreen, "the Hosts view")
        app.redraw_now()
        await pilot.pause()
        rows = table_rows(app, "#hosts")
        assert [r[0] for r in rows] == [a.name, b.name, c.name]
        assert all("connected" in r[1] for r in rows) and [r[6] for r in rows] == ["0", "1", "0"]

        await pilot.press("1")
        app.select_job("on-b", b.name)
        await wait_until(
            lambda: app.active is b and app.state.metrics.get("on-b") and app.state.metrics["on-b"].records == 3, what="b active and on-b's metrics loaded"
        )
        app.redraw_now()
        await pilot.pause()
        jobs = table_rows(app, "#jobs")
        assert [(r[0], r[1]) for r in jobs] == [(b.name, "on-b")]  # one table across hosts, with the host column

        await pilot.press("s")  # the stop goes to the selected job's host
        await screen_shown(app, StopModal, "the stop modal")
        assert app.screen.pids == [job["pid"]]
        await pilot.press("y")
        await wait_until(
            lambda: any(line.startswith("stop on-b:") for _, line in app.state.actions), what="the verdicts", timeout=60, context=lambda: notes_of(app)
        )
        assert not pid_alive(job["pid"])

        servers[2].stop()  # host c's sshd and its sessions die
        await wait_until(lambda: c.state.connection.state == RECONNECTING, timeout=30, what="c disconnected")
        await asyncio.sleep(2.5)  # a few keepalive/poll rounds: a and b must stay live
        assert a.state.connection.state == CONNECTED and b.state.connection.state == CONNECTED
        await pilot.press("6")
        await screen_shown(app, HostsScreen, "the Hosts view again")
        app.redraw_now()
        await pilot.pause()
        rows = table_rows(app, "#hosts")
        assert "STALE" in rows[2][1] and "connected" in rows[0][1] and "connected" in rows[1][1]
        banner = str(app.screen.query_one("#banner").render())
        assert "STALE" in banner.splitlines()[-1] and "● connected" in banner  # b (the active host) is live; c is stale


SLEEPER = "import time; time.sleep(600)"


def notes_of(app) -> str:
    """The console's notes, oldest first: what a timed-out wait prints."""
    return "\n".join(line for _, line in app.state.actions)


async def sleeping_nodes(app, run_id: str) -> list[dict]:
    """A stand-in multi-node job: one sleeping process per host, recorded with the node fields; selected on node 0."""
    await wait_until(lambda: all(s.connected for s in app.sessions), timeout=60, what="every agent")
    jobs = [
        (
            await s.request(
                Request.START_JOB,
                name=run_id,
                kind="train",
                argv=[sys.executable, "-c", SLEEPER],
                node={"run_id": run_id, "node_rank": rank, "nnodes": len(app.sessions), "rdzv_endpoint": "127.0.0.1:1"},
            )
        )["job"]
        for rank, s in enumerate(app.sessions)
    ]
    # running, not just listed: a poll between the record's insert and its leader shows it "starting", and a plan made
    # then has nothing to stop (stop & bench's y stays disabled; seen on a loaded CI machine)
    await wait_until(lambda: all(run_id in s.state.jobs and s.state.jobs[run_id].state == "running" for s in app.sessions), what="every node listed as running")
    app.select_job(run_id, app.sessions[0].name)
    return jobs


@needs_sshd
@pytest.mark.sshd
async def test_a_node_whose_host_is_unreachable_is_named_and_left_alone_while_the_others_stop(three_hosts, tmp_path):
    """Decided: a stop of a multi-node job whose host went away stops the reachable nodes (the stop flag is reduced across
    every rank, so the lost node's ranks stop after the same step) and says which node was NOT signalled; nothing is
    retried behind the operator."""
    servers, known = three_hosts
    app = build_app(transports(servers[:2], known, tmp_path), poll_interval=1.0, refresh_throttle=0, stop_grace=5)
    a, b = app.sessions
    async with app.run_test(size=(170, 45)) as pilot:
        jobs = await sleeping_nodes(app, "mn-x")
        servers[1].stop()
        await wait_until(lambda: not b.connected, timeout=30, what="host b gone")
        app.redraw_now()
        await pilot.pause()
        assert "node 1 (" + b.name + "): host not answering" in table_rows(app, "#jobs")[0][-1]
        await pilot.press("s")
        await screen_shown(app, StopModal, "the stop plan")
        assert app.screen.pids == [jobs[0]["pid"]]
        assert "NOT signalled" in str(app.screen.query_one("#stop-plan").render())
        await pilot.press("y")
        verdict = await wait_until(
            lambda: next((line for _, line in app.state.actions if line.startswith("stop mn-x:")), None), timeout=60, what="the verdicts"
        )
        assert f"node 1 ({b.name}): NOT signalled, its host is not connected" in verdict
        assert not pid_alive(jobs[0]["pid"]) and pid_alive(jobs[1]["pid"])  # b's node was not ours to reach
        os.killpg(jobs[1]["pgid"], signal.SIGKILL)


@needs_sshd
@pytest.mark.sshd
async def test_stop_and_bench_of_a_multinode_job_stops_every_node_before_the_chain_starts_on_node_0(three_hosts, tmp_path):
    from backend.commands import chain_job_name
    from console.screens.modals import StopAndBenchModal

    servers, known = three_hosts
    app = build_app(transports(servers[:2], known, tmp_path), poll_interval=1.0, refresh_throttle=0, stop_grace=5)
    a, b = app.sessions
    async with app.run_test(size=(170, 45)) as pilot:
        jobs = await sleeping_nodes(app, "mn-y")
        await pilot.press("b")
        await screen_shown(app, StopAndBenchModal, "the stop & bench plan")
        app.set_active(b)  # the selection moves to node 1's host while the plan is on screen: the chain still goes to node 0's
        await pilot.press("y")
        await wait_until(lambda: chain_job_name("mn-y") in a.state.jobs, timeout=120, what="the chain on node 0's host", context=lambda: notes_of(app))
        assert app.active is a  # the chain screen shows the host it runs on
        lines = [line for _, line in app.state.actions]
        stopped = next(i for i, line in enumerate(lines) if line.startswith("stop mn-y: node 0"))
        started = next(i for i, line in enumerate(lines) if line.startswith(f"started {chain_job_name('mn-y')}"))
        assert stopped < started and f"node 1 ({b.name}): {jobs[1]['pid']} exited_on_term" in lines[stopped]
        assert not pid_alive(jobs[0]["pid"]) and not pid_alive(jobs[1]["pid"])
        assert chain_job_name("mn-y") not in b.state.jobs
        await wait_until(lambda: a.state.jobs[chain_job_name("mn-y")].state != "running", timeout=120, what="the chain to end", context=lambda: notes_of(app))


@needs_sshd
@pytest.mark.sshd
async def test_a_stop_goes_to_the_host_whose_pids_were_confirmed_even_if_the_selection_moves_meanwhile(three_hosts, tmp_path):
    """Two hosts each run a job called "same": the stop modal lists a's PID; a redraw or a click that selects b's "same"
    while the modal is up must not send the stop (by name) to b, which would kill a PID the operator never saw."""
    servers, known = three_hosts
    app = build_app(transports(servers[:2], known, tmp_path), poll_interval=1.0, refresh_throttle=0, stop_grace=5)
    a, b = app.sessions
    async with app.run_test(size=(170, 45)) as pilot:
        await wait_until(lambda: a.connected and b.connected, timeout=60, what="two agents over sshd")
        jobs = [(await s.request(Request.START_JOB, name="same", kind="serve", argv=[sys.executable, "-c", SLEEPER]))["job"] for s in (a, b)]
        await wait_until(lambda: "same" in a.state.jobs and "same" in b.state.jobs, what="both jobs listed")
        app.select_job("same", a.name)
        await pilot.press("s")
        await screen_shown(app, StopModal, "the stop modal")
        assert app.screen.pids == [jobs[0]["pid"]]
        app.select_job("same", b.name)
        await pilot.press("y")
        await wait_until(
            lambda: any(line.startswith("stop same:") for _, line in app.state.actions), timeout=60, what="the verdict", context=lambda: notes_of(app)
        )
        assert not pid_alive(jobs[0]["pid"]) and pid_alive(jobs[1]["pid"])
        os.killpg(jobs[1]["pgid"], signal.SIGKILL)


@needs_sshd
@pytest.mark.sshd
async def test_a_changed_host_key_on_one_host_refuses_only_that_host(three_hosts, tmp_path):
    from tests.fixtures.ssh import other_host_public_key

    servers, known = three_hosts
    lines = known.read_text().splitlines()
    lines[1] = f"[127.0.0.1]:{servers[1].port} {other_host_public_key()}"
    known.write_text("\n".join(lines) + "\n")
    app = build_app(transports(servers, known, tmp_path), poll_interval=None, refresh_throttle=0)
    a, b, c = app.sessions
    async with app.run_test(size=(170, 45)):
        await wait_until(lambda: a.connected and c.connected and b.state.connection.state == FAILED, timeout=60, what="a and c connected, b refused")
        assert "CHANGED" in b.state.connection.detail.upper() or "mismatch" in b.state.connection.detail.lower()
        assert app.disabled_reason("start_multinode") is None  # two hosts are still connected


async def test_a_multinode_job_is_one_row_and_the_rank_that_stopped_reporting_is_named():
    app = build_app(state=multinode_states(stalled=True), poll_interval=None, refresh_throttle=0)
    async with app.run_test(size=(170, 45)) as pilot:
        app.select_job("mn-1", "gpu-a")
        app.alerting.check({"jobs"}, app.sessions[1])
        await pilot.pause()
        app.redraw_now()
        await pilot.pause()
        rows = table_rows(app, "#jobs")
        mn = [r for r in rows if r[1] == "mn-1"]
        assert len(mn) == 1 and mn[0][0] == "gpu-a+gpu-b" and mn[0][3] == "running 2/2"
        assert "node 1 (gpu-b) not reporting for 42 s" in mn[0][-1]
        assert sorted(r[0] for r in rows if r[1] == "solo") == ["gpu-a", "gpu-b"]  # one-node jobs stay one row per host
        nodes = str(app.screen.query_one("#nodes").render())
        assert "└ rank 1: step 80, 42.0 s ago  NOT REPORTING" in nodes and "node 0 · gpu-a · running" in nodes
        assert any("mn-1: node 1 rank 1 on gpu-b not reporting for 42 s (last step 80)" in a for a in app.alerting.alerts)


async def test_ranks_that_disagree_mark_the_slowest_and_a_one_node_job_shows_no_nodes_panel():
    app = build_app(state=multinode_states(stalled=False), poll_interval=None, refresh_throttle=0)
    async with app.run_test(size=(170, 45)) as pilot:
        app.select_job("mn-1", "gpu-b")  # either node's row selects the run
        await pilot.pause()
        app.redraw_now()
        nodes = str(app.screen.query_one("#nodes").render())
        assert "└ rank 1: step 80, 0.4 s ago  slowest" in nodes and "NOT REPORTING" not in nodes
        assert not app.alerting.alerts
        app.select_job("solo", "gpu-a")
        await pilot.pause()
        app.redraw_now()
        assert not app.screen.query_one("#nodes").display


async def test_a_highlight_posted_before_the_redraw_of_a_new_selection_does_not_undo_it():
    """The race CI caught: the jobs table's cursor sits on gpu-b's "solo"; the selection moves to gpu-a's "solo" and,
    before the table is redrawn for it, a RowHighlighted for the old row arrives. It must not move the selection back
    (a stop would then list and signal the other host's PID). A long refresh throttle holds the redraw back."""
    app = build_app(state=multinode_states(stalled=False), poll_interval=None, refresh_throttle=30)
    async with app.run_test(size=(170, 45)) as pilot:
        app.select_job("solo", "gpu-b")
        await pilot.pause()
        app.redraw_now()
        await pilot.pause()
        table = app.screen.query_one("#jobs", DataTable)
        old_row = table.coordinate_to_cell_key(table.cursor_coordinate).row_key
        assert old_row.value.startswith("gpu-b")
        app.select_job("solo", "gpu-a")
        table.post_message(DataTable.RowHighlighted(table, table.cursor_row, old_row))
        await pilot.pause()
        await pilot.pause()
        assert app.active.name == "gpu-a" and app.selected_job == "solo"
        app.redraw_now()
        await pilot.pause()
        await pilot.press("down")  # a real move after the redraw still selects
        await pilot.pause()
        assert table.coordinate_to_cell_key(table.cursor_coordinate).row_key.value.startswith(app.active.name)


def test_a_multinode_stop_plan_names_every_nodes_host():
    states = multinode_states(stalled=False)
    app = build_app(state=states, poll_interval=None, refresh_throttle=0)
    nodes = nodes_of(app.sessions, "gpu-a", "mn-1")
    plans = [
        {
            "jobs": ["mn-1"],
            "will_signal": [{"pid": 3000 + i, "job": "mn-1", "role": "leader", "cmdline": "torchrun"}],
            "stale": [],
            "foreign_gpu_holders": [],
            "checkpoint_first": i == 0,
        }
        for i in range(2)
    ]
    merged = merge_stop_plans("mn-1", nodes, plans)
    assert [e["job"] for e in merged["will_signal"]] == ["mn-1 (node 0 gpu-a)", "mn-1 (node 1 gpu-b)"]
    assert merged["checkpoint_first"] is True and merged["jobs"] == ["mn-1"]


@pytest.fixture
def console_profile(mini_target_dir, tmp_path):
    """The mini profile as a file the console uploads with the backend; it trains until stopped, checkpointing only then."""
    from tests.fixtures.env import mini_profile_dict
    from tests.fixtures.reference import toml_text

    path = tmp_path / "mini-nodes.toml"
    path.write_text(toml_text(mini_profile_dict(mini_target_dir, max_steps=100000, save_interval=100000, eval_interval=100000, log_interval=1, warmup_steps=2)))
    return path


@needs_sshd
@pytest.mark.sshd
@pytest.mark.slow
async def test_m_trains_one_job_across_two_sshd_hosts_and_s_stops_every_node_with_one_checkpoint(three_hosts, tmp_path, console_profile, mini_target_dir):
    from backend.layout import list_checkpoints
    from backend.serve.preflight import run_preflight

    servers, known = three_hosts
    servers[2].stop()  # two hosts are enough here
    hosts = transports(servers[:2], known, tmp_path)
    for transport in hosts:
        transport.extra_files = [(f"profiles/{console_profile.name}", console_profile)]
    port = free_port()
    app = build_app(hosts, profile=console_profile.stem, poll_interval=1.0, refresh_throttle=0, stop_grace=90, rdzv_endpoint=f"127.0.0.1:{port}")
    a, b = app.sessions
    async with app.run_test(size=(170, 45)) as pilot:
        await wait_until(lambda: a.connected and b.connected, timeout=60, what="two agents over sshd")
        await pilot.press("m")
        await screen_shown(app, MultiNodeModal, "the multi-node plan")
        assert [host for host, _ in app.screen.nodes] == [a.name, b.name]
        assert all(f"127.0.0.1:{port}" in argv and "--node-rank" in argv for _, argv in app.screen.nodes)
        await pilot.press("y")
        run = await wait_until(lambda: next((n for n in a.state.jobs if n.startswith("mn-")), None), what="the run on host a")
        await wait_until(lambda: run in b.state.jobs, what="the same run on host b")

        def both_ranks_past(step: int) -> bool:
            nodes = app.nodes_of(run)
            ranks = [r for n in nodes for r in n.job.ranks]
            return len(nodes) == 2 and len(ranks) == 2 and all((r.get("step") or 0) > step for r in ranks)

        await wait_until(lambda: both_ranks_past(2), timeout=240, what="both ranks training across the two hosts")
        assert app.selected_job == run and app.active is a
        app.redraw_now()
        await pilot.pause()
        row = next(r for r in table_rows(app, "#jobs") if r[1] == run)
        assert row[0] == f"{a.name}+{b.name}" and row[3] == "running 2/2"
        dirs = [Path(s.state.jobs[run].job_dir) for s in (a, b)]
        assert dirs[0].is_relative_to(tmp_path / "host-run-0") and dirs[1].is_relative_to(tmp_path / "host-run-1")
        assert (dirs[0] / "metrics.jsonl").exists() and not (dirs[1] / "metrics.jsonl").exists()  # only rank 0 writes metrics

        await pilot.press("s")
        await screen_shown(app, StopModal, "the stop plan of both nodes")
        plan = app.screen.plan
        assert {e["job"].rsplit("(", 1)[1] for e in plan["will_signal"]} == {f"node 0 {a.name})", f"node 1 {b.name})"}
        pids = app.screen.pids
        await pilot.press("y")
        verdict = await wait_until(
            lambda: next((line for _, line in app.state.actions if line.startswith(f"stop {run}: node 0")), None), timeout=180, what="a verdict per node"
        )
        assert f"node 1 ({b.name}):" in verdict and "failed" not in verdict
        assert not [pid for pid in pids if pid_alive(pid)], "a process of the stopped run is still alive"
        checkpoints = list_checkpoints(dirs[0])
        assert len(checkpoints) == 1 and not list_checkpoints(dirs[1])
        report = run_preflight(checkpoints[0], Path(mini_target_dir) / "config.json", check_sglang=False)
        assert report.ok, report.problems
