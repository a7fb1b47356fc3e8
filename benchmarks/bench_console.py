"""Console speed, each number next to a peer measured in the same run.

1. Time to first frame: the console's Dashboard vs a minimal Textual app (Header + Static + Footer),
   headless in-process (Pilot) and as a subprocess on a pseudo-terminal (spawn -> first frame on the pty).
2. Training-screen frame time with 100k points per series (train loss, val loss, LR): our downsampled
   plot vs plotting the raw 100k points, each frame after one new point arrived (no cache hit).
3. End-to-end delay from a metrics line appended on the host to the console's client receiving it,
   over loopback SSH (in-process asyncssh server; real sshd too when /usr/sbin/sshd exists) vs the
   local subprocess transport. The agent polls files once per tick (1 s), which dominates the delay.

    python benchmarks/bench_console.py [--lines 50] [--points 100000] [--reps 5] [--skip-e2e] [--json OUT]
"""

from __future__ import annotations

import argparse
import asyncio
import fcntl
import json
import os
import pty
import random
import select
import statistics
import struct
import subprocess
import sys
import tempfile
import termios
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from textual.app import App
from textual.widgets import Footer, Header, Static

from backend.protocol import Request
from console.app import build_app
from console.client import AgentClient
from console.state import CONNECTED, ConnectionStatus, ConsoleState
from console.transport import LocalTransport, SSHTransport

SIZE = (160, 48)
PEER_APP = """
from textual.app import App
from textual.widgets import Footer, Header, Static

class Peer(App):
    BINDINGS = [("q", "quit", "Quit")]

    def compose(self):
        yield Header()
        yield Static("Dashboard")
        yield Footer()

Peer().run()
"""


class PeerApp(App):
    BINDINGS = [("q", "quit", "Quit")]

    def compose(self):
        yield Header()
        yield Static("Dashboard")
        yield Footer()


def summary(values: list[float]) -> dict:
    ordered = sorted(values)
    return {
        "median": statistics.median(ordered),
        "p95": ordered[min(len(ordered) - 1, int(round(0.95 * (len(ordered) - 1))))],
        "min": ordered[0],
        "max": ordered[-1],
        "n": len(ordered),
    }


# -- 1. time to first frame ----------------------------------------------------------------------


async def headless_first_frame(make_app) -> float:
    start = time.perf_counter()
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await pilot.pause()  # the first screen is composed, mounted and refreshed
        elapsed = time.perf_counter() - start
    return elapsed


def pty_first_frame(argv: list[str], marker: bytes, cwd: Path, timeout: float = 60.0) -> float:
    """Spawn argv on a pseudo-terminal; seconds until `marker` first appears in what it draws."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", SIZE[1], SIZE[0], 0, 0))
    env = dict(os.environ, TERM="xterm-256color", COLUMNS=str(SIZE[0]), LINES=str(SIZE[1]))
    start = time.perf_counter()
    proc = subprocess.Popen(argv, stdin=slave, stdout=slave, stderr=slave, cwd=cwd, env=env, start_new_session=True)
    os.close(slave)
    seen = b""
    elapsed = None
    try:
        while time.perf_counter() - start < timeout:
            ready, _, _ = select.select([master], [], [], 0.5)
            if not ready:
                continue
            try:
                seen += os.read(master, 65536)
            except OSError:
                break
            if marker in seen:
                elapsed = time.perf_counter() - start
                break
        os.write(master, b"q")
        deadline = time.monotonic() + 20
        while proc.poll() is None and time.monotonic() < deadline:
            select.select([master], [], [], 0.2)
            try:
                os.read(master, 65536)
            except OSError:
                pass
    finally:
        if proc.poll() is None:
            proc.terminate()
            proc.wait(10)
        os.close(master)
    if elapsed is None:
        raise RuntimeError(f"{argv[0]} drew no {marker!r} within {timeout}s")
    return elapsed


def bench_first_frame(reps: int) -> dict:
    ours_headless = [asyncio.run(headless_first_frame(lambda: build_app(state=ConsoleState(), poll_interval=None))) for _ in range(reps)]
    peer_headless = [asyncio.run(headless_first_frame(PeerApp)) for _ in range(reps)]
    with tempfile.TemporaryDirectory() as tmp:
        peer_script = Path(tmp) / "peer_app.py"
        peer_script.write_text(PEER_APP)
        console = [sys.executable, "-m", "console.cli", "--run-dir", str(Path(tmp) / "run")]
        ours_pty = [pty_first_frame(console, b"Dashboard", ROOT) for _ in range(reps)]
        peer_pty = [pty_first_frame([sys.executable, str(peer_script)], b"Dashboard", ROOT) for _ in range(reps)]
    result = {
        "headless_console_s": summary(ours_headless),
        "headless_minimal_textual_s": summary(peer_headless),
        "subprocess_console_s": summary(ours_pty),
        "subprocess_minimal_textual_s": summary(peer_pty),
    }
    result["headless_ratio"] = result["headless_console_s"]["median"] / result["headless_minimal_textual_s"]["median"]
    result["subprocess_ratio"] = result["subprocess_console_s"]["median"] / result["subprocess_minimal_textual_s"]["median"]
    return result


# -- 2. Training-screen frame time with 100k points per series -----------------------------------------


def long_run_state(points: int) -> ConsoleState:
    state = ConsoleState(target="bench", clock=lambda: 0.0)
    state.set_connection(ConnectionStatus(state=CONNECTED))
    rng = random.Random(0)
    records = []
    for step in range(1, points + 1):
        loss = 6.0 / (1 + step / 5000) + rng.gauss(0, 0.05) + (4.0 if step % 25_000 == 0 else 0.0)
        records.append({"step": step, "split": "train", "loss": loss, "lr": 3e-4 * (1 - step / (points + 1)) + 1e-7})
        records.append({"step": step, "split": "val", "loss": loss + 0.3, "acc": [0.7, 0.6, 0.5]})
    state.apply_metrics_history("run", {"records": records, "offset": 1}, reset=True)
    return state


async def training_frame_times(state: ConsoleState, raw: bool, reps: int) -> list[float]:
    app = build_app(state=state, poll_interval=None, refresh_throttle=0, raw_plots=raw)
    times = []
    async with app.run_test(size=SIZE) as pilot:
        app.select_job("run")
        await pilot.press("2")
        await pilot.pause()
        screen = app.screen
        plots = [screen.query_one("#loss-plot"), screen.query_one("#lr-plot")]
        metrics = state.metrics["run"]
        for rep in range(reps):
            step = metrics.train_loss.steps[-1] + 1
            metrics.add({"step": step, "split": "train", "loss": 1.0, "lr": 1e-7})  # a new point: caches are stale
            metrics.add({"step": step, "split": "val", "loss": 1.3, "acc": [0.7]})
            start = time.perf_counter()
            screen.show_state({"metrics"})
            for plot in plots:
                plot.render()  # plotext build of what is plotted: the cost of one frame
            times.append(time.perf_counter() - start)
    return times


def bench_training_frame(points: int, reps: int) -> dict:
    state = long_run_state(points)
    ours = asyncio.run(training_frame_times(state, raw=False, reps=reps))
    raw = asyncio.run(training_frame_times(long_run_state(points), raw=True, reps=max(2, reps // 2)))
    result = {"points_per_series": points, "downsampled_frame_s": summary(ours), "raw_frame_s": summary(raw)}
    result["raw_over_downsampled"] = result["raw_frame_s"]["median"] / result["downsampled_frame_s"]["median"]
    return result


# -- 3. metrics line on the host -> console state --------------------------------------------------------


JOB = "import time; time.sleep(3600)"


async def e2e_delays(transport, lines: int) -> tuple[list[float], list[float]]:
    """(delays of `lines` metrics lines from file append to the client, ping round trips) over one transport."""
    client = AgentClient(transport, timeout=60)
    await client.start()
    received: dict[int, float] = {}

    async def listen():
        while True:
            event = await client.next_event()
            if isinstance(event, dict) and event.get("type") == "metrics" and event.get("job") == "bench-e2e":
                now = time.time()
                for record in event["records"]:
                    received.setdefault(record["step"], now)

    listener = asyncio.create_task(listen())
    try:
        while not client.status.connected:
            await asyncio.sleep(0.02)
        job = (await client.request(Request.START_JOB, name="bench-e2e", kind="other", argv=[sys.executable, "-c", JOB]))["job"]
        path = Path(job["job_dir"]) / "metrics.jsonl"
        await asyncio.sleep(1.5)  # the agent follows the new job's file from its next tick
        written: dict[int, float] = {}
        rng = random.Random(1)
        for step in range(lines):
            written[step] = time.time()
            with open(path, "a") as handle:
                handle.write(json.dumps({"step": step, "split": "train", "loss": 1.0, "time": written[step]}) + "\n")
            deadline = time.monotonic() + 10
            while step not in received and time.monotonic() < deadline:
                await asyncio.sleep(0.002)
            await asyncio.sleep(rng.uniform(0.0, 1.0))  # spread writes over the phases of the agent's 1 s tick
        await client.request(Request.STOP_JOB, name="bench-e2e", grace=2, timeout=60)
        round_trips = []
        for _ in range(lines):
            start = time.perf_counter()
            await client.request(Request.PING)
            round_trips.append(time.perf_counter() - start)
    finally:
        listener.cancel()
        await client.close()
    missing = [s for s in written if s not in received]
    if missing:
        raise RuntimeError(f"{len(missing)} metrics lines never reached the console: {missing[:5]}")
    return [received[s] - written[s] for s in sorted(written)], round_trips


async def e2e_over_inprocess_ssh(tmp: Path, lines: int) -> tuple[list[float], list[float]]:
    from tests.fixtures.ssh import InProcessSSHServer

    server = await InProcessSSHServer(tmp / "ssh").start()
    try:
        env = server.env()
        env.pin_host_key()
        transport = SSHTransport(
            "127.0.0.1",
            port=env.port,
            user="bench",
            identity=str(env.client_key),
            known_hosts=str(env.known_hosts),
            python=sys.executable,
            run_dir=str(tmp / "host-run-inproc"),
            config=None,
        )
        return await e2e_delays(transport, lines)
    finally:
        await server.stop()


async def e2e_over_real_sshd(tmp: Path, lines: int) -> tuple[list[float], list[float]]:
    from tests.fixtures.ssh import RealSSHD

    server = RealSSHD(tmp / "sshd").start()
    try:
        env = server.env()
        env.pin_host_key()
        transport = SSHTransport(
            "127.0.0.1",
            port=env.port,
            user=env.user,
            identity=str(env.client_key),
            known_hosts=str(env.known_hosts),
            python=sys.executable,
            run_dir=str(tmp / "host-run-sshd"),
            config=None,
        )
        return await e2e_delays(transport, lines)
    finally:
        server.stop()


def bench_e2e(lines: int) -> dict:
    from tests.fixtures.ssh import sshd_available

    with tempfile.TemporaryDirectory() as name:
        tmp = Path(name)
        saved = {key: os.environ.get(key) for key in ("HOME", "SSH_AUTH_SOCK")}
        os.environ["HOME"] = str(tmp / "home")  # keep asyncssh away from the real ~/.ssh
        os.environ.pop("SSH_AUTH_SOCK", None)
        try:
            runs = {
                "local_subprocess": asyncio.run(e2e_delays(LocalTransport(tmp / "run-local"), lines)),
                "inprocess_asyncssh": asyncio.run(e2e_over_inprocess_ssh(tmp, lines)),
            }
            if sshd_available():
                runs["openssh_sshd"] = asyncio.run(e2e_over_real_sshd(tmp, lines))
        finally:
            for key, value in saved.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value
    result = {}
    for name, (delays, round_trips) in runs.items():
        result[f"{name}_metrics_delay_s"] = summary(delays)
        result[f"{name}_ping_rtt_s"] = summary(round_trips)
    for name in runs:
        if name != "local_subprocess":
            for what in ("metrics_delay", "ping_rtt"):
                result[f"{name}_{what}_over_local"] = result[f"{name}_{what}_s"]["median"] / result[f"local_subprocess_{what}_s"]["median"]
    return result


# -- report ---------------------------------------------------------------------------------------


def show(title: str, values: dict) -> None:
    print(f"\n== {title}")
    for key, value in values.items():
        if isinstance(value, dict):
            print(f"  {key:<46} median {value['median'] * 1000:9.1f} ms   p95 {value['p95'] * 1000:9.1f} ms   (n={value['n']})")
        elif isinstance(value, float):
            print(f"  {key:<46} {value:9.2f}x")
        else:
            print(f"  {key:<46} {value}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lines", type=int, default=50, help="metrics lines per transport for the end-to-end delay")
    parser.add_argument("--points", type=int, default=100_000, help="points per series on the Training screen")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--skip-e2e", action="store_true")
    parser.add_argument("--json", help="also write the numbers to this file")
    args = parser.parse_args()
    results = {}
    results["first_frame"] = bench_first_frame(args.reps)
    show("time to first frame (console / minimal Textual app)", results["first_frame"])
    results["training_frame"] = bench_training_frame(args.points, args.reps)
    show(f"Training screen frame, {args.points} points per series (raw / downsampled)", results["training_frame"])
    if not args.skip_e2e:
        results["e2e_metrics_delay"] = bench_e2e(args.lines)
        show("metrics line written on the host -> console (SSH / local subprocess)", results["e2e_metrics_delay"])
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
