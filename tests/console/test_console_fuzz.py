"""A hostile host: the console stays up, bounded and responsive whatever its agent sends.

The "agent" is a real separate process speaking the agent's JSON-lines protocol (a script run as the local
transport's agent command): it floods random events with wrong types, missing fields, unknown enum values,
oversized lines (several MiB, and one over the line cap), escape-laden strings, 200,000 fake GPUs and lines
that are not JSON, and answers requests with garbage (ping alone is answered truthfully, to show the link
still works). The console must keep folding (the connection goes on), refuse into the host's notes, keep
every cap, and keep its event loop free (a `q` is handled within a second).
"""

import asyncio
import fcntl
import os
import pty
import select
import struct
import subprocess
import sys
import termios
import time
from collections import deque
from dataclasses import is_dataclass
from pathlib import Path

from console.app import build_app
from console.client import AgentClient
from console.session import HostSession
from console.state import GPUS_MAX, JOBS_MAX, LOG_BUFFERS_MAX, LOG_LINES_KEPT, METRICS_JOBS_MAX, STRING_CAP, ConsoleState
from tests.fixtures.ssh import wait_until
from tests.fixtures.env import ROOT
from tests.fixtures.hostile import hostile_transport


class Heard:
    def __init__(self):
        self.notes: list[tuple[str, str]] = []

    def session_changed(self, session, sections):
        pass

    def session_event(self, session, event, sections):
        pass

    def session_note(self, session, text, severity):
        self.notes.append((severity, text))


def deep_size(root) -> int:
    """Bytes held by an object graph (containers, dataclasses, strings), each object counted once."""
    seen: set[int] = set()
    total = 0
    stack = [root]
    while stack:
        obj = stack.pop()
        if id(obj) in seen or callable(obj):
            continue
        seen.add(id(obj))
        total += sys.getsizeof(obj)
        if isinstance(obj, dict):
            stack += [*obj.keys(), *obj.values()]
        elif isinstance(obj, (list, tuple, set, frozenset, deque)):
            stack += list(obj)
        elif is_dataclass(obj):
            stack += list(vars(obj).values())
    return total


def runqueue_wait() -> float:
    """Seconds this thread has waited for a CPU while runnable (Linux schedstat; 0 where the kernel does not say)."""
    try:
        return int(Path("/proc/thread-self/schedstat").read_text().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return 0.0


async def loop_lag_while(condition, each=lambda: None, interval: float = 0.05) -> float:
    """The worst lateness of a 50 ms timer while condition() holds, less the time the loop's thread waited for a CPU
    meanwhile: how long a key press would wait for the loop because of this process (a callback that computes, a
    blocking read, a thread holding the GIL), not because the machine is busy with other processes (2026-12-04, CI:
    1.03 s late on 2 cores shared with the other test worker and the hostile agent)."""
    worst = 0.0
    while condition():
        before, waited_before = time.monotonic(), runqueue_wait()
        await asyncio.sleep(interval)
        late = time.monotonic() - before - interval
        worst = max(worst, late - (runqueue_wait() - waited_before))
        each()
    return worst


def strings(state: ConsoleState):
    for job in state.jobs.values():
        yield from (job.name, job.cmdline if hasattr(job, "cmdline") else "", *job.argv, job.job_dir)
    for gpu in state.gpus:
        yield from (gpu.name, gpu.uuid)
    for buffer in state.logs.values():
        yield from buffer.lines
    yield from state.agent_stderr
    yield from state.job_details.values()


async def test_a_hostile_agent_cannot_freeze_crash_or_bloat_a_host_session(tmp_path):
    """Over 8 s of flood from a real process: the pump keeps folding, every refusal is a note, caps hold, the loop stays free."""
    heard = Heard()
    state = ConsoleState(target="hostile")
    session = HostSession(AgentClient(hostile_transport(tmp_path, seed=7), timeout=20), state, heard)
    pump = asyncio.create_task(session.run())
    try:
        await wait_until(lambda: session.connected, what="the hostile agent's hello")
        deadline = time.monotonic() + 8.0
        seen: set[str] = set()  # every note while it is in the (bounded) deque
        lag = await loop_lag_while(lambda: time.monotonic() < deadline, lambda: seen.update(text for _, text in state.notes))
        over_cap_reported = lambda: any("65.0 MiB" in text and "line cap" in text for text in seen)  # noqa: E731
        # the 65 MiB line leaves the agent at 1 s; on a loaded machine reading it through the flood can take past 8 s
        lag = max(
            lag,
            await loop_lag_while(lambda: not over_cap_reported() and time.monotonic() < deadline + 30, lambda: seen.update(text for _, text in state.notes)),
        )
        assert not pump.done(), pump.exception() if pump.done() else None  # the pump did not die on any event
        assert session.connected and session.events_seen > 200
        pong = await session.request("ping")
        assert pong["pong"] is True  # the connection goes on, and answers
        assert lag < 1.0, f"the event loop was blocked for {lag:.2f}s by the flood"
        assert state.notes_added > 50 and any("refused" in text or "left out" in text for _, text in state.notes)
        assert over_cap_reported(), "the 65 MiB line was not reported"
        assert heard.notes and len(heard.notes) <= 8 / 5 + 2  # refusals are told at most once per 5 s, not per event
        assert len(state.gpus) <= GPUS_MAX and len(state.jobs) <= JOBS_MAX and len(state.logs) <= LOG_BUFFERS_MAX
        assert len(state.metrics) <= METRICS_JOBS_MAX and all(len(b.lines) <= LOG_LINES_KEPT for b in state.logs.values())
        assert all(len(text) <= STRING_CAP + 40 for text in strings(state)), "a string field was kept uncut"
        assert all(isinstance(job.pid, int) and job.state in ("running", "exited") for job in state.jobs.values())
        assert deep_size(state) < 64 << 20, f"the state holds {deep_size(state) / 2**20:.0f} MiB"
        for garbage in ("snapshot", "holders", "stop_plan", "list_checkpoints"):  # garbage replies: an error, never a crash
            try:
                await session.request(garbage, name="job-1")
            except Exception as exc:
                assert type(exc).__name__ == "AgentError", exc
    finally:
        pump.cancel()
        await asyncio.gather(pump, return_exceptions=True)
        await session.close()


async def test_the_app_quits_on_q_within_a_second_while_a_host_floods_it(tmp_path):
    app = build_app(hostile_transport(tmp_path, seed=11), poll_interval=1.0, refresh_throttle=0.2)
    async with app.run_test(size=(140, 45)) as pilot:
        await wait_until(lambda: app.active.events_seen > 200, what="the flood to reach the app")
        for key in ("2", "3", "1"):  # the screens draw the hostile state
            await pilot.press(key)
            await pilot.pause(0.3)
        assert app.is_running and app.active.connected
        pressed = time.monotonic()
        await pilot.press("q")
        await wait_until(lambda: not app.is_running or app._exit_renderables is not None or app.return_code is not None, timeout=10, what="the exit")
        quit_after = time.monotonic() - pressed
    assert quit_after < 1.0, f"q took {quit_after:.2f}s to be handled"
    assert app.return_code in (0, None)


# Sequences only the hostile host sends: Textual itself never writes an OSC 52 clipboard write, a window title of
# "owned", a C1 CSI or a bidi override, so any of them on the terminal came from the host unsanitized.
HOST_ONLY = (b"\x1b]52;", b"\x1b]0;owned", b"\xc2\x9b", "\u202e".encode())

PTY_CONSOLE = r"""
import sys
sys.path.insert(0, sys.argv[1])
from pathlib import Path
from tests.fixtures.hostile import hostile_transport
from console.app import build_app
build_app(hostile_transport(Path(sys.argv[2]), seed=5), poll_interval=1.0, refresh_throttle=0.2).run()
"""


def test_nothing_the_hostile_host_sends_reaches_a_real_terminal_raw(tmp_path):
    """The real app on a pseudo-terminal: once the flood is on screen (its escapes drawn visibly), every screen is
    shown, the filter opened and closed, and the app quit; no host-only sequence is among all the bytes it wrote."""
    main, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 45, 140, 0, 0))
    env = {**os.environ, "TERM": "xterm-256color"}
    command = [sys.executable, "-c", PTY_CONSOLE, str(ROOT), str(tmp_path)]
    process = subprocess.Popen(command, stdin=follower, stdout=follower, stderr=follower, env=env, start_new_session=True)
    os.close(follower)
    written = bytearray()

    def read_for(seconds: float, until: bytes | None = None) -> None:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline and process.poll() is None and not (until and until in written):
            if select.select([main], [], [], 0.05)[0]:
                try:
                    written.extend(os.read(main, 1 << 16))
                except OSError:
                    return

    try:
        read_for(60, until=b"job-")  # the hostile jobs are drawn (their names carry escapes)
        read_for(2)
        for key in (b"2", b"3", b"1", b"/", b"\x1b", b"q"):
            os.write(main, key)
            read_for(1.5)
        read_for(10)
    finally:
        if process.poll() is None:
            process.kill()
        process.wait()
        os.close(main)
    assert b"job-" in written, f"the hostile jobs never reached the screen: {bytes(written[-800:])!r}"
    leaked = [marker for marker in HOST_ONLY if marker in written]
    assert not leaked, f"host sequences reached the terminal raw: {leaked}"
    assert b"\\x1b" in written  # they are on screen, visibly escaped
    assert b"CancelledError" not in written  # a poll replaced by the next one is no failure to report
