"""Long runs: a grokking-length metrics history, each number next to a peer measured in the same run.

1. Cold index (a history the agent never saw): MiB/s of CPU time on one core, vs json.loads of every line,
   and vs the agent's previous read path (json.loads + normalize_record per record) on a sample.
2. Warm query: `eagle3-host metrics series --points 200 --json` (a new process reading the saved index),
   vs `grep '"val"' metrics.jsonl | tail` on the same file.
3. Attach over loopback SSH (OpenSSH sshd when /usr/sbin/sshd exists, else an in-process asyncssh server):
   warm: select the job -> whole-history curve drawn on the Training screen; cold: select -> newest records
   shown (metrics_window) and -> the whole history indexed, with the progress events counted.
4. Training-screen frame at 2k, 100k and 1M points per series x 3 series (the host's buckets plus the live tail):
   prepare + render_lines of the three plots with our canvas (console/widgets/curve_plot.py) vs the previous
   plotext widget (console/widgets/plotext_plot.py) on the same state; target <= 16 ms (`--frame-only` runs only this).
5. Live lag (file append on the host -> console client) p50/p99 at 10 lines/s over the same SSH link,
   and the agent's CPU (percent of one core) idle and under that load.
6. Peak RSS of the console process and of the agent with the history attached, vs holding the history
   as records (measured on a 100k-record sample, scaled).

    python benchmarks/bench_long_run.py [--size-mib 1024] [--dir /tmp/eagle3-long-run] [--frame-only] [--json OUT]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from backend.jobs.registry import JobRegistry
from backend.metrics.records import normalize_record
from backend.metrics.index import MetricsFeed
from backend.layout import INDEX_FILENAME, METRICS_FILENAME
from backend.protocol import Request
from backend.metrics.series import Series, query
from bench_cold_index import train_record, val_record  # noqa: E402  (the trainer-shaped records, one home)
from bench_console import show, summary  # noqa: E402

SIZE = (160, 48)
SLEEPER = "import time; time.sleep(3600)"


# -- the history ----------------------------------------------------------------------------------


def generate(path: Path, size_bytes: int, seed: int = 0) -> int:
    """A metrics.jsonl shaped like the trainer's (train every step, val every 1000), with NaN losses and spikes."""
    rng = random.Random(seed)
    step = 0
    with open(path, "w") as handle:
        while handle.tell() < size_bytes:
            lines = []
            for _ in range(1000):
                step += 1
                lines.append(json.dumps(train_record(step, rng), separators=(",", ":")))
            lines.append(json.dumps(val_record(step, rng), separators=(",", ":")))
            handle.write("\n".join(lines) + "\n")
    return step


def history_file(directory: Path, size_mib: int) -> Path:
    path = directory / f"history-{size_mib}mib.jsonl"
    if not path.exists() or path.stat().st_size < size_mib << 20:
        print(f"generating {size_mib} MiB of metrics at {path} ...", flush=True)
        generate(path.with_suffix(".tmp"), size_mib << 20)
        path.with_suffix(".tmp").replace(path)
    return path


# -- 1. cold index ---------------------------------------------------------------------------------


def bench_cold_index(path: Path, sidecar: Path) -> dict:
    mib = path.stat().st_size / 2**20
    sidecar.unlink(missing_ok=True)
    started, cpu = time.perf_counter(), time.process_time()
    feed = MetricsFeed(path, sidecar, live_from_end=True)
    while feed.index_step():
        pass
    ours_cpu, ours_wall = time.process_time() - cpu, time.perf_counter() - started
    started = time.perf_counter()
    feed.save_sidecar()
    save_s = time.perf_counter() - started

    cpu = time.process_time()
    carry = b""
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(8 << 20), b""):
            lines = (carry + block).split(b"\n")
            carry = lines.pop()
            for line in lines:
                if line:
                    json.loads(line)
    peer_cpu = time.process_time() - cpu

    sample = 64 << 20
    cpu = time.process_time()
    with open(path, "rb") as handle:
        data = handle.read(sample)
    for line in data[: data.rfind(b"\n")].split(b"\n"):
        normalize_record(json.loads(line))
    old_cpu = (time.process_time() - cpu) * (path.stat().st_size / sample)
    return {
        "file_mib": round(mib, 1),
        "records": feed.index.total_records,
        "ours_cpu_s": ours_cpu,
        "ours_wall_s": ours_wall,
        "ours_mib_per_cpu_s": mib / ours_cpu,
        "peer_json_loads_cpu_s": peer_cpu,
        "peer_json_loads_mib_per_cpu_s": mib / peer_cpu,
        "old_path_json_loads_normalize_cpu_s_scaled": old_cpu,
        "ours_over_json_loads": peer_cpu / ours_cpu,
        "ours_over_old_path": old_cpu / ours_cpu,
        "sidecar_mib": round(sidecar.stat().st_size / 2**20, 2),
        "sidecar_save_s": save_s,
    }


# -- 2. warm query ---------------------------------------------------------------------------------


def timed(argv: list[str], shell: bool = False) -> tuple[float, str]:
    started = time.perf_counter()
    out = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, shell=shell, check=True).stdout
    return time.perf_counter() - started, out


def bench_warm_query(path: Path, reps: int = 5) -> dict:
    ours = [timed([sys.executable, "-m", "backend", "metrics", "series", "--file", str(path), "--points", "200", "--json"])[0] for _ in range(reps)]
    peer = [timed(f"grep '\"val\"' {path} | tail -n 5", shell=True)[0] for _ in range(reps)]
    _, out = timed([sys.executable, "-m", "backend", "metrics", "series", "--file", str(path), "--points", "200", "--json"])
    document = json.loads(out)
    return {
        "ours_metrics_series_s": summary(ours),
        "peer_grep_val_tail_s": summary(peer),
        "ours_over_peer": summary(ours)["median"] / summary(peer)["median"],
        "buckets": len(document["buckets"]),
        "nonfinite_in_buckets": sum(b["nonfinite"] for b in document["buckets"]),
    }


# -- 3 + 5 + 6. over SSH -------------------------------------------------------------------------------


def ssh_server(tmp: Path, run_dir: Path):
    """(kind, a transport factory to call inside the event loop, stop): OpenSSH's sshd on 127.0.0.1, else the local subprocess."""
    from console.transport import LocalTransport, SSHTransport
    from tests.fixtures.ssh import RealSSHD, sshd_available

    if not sshd_available():
        return "local_subprocess (no /usr/sbin/sshd)", lambda: LocalTransport(run_dir), lambda: None
    server = RealSSHD(tmp / "sshd").start()
    env = server.env()
    env.pin_host_key()

    def make():
        return SSHTransport(
            "127.0.0.1",
            port=env.port,
            user=env.user,
            identity=str(env.client_key),
            known_hosts=str(env.known_hosts),
            python=sys.executable,
            run_dir=str(run_dir),
            config=None,
        )

    return "openssh_sshd", make, server.stop


def agent_cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def peak_rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return math.nan


async def wait_for(predicate, timeout: float, what: str) -> float:
    started = time.perf_counter()
    while not predicate():
        if time.perf_counter() - started > timeout:
            raise TimeoutError(f"timed out after {timeout:g}s waiting for {what}")
        await asyncio.sleep(0.005)
    return time.perf_counter() - started


async def attach(make_transport, records: int, live_lines: int) -> dict:
    from console.app import build_app

    app = build_app(make_transport(), poll_interval=None, refresh_throttle=0)
    result: dict = {}
    progress_events = []
    original = app.session_event  # every folded host event reaches the app here (console/session.py)

    def counting(session, event, changed):
        if isinstance(event, dict) and event.get("type") == "index_progress":
            progress_events.append(event)
        original(session, event, changed)

    app.session_event = counting
    async with app.run_test(size=SIZE) as pilot:
        try:
            await wait_for(lambda: app.state.connection.connected and app.state.hello, 60, "the agent")
        except TimeoutError:
            raise RuntimeError(f"no agent over SSH: {app.state.connection} {list(app.state.agent_stderr)[-5:]}") from None
        agent_pid = app.state.hello.agent_pid
        await pilot.press("2")
        await asyncio.sleep(1.0)
        rss = lambda: round(peak_rss_mib(os.getpid()), 1)  # noqa: E731 - VmHWM: ru_maxrss would carry the parent's peak across exec
        result["console_rss_mib_connected"] = rss()

        started = time.perf_counter()
        app.select_job("warm")
        metrics = lambda: app.state.metrics.get("warm")
        await wait_for(lambda: metrics() and metrics().summary(False) and metrics().history_loaded, 60, "the warm history")
        app.redraw_now()
        plot = app.screen.query_one("#loss-plot")
        plot.render()
        result["warm_attach_to_curve_s"] = time.perf_counter() - started
        result["warm_curve_points_drawn"] = sum(len(b) for b in metrics().summary(False).buckets.values())
        result["console_rss_mib_warm_attached"] = rss()

        started = time.perf_counter()
        app.select_job("cold")
        cold = lambda: app.state.metrics.get("cold")
        result["cold_attach_to_newest_records_s"] = await wait_for(
            lambda: cold() and cold().history_loaded and len(cold().train_loss) > 0, 60, "the newest records"
        )
        await wait_for(lambda: progress_events and progress_events[-1].get("caught_up"), 1800, "the cold index")
        result["cold_attach_to_indexed_s"] = time.perf_counter() - started
        result["cold_progress_events"] = len(progress_events)
        result["console_rss_mib_cold_indexed"] = rss()
        await wait_for(lambda: cold().total_records == records, 60, "the refreshed summary")
        result["console_peak_rss_mib"] = rss()
        result["agent_peak_rss_mib"] = peak_rss_mib(agent_pid)
        await asyncio.sleep(2.0)
        cpu_before, t0 = agent_cpu_s(agent_pid), time.monotonic()
        await asyncio.sleep(10.0)
        result["agent_cpu_idle_pct_of_core"] = 100 * (agent_cpu_s(agent_pid) - cpu_before) / (time.monotonic() - t0)

        lag, cpu_load = await live_lag(app, agent_pid, live_lines)
        result["live_lag_s"] = lag
        result["agent_cpu_at_10_lines_per_s_pct_of_core"] = cpu_load
        await app.client.request(Request.STOP_JOB, all=True, grace=2, timeout=60)
    return result


async def live_lag(app, agent_pid: int, lines: int) -> tuple[dict, float]:
    job = (await app.client.request(Request.START_JOB, name="live", kind="other", argv=[sys.executable, "-c", SLEEPER]))["job"]
    path = Path(job["job_dir"]) / METRICS_FILENAME
    received: dict[int, float] = {}
    original = app.session_event

    def stamping(session, event, changed):
        if isinstance(event, dict) and event.get("type") == "metrics" and event.get("job") == "live":
            now = time.time()
            for record in event.get("records") or []:
                received.setdefault(record["step"], now)
        original(session, event, changed)

    app.session_event = stamping
    await asyncio.sleep(1.0)
    written: dict[int, float] = {}
    cpu_before, t0 = agent_cpu_s(agent_pid), time.monotonic()
    for step in range(lines):
        written[step] = time.time()
        with open(path, "a") as handle:
            handle.write(json.dumps({"step": step, "split": "train", "loss": 1.0, "time": written[step]}) + "\n")
        await asyncio.sleep(max(0.0, t0 + (step + 1) * 0.1 - time.monotonic()))
    await asyncio.sleep(1.0)
    cpu = 100 * (agent_cpu_s(agent_pid) - cpu_before) / (time.monotonic() - t0)
    missing = [s for s in written if s not in received]
    if missing:
        raise RuntimeError(f"{len(missing)} live lines never reached the console")
    delays = sorted(received[s] - written[s] for s in written)
    lag = summary(delays)
    lag["p99"] = delays[min(len(delays) - 1, int(round(0.99 * (len(delays) - 1))))]
    return lag, cpu


def bench_attach(path: Path, records: int, live_lines: int) -> dict:
    with tempfile.TemporaryDirectory(dir=path.parent) as name:
        tmp = Path(name)
        run_dir = tmp / "run"
        registry = JobRegistry(run_dir)
        for job, sidecar in (("warm", True), ("cold", False)):
            info = registry.start_job(job, "train", [sys.executable, "-c", SLEEPER])
            os.link(path, Path(info.job_dir) / METRICS_FILENAME)
            if sidecar:
                shutil.copy(path.with_name(INDEX_FILENAME), Path(info.job_dir) / INDEX_FILENAME)
        saved = {key: os.environ.get(key) for key in ("HOME", "SSH_AUTH_SOCK")}
        os.environ["HOME"] = str(tmp / "home")
        os.environ.pop("SSH_AUTH_SOCK", None)
        kind, make_transport, stop = ssh_server(tmp, run_dir)
        try:
            result = {"transport": kind, **asyncio.run(attach(make_transport, records, live_lines))}
        finally:
            stop()
            registry.stop(all_jobs=True, grace=1)
            for key, value in saved.items():
                os.environ.pop(key, None) if value is None else os.environ.__setitem__(key, value)
    return result


# -- 4. frame time ------------------------------------------------------------------------------


def frame_states(points: int):
    from console.state import CONNECTED, ConnectionStatus, ConsoleState

    rng = random.Random(0)
    steps = list(range(1, points + 1))
    values = {
        "train.loss": [6.0 / (1 + s / 5000) + rng.gauss(0, 0.05) for s in steps],
        "val.loss": [6.3 / (1 + s / 5000) for s in steps],
        "lr": [3e-4 * (1 - s / (points + 1)) + 1e-7 for s in steps],
        "grad_norm": [0.5 + rng.random() for _ in steps],  # the Grokking screen's norms (buckets only)
        "weight_norm": [120 + s * 1e-6 for s in steps],
    }
    ours = ConsoleState(target="bench", clock=lambda: 0.0)
    ours.set_connection(ConnectionStatus(state=CONNECTED))
    series = {}
    for key, column in values.items():
        series[key] = Series()
        series[key].add(steps, column)
    reply = {
        "series": {k: query(s, 1, points, 512) for k, s in series.items()},
        "step_range": [1, points],
        "points": 512,
        "log_x": False,
        "total_records": points,
    }
    ours.apply_series("run", reply)
    ours.apply_window("run", {"records": [{"step": s, "split": "train", "loss": 1.0, "lr": 1e-7} for s in steps[-2000:]], "offset": 1})
    raw = ConsoleState(target="bench", clock=lambda: 0.0)
    raw.set_connection(ConnectionStatus(state=CONNECTED))
    metrics = raw.job_metrics("run")
    metrics.train_loss.steps, metrics.train_loss.values = [float(s) for s in steps], values["train.loss"]
    metrics.val_loss.steps, metrics.val_loss.values = [float(s) for s in steps], values["val.loss"]
    metrics.lr.steps, metrics.lr.values = [float(s) for s in steps], values["lr"]
    metrics.history_loaded = True
    return ours, raw


FRAME_POINTS = (2_000, 100_000, 1_000_000)
FRAME_BUDGET_S = 1 / 60  # a terminal at 60 Hz


SCREEN_PLOTS = {"training": 3, "grokking": 4}


async def frame_times(state, plot_class, reps: int, screen_name: str = "training", full: bool = False) -> tuple[list[float], list[float], list[float]]:
    """(whole frames, their prepare part, the CPU time of the whole frames) of the Training (or Grokking) screen drawn
    with `plot_class`, in seconds (on a shared machine the CPU time is the steadier of the two).

    A frame: a new train and val point arrive (every cache is stale), the screen's show_state prepares the curves
    (buckets + live tail -> downsampled, transformed points), each plot lays itself out and refreshes the rows that
    changed (CurvePlot.repaint_changed_rows, which the app runs right after the handler; the peer refreshed all of
    itself in show_state), then each plot renders its lines to segments through render_lines, the call Textual's
    compositor makes when it paints a widget. `full`: every row is repainted, as after a zoom or a resize."""
    from textual.geometry import Region

    from console.app import build_app
    from console.screens import grokking, training

    saved = training.CurvePlot
    training.CurvePlot = grokking.CurvePlot = plot_class  # the screens query their plots by this name
    plot_count = SCREEN_PLOTS[screen_name]
    try:
        app = build_app(state=state, poll_interval=None, refresh_throttle=0)
        frames: list[float] = []
        prepares: list[float] = []
        cpus: list[float] = []
        async with app.run_test(size=SIZE) as pilot:
            app.select_job("run")
            await app.switch_mode(screen_name)  # what its key (2 / 4) does
            await pilot.pause()
            screen = app.screen
            plots = list(screen.query(plot_class))
            assert len(plots) == plot_count, plots
            metrics = state.metrics["run"]
            for rep in range(reps + 1):  # the first frame warms caches that a running console has warm
                step = metrics.train_loss.steps[-1] + 1
                metrics.add({"step": step, "split": "train", "loss": 1.0, "lr": 1e-7})
                metrics.add({"step": step, "split": "val", "loss": 1.3, "acc": [0.7]})
                start, cpu = time.perf_counter(), time.thread_time()
                screen.show_state({"metrics"})
                prepared = time.perf_counter()
                for plot in plots:  # what runs right after the handler: layout, Strips, refresh of the changed rows
                    getattr(plot, "repaint_changed_rows", lambda: None)()
                    if full:
                        plot.refresh()
                for plot in plots:
                    lines = plot.render_lines(Region(0, 0, plot.size.width, plot.size.height))
                    assert len(lines) == plot.size.height
                done, cpu_done = time.perf_counter(), time.thread_time()
                if rep:
                    frames.append(done - start)
                    prepares.append(prepared - start)
                    cpus.append(cpu_done - cpu)
                await pilot.pause()
    finally:
        training.CurvePlot = grokking.CurvePlot = saved
    return frames, prepares, cpus


def bench_frame(points: int, reps: int = 15, screen_name: str = "training", state=None) -> dict:
    """One size: our canvas against the previous plotext widget (the peer) on the same state, in the same run."""
    from console.widgets.curve_plot import CurvePlot
    from console.widgets.plotext_plot import PlotextCurvePlot

    state = state or frame_states(points)[0]
    ours, ours_prepare, ours_cpu = asyncio.run(frame_times(state, CurvePlot, reps, screen_name))
    _, _, full_cpu = asyncio.run(frame_times(state, CurvePlot, reps, screen_name, full=True))
    peer, peer_prepare, peer_cpu = asyncio.run(frame_times(state, PlotextCurvePlot, max(5, reps // 2), screen_name))
    return {
        "screen": screen_name,
        "points_per_series": points,
        "series": 3,
        "ours_canvas_frame_s": summary(ours),
        "ours_prepare_part_s": summary(ours_prepare),
        "ours_canvas_frame_cpu_s": summary(ours_cpu),
        "ours_every_row_repainted_cpu_s": summary(full_cpu),  # a zoom, a resize: no row kept from the last frame
        "peer_plotext_frame_s": summary(peer),
        "peer_prepare_part_s": summary(peer_prepare),
        "peer_plotext_frame_cpu_s": summary(peer_cpu),
        "peer_over_ours": summary(peer)["median"] / summary(ours)["median"],
        "peer_over_ours_cpu": summary(peer_cpu)["median"] / summary(ours_cpu)["median"],
        "ours_median_within_16ms": summary(ours)["median"] <= FRAME_BUDGET_S,
        "ours_p95_within_16ms": summary(ours)["p95"] <= FRAME_BUDGET_S,
    }


def bench_frames(sizes=FRAME_POINTS) -> dict:
    """The Training frame at each size, and the Grokking frame (log-step axes, EMA curves) at the largest."""
    frames = {}
    for points in sizes:
        state = frame_states(points)[0]
        frames[f"training_{points}"] = bench_frame(points, state=state)
        if points == max(sizes):
            frames[f"grokking_{points}"] = bench_frame(points, screen_name="grokking", state=state)
    return frames


def show_frames(frames: dict) -> None:
    print("\n== frame (prepare + render_lines of the screen's plots), ms per frame: wall median / p95 / CPU median")
    print(
        f"  {'screen, points x 3 series':>26}  {'ours (canvas)':>22}  {'peer (plotext)':>22}  {'peer/ours':>9}  {'(CPU)':>6}  median <= 16 ms  ours CPU, every row"
    )
    for row in frames.values():
        ours, peer = row["ours_canvas_frame_s"], row["peer_plotext_frame_s"]
        ours_cpu, peer_cpu = row["ours_canvas_frame_cpu_s"], row["peer_plotext_frame_cpu_s"]
        print(
            f"  {row['screen']:>16} {row['points_per_series']:>9,}  {ours['median'] * 1e3:6.1f} / {ours['p95'] * 1e3:5.1f} / {ours_cpu['median'] * 1e3:5.1f}  "
            f"{peer['median'] * 1e3:6.1f} / {peer['p95'] * 1e3:5.1f} / {peer_cpu['median'] * 1e3:5.1f}  "
            f"{row['peer_over_ours']:8.2f}x  {row['peer_over_ours_cpu']:5.2f}x  {str(row['ours_median_within_16ms']):>15}  {row['ours_every_row_repainted_cpu_s']['median'] * 1e3:5.1f}"
        )


def records_memory_mib(path: Path, records: int, sample: int = 100_000) -> float:
    """What holding the whole history as cleaned records (dicts) would take, scaled from a sample."""
    tracemalloc.start()
    kept = []
    with open(path, "rb") as handle:
        for _, line in zip(range(sample), handle):
            kept.append(normalize_record(json.loads(line))[0])
    used = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    return used / 2**20 * records / len(kept)


def main() -> int:
    if sys.argv[1:2] == ["--attach-child"]:
        path, records, lines = Path(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
        print(json.dumps(bench_attach(path, records, lines)))
        return 0
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mib", type=int, default=1024, help="size of the generated metrics.jsonl (default 1024)")
    parser.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()) / "eagle3-long-run", help="where the history is generated (kept for reruns)")
    parser.add_argument("--frame-only", action="store_true", help="only the frame section (no history file needed)")
    parser.add_argument("--live-lines", type=int, default=200, help="lines written at 10/s for the live lag")
    parser.add_argument("--skip-attach", action="store_true")
    parser.add_argument("--json", help="also write the numbers to this file")
    args = parser.parse_args()
    if args.frame_only:
        results = {"machine": {"cpus": os.cpu_count(), "loadavg_at_start": os.getloadavg()}, "frame": bench_frames()}
        show_frames(results["frame"])
        results["machine"]["loadavg_at_end"] = os.getloadavg()
        if args.json:
            Path(args.json).write_text(json.dumps(results, indent=2))
        return 0
    args.dir.mkdir(parents=True, exist_ok=True)
    path = history_file(args.dir, args.size_mib)
    results: dict = {"machine": {"cpus": os.cpu_count(), "loadavg_at_start": os.getloadavg()}}
    results["cold_index"] = cold = bench_cold_index(path, path.with_name(INDEX_FILENAME))
    show("cold index of a never-seen history (CPU time on one core)", cold)
    results["warm_query"] = bench_warm_query(path)
    show("warm `metrics series --points 200` (new process) vs grep '\"val\"' | tail", results["warm_query"])
    results["frame"] = bench_frames()
    show_frames(results["frame"])
    results["records_as_dicts_mib"] = records_memory_mib(path, cold["records"])
    if not args.skip_attach:  # in a fresh process, so its peak RSS is the console's, not this script's
        child = subprocess.run(
            [sys.executable, __file__, "--attach-child", str(path), str(cold["records"]), str(args.live_lines)], cwd=ROOT, capture_output=True, text=True
        )
        if child.returncode != 0:
            raise RuntimeError(f"the attach run failed:\n{child.stderr[-3000:]}")
        results["attach"] = json.loads(child.stdout.strip().splitlines()[-1])
        show("attach over loopback SSH, live lag, CPU, memory", results["attach"])
    results["machine"]["loadavg_at_end"] = os.getloadavg()
    print(f"\n(holding the whole history as records would take ~{results['records_as_dicts_mib']:.0f} MiB in the console)")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
