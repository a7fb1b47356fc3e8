"""AgentClient over the local transport, against the real agent (python -m backend.agent) as a subprocess."""

import asyncio
import os
import signal
import sys

import pytest

from backend.protocol import PROTOCOL_VERSION, Request
from console.client import AgentClient, AgentError
from console.state import CONNECTED, RECONNECTING, ConnectionStatus
from console.transport import LocalTransport, TransportError
from tests.fixtures.ssh import job_argv, pid_alive, wait_until


class Recorder:
    """Drains the client's event stream in the background, like the app's worker does."""

    def __init__(self, client: AgentClient):
        self.client = client
        self.events: list = []
        self.task = asyncio.create_task(self._run())

    async def _run(self):
        while True:
            self.events.append(await self.client.next_event())

    def statuses(self) -> list[str]:
        return [e.state for e in self.events if isinstance(e, ConnectionStatus)]

    def of_type(self, kind: str) -> list[dict]:
        return [e for e in self.events if isinstance(e, dict) and e.get("type") == kind]

    def stop(self):
        self.task.cancel()


@pytest.fixture
async def local(tmp_path):
    transport = LocalTransport(tmp_path / "run", backoff_initial=0.1, backoff_max=0.5)
    client = AgentClient(transport, timeout=20)
    await client.start()
    recorder = Recorder(client)
    await wait_until(lambda: client.status.connected, what="the local agent's hello")
    yield client, recorder
    recorder.stop()
    for job in (await client.request(Request.LIST_JOBS))["jobs"] if client.status.connected else []:
        if job["state"] == "running":
            await client.request(Request.STOP_JOB, name=job["name"], grace=2, timeout=60)
    await client.close()


async def test_requests_return_results_or_raise_agent_errors(local):
    client, recorder = local
    assert (await client.ping())["pong"] is True
    with pytest.raises(AgentError) as unknown:
        await client.request("no_such_request")
    assert unknown.value.code == "unknown_request" and "known:" in unknown.value.message
    with pytest.raises(AgentError) as bad:
        await client.request(Request.STOP_PLAN)
    assert bad.value.code == "bad_params" and "name" in bad.value.message
    with pytest.raises(AgentError) as missing:
        await client.request(Request.TAIL_LOG, name="nope", stream="stdout")
    assert missing.value.code == "not_found"
    hello = recorder.of_type("hello")[0]
    os.kill(hello["agent_pid"], signal.SIGSTOP)  # a stopped agent cannot answer: the timeout is certain, not a race with a fast reply
    try:
        with pytest.raises(AgentError) as slow:
            await client.request(Request.HOLDERS, timeout=0.3)
    finally:
        os.kill(hello["agent_pid"], signal.SIGCONT)
    assert slow.value.code == "timeout" and "may still take effect" in slow.value.message
    assert (await client.ping())["pong"] is True  # the late reply to the timed-out request is dropped, not matched to the ping
    assert hello["agent_pid"] != os.getpid() and hello["protocol"] == PROTOCOL_VERSION
    assert client.malformed_lines == 0


async def test_events_carry_jobs_metrics_and_followed_log_lines(local):
    client, recorder = local
    started = await client.request(Request.START_JOB, name="writer", kind="train", argv=job_argv(sys.executable, steps=4))
    assert started["job"]["state"] == "running"
    await client.request(Request.FOLLOW_LOG, name="writer", stream="stdout")

    def metrics_steps():
        return [r["step"] for e in recorder.of_type("metrics") if e["job"] == "writer" for r in e["records"]]

    assert await wait_until(lambda: metrics_steps() == [1, 2, 3, 4], what="4 metrics records as events")
    history = await client.request(Request.METRICS_HISTORY, name="writer", offset=0)
    assert [r["step"] for r in history["records"]] == [1, 2, 3, 4]
    assert history["offset"] == recorder.of_type("metrics")[-1]["offset"]
    tail = await wait_until(lambda: _tail_when_ready(client), what="the job's 'ready' line")
    assert tail[-5:] == ["step 1", "step 2", "step 3", "step 4", "ready"]
    assert any(e["jobs"] and e["jobs"][0]["name"] == "writer" for e in recorder.of_type("jobs"))


async def _tail_when_ready(client):
    lines = (await client.request(Request.TAIL_LOG, name="writer", stream="stdout", lines=10))["lines"]
    return lines if lines and lines[-1] == "ready" else None


async def test_requests_while_disconnected_fail_without_being_sent(tmp_path):
    client = AgentClient(LocalTransport(tmp_path / "run"))
    with pytest.raises(AgentError) as exc:
        await client.request(Request.PING)
    assert exc.value.code == "disconnected" and "was not sent" in exc.value.message


async def test_a_killed_agent_is_restarted_and_running_jobs_are_listed_again(local):
    client, recorder = local
    job = (await client.request(Request.START_JOB, name="survivor", kind="other", argv=job_argv(sys.executable)))["job"]
    first_agent = recorder.of_type("hello")[0]["agent_pid"]
    os.kill(first_agent, signal.SIGKILL)  # our own child process: the link drops hard
    await wait_until(lambda: RECONNECTING in recorder.statuses(), what="the drop to be noticed")
    await wait_until(lambda: recorder.statuses()[-1] == CONNECTED and len(recorder.of_type("hello")) == 2, what="the reconnect")
    assert recorder.of_type("hello")[1]["agent_pid"] != first_agent
    jobs = {j["name"]: j for j in (await client.request(Request.LIST_JOBS))["jobs"]}
    assert jobs["survivor"]["state"] == "running" and jobs["survivor"]["pid"] == job["pid"]
    assert pid_alive(job["pid"])


async def test_an_agent_that_cannot_start_is_reported_clearly(tmp_path):
    with pytest.raises(TransportError) as missing:
        await LocalTransport(tmp_path / "run", python=str(tmp_path / "no-python")).start()
    assert "cannot start the local agent" in str(missing.value)
    script = tmp_path / "broken-python"
    script.write_text("#!/bin/sh\necho 'agent: cannot import backend' >&2\nexit 3\n")
    script.chmod(0o755)
    with pytest.raises(TransportError) as exited:
        await LocalTransport(tmp_path / "run", python=str(script)).start()
    assert "exited before its hello" in str(exited.value) and "cannot import backend" in str(exited.value)


async def test_first_connect_is_retried_with_backoff_when_asked(tmp_path):
    marker = tmp_path / "failed-once"
    script = tmp_path / "flaky-python"
    script.write_text(f"#!/bin/sh\nif [ ! -e {marker} ]; then touch {marker}; echo 'host still booting' >&2; exit 1; fi\nexec {sys.executable} \"$@\"\n")
    script.chmod(0o755)
    transport = LocalTransport(tmp_path / "run", python=str(script), backoff_initial=0.1)
    client = AgentClient(transport)
    recorder = None
    try:
        await client.start(retry=True)
        recorder = Recorder(client)
        await wait_until(lambda: client.status.connected, what="the second attempt")
        assert marker.exists() and (await client.ping())["pong"]
        assert transport.sessions_opened == 1 and RECONNECTING in recorder.statuses()
    finally:
        if recorder:
            recorder.stop()
        await client.close()


async def test_a_reply_that_does_not_fit_the_protocol_is_an_agent_error_not_a_crash(tmp_path):
    """A stop plan whose PIDs are not numbers (the modal formats them) fails the request with bad_reply; the link goes on.
    The agent is a real separate process that answers stop_plan with a wrong-typed plan."""
    script = tmp_path / "bad_plan_agent.py"
    script.write_text(
        "import json, os, sys\n"
        "def send(m):\n    sys.stdout.write(json.dumps(m) + '\\n'); sys.stdout.flush()\n"
        "send({'type': 'hello', 'protocol': 2, 'host': 'h', 'python': '3', 'agent_pid': os.getpid(), 'run_dir': '/r', 'driver': None,"
        " 'nvml': 'none', 'gpu_source': 'none', 'sglang': None})\n"
        "for line in sys.stdin:\n"
        "    r = json.loads(line)\n"
        "    plan = {'jobs': ['j'], 'will_signal': [{'pid': {'x': 1}, 'role': 'leader'}], 'stale': [], 'foreign_gpu_holders': [], 'checkpoint_first': True}\n"
        "    send({'type': 'reply', 'id': r['id'], 'ok': True, 'result': plan if r['type'] == 'stop_plan' else {'pong': True}})\n"
    )
    wrapper = tmp_path / "bad-python"
    wrapper.write_text(f"#!/bin/sh\nexec {sys.executable} {script}\n")
    wrapper.chmod(0o755)
    client = AgentClient(LocalTransport(tmp_path / "run", python=str(wrapper), reconnect=False), timeout=20)
    await client.start()
    recorder = Recorder(client)
    try:
        await wait_until(lambda: client.status.connected, what="the fake agent's hello")
        with pytest.raises(AgentError) as bad:
            await client.request(Request.STOP_PLAN, name="j")
        assert bad.value.code == "bad_reply" and "will_signal[0].pid: expected int, got object" in bad.value.message
        assert (await client.ping())["pong"] is True
    finally:
        recorder.stop()
        await client.close()
