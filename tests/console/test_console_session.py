"""The agent conversation without Textual: a HostSession over a real local agent fills its host's state.

No Pilot and no app: a listener records what the session reports, as the app would hear it.
"""

import asyncio
import json
import sys
from pathlib import Path

from backend.protocol import Request
from console.client import AgentClient
from console.session import HostSession
from console.state import CONNECTED, ConnectionStatus, ConsoleState
from console.transport import LocalTransport
from tests.fixtures.ssh import wait_until

WRITER = """\
import os, time
from backend.metrics.records import MetricsWriter
writer = MetricsWriter(os.path.join(os.environ["EAGLE3_JOB_DIR"], "metrics.jsonl"))
for step in range(1, 31):
    writer.write({"step": step, "split": "train", "loss": 3.0 / step, "lr": 1e-4, "grad_norm": 1.0})
    if step % 10 == 0:
        writer.write({"step": step, "split": "val", "loss": 1.0, "acc": [0.5, 0.25]})
print("wrote 30 steps", flush=True)
time.sleep(600)
"""


class Recorder:
    """A SessionListener that keeps everything it hears."""

    def __init__(self):
        self.sections: list[set[str]] = []
        self.events: list = []
        self.notes: list[tuple[str, str]] = []

    def session_changed(self, session, sections):
        self.sections.append(set(sections))

    def session_event(self, session, event, sections):
        self.events.append(event)

    def session_note(self, session, text, severity):
        self.notes.append((severity, text))


def local_session(run_dir) -> tuple[HostSession, Recorder]:
    transport = LocalTransport(run_dir, backoff_initial=0.2, backoff_max=1.0)
    recorder = Recorder()
    state = ConsoleState(target=transport.label)
    return HostSession(AgentClient(transport, timeout=30), state, recorder), recorder


async def test_a_session_connects_loads_a_jobs_metrics_and_logs_and_stops_it_without_textual(tmp_path):
    session, heard = local_session(tmp_path / "run")
    pump = asyncio.create_task(session.run())
    try:
        await wait_until(lambda: session.connected, what="the agent's hello")
        assert session.state.hello is not None and session.state.hello.run_dir.endswith("run")
        await session.resync()
        assert {"hello", "jobs"} <= set().union(*heard.sections)
        await session.request(Request.START_JOB, name="writer", kind="train", argv=[sys.executable, "-c", WRITER])
        await wait_until(lambda: "writer" in session.state.jobs, what="the jobs event naming the new job")
        await wait_until(lambda: session.state.metrics.get("writer") and session.state.metrics["writer"].offset > 0, what="live metrics events")
        await asyncio.sleep(0.5)
        await session.load_metrics("writer")
        metrics = session.state.metrics["writer"]
        assert [step for step, _ in metrics.val_acc] == [10, 20, 30]
        assert metrics.latest_train["step"] == 30 and metrics.summaries[False].buckets["train.loss"]
        await session.follow_logs("writer", "stdout")
        await wait_until(lambda: "wrote 30 steps" in "\n".join(session.state.log("writer", "stdout").lines), what="the job's stdout")
        verdicts = (await session.request(Request.STOP_JOB, name="writer", grace=5, timeout=60))["verdicts"]
        assert verdicts and all(v["outcome"] in ("exited_on_term", "killed") for v in verdicts)
        await wait_until(lambda: session.state.jobs["writer"].state != "running", what="the job listed as ended")
        assert not [n for n in heard.notes if n[0] == "error"]
    finally:
        pump.cancel()
        await asyncio.gather(pump, return_exceptions=True)
        await session.close()


async def test_two_sessions_keep_two_hosts_apart(tmp_path):
    first, _ = local_session(tmp_path / "a")
    second, _ = local_session(tmp_path / "b")
    second.state.target = "second"
    pumps = [asyncio.create_task(s.run()) for s in (first, second)]
    try:
        await wait_until(lambda: first.connected and second.connected, what="both agents")
        await first.request(Request.START_JOB, name="only-on-a", kind="other", argv=[sys.executable, "-c", "import time; time.sleep(600)"])
        await first.resync()
        await second.resync()
        assert "only-on-a" in first.state.jobs and "only-on-a" not in second.state.jobs
        assert first.state.hello.run_dir != second.state.hello.run_dir
        await first.request(Request.STOP_JOB, name="only-on-a", grace=2, timeout=60)
    finally:
        for pump in pumps:
            pump.cancel()
        await asyncio.gather(*pumps, return_exceptions=True)
        await asyncio.gather(first.close(), second.close())


def test_summary_due_is_throttled_and_remembered_while_a_load_is_in_flight(tmp_path):
    session, _ = local_session(tmp_path / "never-started")  # a client that never connects: nothing is sent
    assert not session.summary_due("x", log_x=False)  # disconnected: never asked
    session.state.set_connection(ConnectionStatus(state=CONNECTED))
    assert session.summary_due("x", log_x=False)
    assert not session.summary_due("x", log_x=False)  # asked a moment ago
    assert session.summary_due("x", log_x=True)  # the log-spaced buckets are another ask
    session.state.job_metrics("y").loading = True
    assert not session.summary_due("y", log_x=False)
    assert ("y", False) in session.summary_pending  # answered when the load in flight is done


async def test_a_record_written_while_a_metrics_load_is_in_flight_is_read_before_the_load_ends(tmp_path):
    """Events that arrive during a load are held back (the load's replies cover part of them); the load reads past them
    before it ends, even when they came during its last request, so a run that then goes quiet shows its last step."""
    session, _ = local_session(tmp_path / "run")
    pump = asyncio.create_task(session.run())
    try:
        await wait_until(lambda: session.connected, what="the agent's hello")
        job = (await session.request(Request.START_JOB, name="quiet", kind="train", argv=[sys.executable, "-c", "import time; time.sleep(600)"]))["job"]
        metrics_file = Path(job["job_dir"]) / "metrics.jsonl"
        with open(metrics_file, "a") as handle:
            handle.writelines(json.dumps({"step": step, "split": "train", "loss": 1.0 / step}) + "\n" for step in (1, 2, 3))
        await wait_until(lambda: session.state.metrics.get("quiet") and session.state.metrics["quiet"].offset > 0, what="the first events")
        fetch_summary = session.fetch_summary

        async def summary_while_the_run_writes_one_more_step(name, *, log_x):
            if log_x:  # the load's last request: step 4 is written and its event arrives (held back) meanwhile
                with open(metrics_file, "a") as handle:
                    handle.write(json.dumps({"step": 4, "split": "train", "loss": 0.25}) + "\n")
                await wait_until(lambda: session.state.metrics["quiet"].seen_end == metrics_file.stat().st_size, what="step 4's event")
            await fetch_summary(name, log_x=log_x)

        session.fetch_summary = summary_while_the_run_writes_one_more_step
        await session.load_metrics("quiet", log_x_too=True)
        metrics = session.state.metrics["quiet"]
        assert metrics.train_loss.steps == [1.0, 2.0, 3.0, 4.0] and metrics.offset == metrics_file.stat().st_size
        assert not metrics.loading and not metrics.needs_catchup
        await session.request(Request.STOP_JOB, name="quiet", grace=2, timeout=60)
    finally:
        pump.cancel()
        await asyncio.gather(pump, return_exceptions=True)
        await session.close()
