"""Agent steady-state CPU: following N growing metrics files versus following none, measured side by side in one run.

Two agents run at the same time (same machine load): one with N writer jobs each appending ~RATE metrics lines
a second, one idle. CPU = (utime + stime) of the agent process from /proc/PID/stat, per wall second.

    python benchmarks/bench_agent_cpu.py [--seconds 20] [--files 8] [--rate 10] [--interval 1.0] [--json OUT]

With --finished N the first agent's run dir also holds N finished job records (each with its job dir), as a
long-used host's registry does; with --files 0 that agent is otherwise idle, so the ratio is the records' cost.
"""

from __future__ import annotations

import argparse
import json
import os
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from backend.jobs.registry import JobRegistry
from backend.agent.server import FINISHED_SETTLE_S
from backend.host.procs import PROC

TICKS = os.sysconf("SC_CLK_TCK")
WRITER = """\
import os, sys, time
from backend.jsonl import append_record
path = os.path.join(os.environ["EAGLE3_JOB_DIR"], "metrics.jsonl")
period, end = 1.0 / float(sys.argv[1]), time.monotonic() + float(sys.argv[2])
step, next_at = 0, time.monotonic()
while time.monotonic() < end:
    append_record(path, {"step": step, "epoch": 0, "split": "train", "loss": 5.0 / (1 + step), "acc": [0.5, 0.4, 0.3],
                         "ploss": [1.0, 1.1, 1.2], "lr": 1e-4, "grad_norm": 1.0, "tokens": step * 4096, "time": time.time()})
    step += 1
    next_at += period
    time.sleep(max(0.0, next_at - time.monotonic()))
"""


def add_finished_records(run_dir: Path, count: int) -> None:
    """`count` jobs that ran and exited, written as the registry writes them (one job dir each)."""
    registry = JobRegistry(run_dir)
    registry.close()
    now = time.time()
    rows = []
    for number in range(count):
        job_dir = run_dir / "jobs" / f"done{number}"
        job_dir.mkdir(mode=0o700)
        (job_dir / "exit_code").write_text("0\n")
        rows.append(
            (
                f"done{number}",
                "other",
                "exited",
                json.dumps(["true"]),
                str(job_dir),
                str(job_dir / "stdout.log"),
                str(job_dir / "stderr.log"),
                now - 3600 + number * 0.1,
                now - 3600 + number * 0.1 + 0.05,
            )
        )
    conn = sqlite3.connect(run_dir / "jobs.db")
    with conn:
        conn.executemany(
            "INSERT INTO jobs (name, kind, state, argv, job_dir, stdout_path, stderr_path, started_at, ended_at, exit_code) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, 0)",
            rows,
        )
    conn.close()


def cpu_seconds(pid: int) -> float:
    fields = (PROC / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS  # utime, stime (fields 14 and 15)


class Agent:
    def __init__(self, run_dir: Path, interval: float):
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "backend.agent", "--run-dir", str(run_dir), "--interval", str(interval)],
            cwd=ROOT,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
        )
        self.messages = 0
        self.metrics_records = 0
        self.replies: dict[int, dict] = {}
        self._cond = threading.Condition()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            message = json.loads(line)
            with self._cond:
                self.messages += 1
                if message["type"] == "metrics":
                    self.metrics_records += len(message["records"])
                if message["type"] == "reply":
                    self.replies[message["id"]] = message
                    self._cond.notify_all()

    def request(self, request_id: int, **message) -> dict:
        self.proc.stdin.write((json.dumps({"id": request_id, **message}) + "\n").encode())
        self.proc.stdin.flush()
        with self._cond:
            self._cond.wait_for(lambda: request_id in self.replies, timeout=60)
        reply = self.replies[request_id]
        if not reply["ok"]:
            raise RuntimeError(reply["error"])
        return reply["result"]

    def close(self) -> None:
        try:
            self.request(10_000, type="shutdown")
            self.proc.wait(timeout=30)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--files", type=int, default=8)
    parser.add_argument("--rate", type=float, default=10.0, help="lines per second per file")
    parser.add_argument("--interval", type=float, default=1.0, help="agent tick (1.0 = 1 Hz)")
    parser.add_argument(
        "--warmup", type=float, help="seconds before measuring (default 3; with --finished, FINISHED_SETTLE_S + 5: finished jobs' files settle)"
    )
    parser.add_argument("--finished", type=int, default=0, help="finished job records in the first agent's registry")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()
    if args.warmup is None:
        args.warmup = FINISHED_SETTLE_S + 5 if args.finished else 3.0

    with tempfile.TemporaryDirectory(prefix="bench-agent-") as tmp:
        busy_run, idle_run = Path(tmp) / "busy", Path(tmp) / "idle"
        if args.finished:
            add_finished_records(busy_run, args.finished)
        busy, idle = Agent(busy_run, args.interval), Agent(idle_run, args.interval)
        try:
            lifetime = args.warmup + args.seconds + 10
            for n in range(args.files):
                busy.request(n + 1, type="start_job", name=f"writer{n}", kind="train", argv=[sys.executable, "-c", WRITER, str(args.rate), str(lifetime)])
            time.sleep(args.warmup)
            t0 = time.monotonic()
            busy0, idle0, records0 = cpu_seconds(busy.proc.pid), cpu_seconds(idle.proc.pid), busy.metrics_records
            time.sleep(args.seconds)
            wall = time.monotonic() - t0
            busy_cpu = (cpu_seconds(busy.proc.pid) - busy0) / wall
            idle_cpu = (cpu_seconds(idle.proc.pid) - idle0) / wall
            streamed = (busy.metrics_records - records0) / wall
        finally:
            busy.close()
            idle.close()
            JobRegistry(busy_run).stop(all_jobs=True, grace=2)

    results = {
        "seconds": round(wall, 2),
        "files": args.files,
        "finished_records": args.finished,
        "lines_per_s_per_file": args.rate,
        "interval_s": args.interval,
        "busy_agent_cpu_per_wall_s": busy_cpu,
        "idle_agent_cpu_per_wall_s": idle_cpu,
        "ratio_busy_over_idle": busy_cpu / idle_cpu if idle_cpu > 0 else None,
        "metrics_records_streamed_per_s": streamed,
        "clock_ticks_per_s": TICKS,
    }
    ratio = f"{results['ratio_busy_over_idle']:.2f}x" if results["ratio_busy_over_idle"] else "n/a (idle agent used < 1 clock tick)"
    print(f"agent CPU at {1 / args.interval:g} Hz over {wall:.1f} s (user+sys per wall second, /proc/PID/stat):")
    finished = f", {args.finished} finished records" if args.finished else ""
    print(f"  following {args.files} files x {args.rate:g} lines/s{finished} : {busy_cpu * 100:.3f}% of one core ({streamed:.1f} records/s streamed)")
    print(f"  following none (idle)          : {idle_cpu * 100:.3f}% of one core")
    print(f"  ratio busy / idle              : {ratio}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
