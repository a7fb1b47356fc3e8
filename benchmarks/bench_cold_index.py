"""Cold index: a never-seen metrics.jsonl indexed by one process vs by worker processes, in the same run.

The history has the trainer's shape (train every step, val every 1000, as benchmarks/bench_long_run.py's), with
NaN losses, spikes, a resumed stretch (a run restarted from an older checkpoint repeats 20k steps) and a torn line.
The page cache is warmed first (one read of the file, timed), then:

- one process: `MetricsFeed.index_step()` until caught up (what the agent did before), wall and CPU;
- parallel: `backend.metrics.parallel.ColdScan` over the same backlog with N spawn'd workers (start-up included),
  then `index_step()` for what is left (nothing), wall;
- equality: both indexes' bytes (every level of every series, counts, val records), recent records and problems;
- responsiveness: while each scan runs on a background thread (as in the agent), a probe thread answers a
  pretend request every 20 ms (the feed's lock, a 200-bucket query, the last 5 records read from the file's
  end) and its latency p50/p99/max is reported.

    python benchmarks/bench_cold_index.py [--size-mib 1024] [--workers auto,2] [--dir DIR] [--out OUT.json]

`--workers auto` is the agent's rule: min(CPUs - 1, size / 64 MiB); where that is 1 the agent scans in-process,
so only the one-process number stands for it.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from backend.metrics.index import INDEX_STEP_BYTES, MetricsFeed  # noqa: E402
from backend.metrics.parallel import WORKER_NICE, ColdScan, available_cpus, worker_count  # noqa: E402

MODULES = ("fc", "midlayer", "norm", "lm_head")
PROBE_EVERY_S = 0.1


def train_record(step: int, rng: random.Random) -> dict:
    """One trainer-shaped train record: a decaying loss, NaN every 250k steps, a 20x spike every 99,991."""
    loss: float | str = 3.0 * math.exp(-step / 3e5) + rng.random() * 0.05
    loss = "NaN" if step % 250_000 == 0 else (loss * 20 if step % 99_991 == 0 else loss)
    return {
        "step": step,
        "epoch": step / 50_000,
        "split": "train",
        "loss": loss,
        "ploss": [round(rng.random(), 6) for _ in range(7)],
        "acc": [round(rng.random(), 6) for _ in range(7)],
        "step_time": 0.11 + rng.random() * 0.01,
        "lr": 1e-4,
        "grad_norm": rng.random(),
        "weight_norm": 120 + step * 1e-6,
        "weight_norm_modules": {m: rng.random() for m in MODULES},
        "tokens": step * 2048,
        "time": 1.79e9 + step * 0.11,
    }


def val_record(step: int, rng: random.Random) -> dict:
    return {
        "step": step,
        "epoch": step / 50_000,
        "split": "val",
        "loss": 3.3 * math.exp(-step / 3e5),
        "ploss": [rng.random() for _ in range(7)],
        "acc": [rng.random() for _ in range(7)],
        "tokens": step * 2048,
        "time": 1.79e9 + step * 0.11,
    }


def generate(path: Path, size_bytes: int, seed: int = 0) -> None:
    """The trainer's lines up to size_bytes, with a resume 20k steps back every 1M steps and one torn line."""
    rng = random.Random(seed)
    step = 0
    written = 0
    torn = False
    resumed: set[int] = set()
    with open(path, "w") as handle:
        while written < size_bytes:
            lines = []
            for _ in range(1000):
                step += 1
                if step % 1_000_000 == 0 and step not in resumed:
                    resumed.add(step)
                    step -= 20_000  # resumed from an older checkpoint: these steps are written again
                lines.append(json.dumps(train_record(step, rng), separators=(",", ":")))
            lines.append(json.dumps(val_record(step, rng), separators=(",", ":")))
            if not torn and written > size_bytes // 3:
                lines.append(lines[-2][:80])  # a writer killed mid-line, then restarted
                torn = True
            block = "\n".join(lines) + "\n"
            handle.write(block)
            written += len(block)


def history_file(directory: Path, size_mib: int) -> Path:
    path = directory / f"cold-{size_mib}mib.jsonl"
    if not path.exists() or path.stat().st_size < size_mib << 20:
        print(f"generating {size_mib} MiB of metrics at {path} ...", flush=True)
        partial = path.with_suffix(f".{os.getpid()}.tmp")
        generate(partial, size_mib << 20)
        partial.replace(path)
    return path


def warm_cache(path: Path) -> float:
    started = time.perf_counter()
    with open(path, "rb") as handle:
        while handle.read(64 << 20):
            pass
    return time.perf_counter() - started


class Probe:
    """A pretend request every PROBE_EVERY_S while a scan runs: the lock, a 200-bucket query, the newest records."""

    def __init__(self, feed: MetricsFeed):
        self.feed = feed
        self.latencies: list[float] = []
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self.done.is_set():
            started = time.perf_counter()
            with self.feed.lock:
                self.feed.index.buckets("train.loss", None, None, 200)
                end = self.feed.live_offset
            self.feed.tail_records(5, end=end)
            self.latencies.append(time.perf_counter() - started)
            self.done.wait(PROBE_EVERY_S)

    def summary(self) -> dict:
        ms = sorted(x * 1000 for x in self.latencies) or [0.0]
        return {
            "requests": len(self.latencies),
            "p50_ms": round(statistics.median(ms), 2),
            "p99_ms": round(ms[min(len(ms) - 1, int(len(ms) * 0.99))], 2),
            "max_ms": round(ms[-1], 2),
        }


def run_scan(path: Path, workers: int | None, nice: int = WORKER_NICE) -> tuple[MetricsFeed, dict]:
    """Index the whole file: in-process (workers None) or on `workers` processes; on a thread, with the probe."""
    feed = MetricsFeed(path, None, live_from_end=True)
    probe = Probe(feed)
    timing: dict = {}

    def scan() -> None:
        started, cpu = time.perf_counter(), time.process_time()
        if workers is not None:
            cold = ColdScan(feed, workers, nice=nice)
            timing["ranges"] = len(cold.ranges)
            timing["plan_and_start_s"] = round(time.perf_counter() - started, 3)
            while cold.step(0.05):
                if "first_merge_s" not in timing and feed.indexed_offset:
                    timing["first_merge_s"] = round(time.perf_counter() - started, 3)
                time.sleep(0.001)
            if cold.error:
                raise RuntimeError(cold.error)
            timing["workers_cpu_s"] = round(cold.worker_cpu_s, 3)
        while feed.index_step(INDEX_STEP_BYTES):
            time.sleep(0.001)  # what the agent's indexer does between chunks
        timing["wall_s"] = time.perf_counter() - started
        timing["main_process_cpu_s"] = time.process_time() - cpu

    probe.thread.start()
    worker = threading.Thread(target=scan)
    worker.start()
    worker.join()
    probe.done.set()
    probe.thread.join()
    mib = path.stat().st_size / 2**20
    timing["mib_per_s"] = round(mib / timing["wall_s"], 1)
    timing["wall_s"] = round(timing["wall_s"], 3)
    timing["main_process_cpu_s"] = round(timing["main_process_cpu_s"], 3)
    timing["probe"] = probe.summary()
    return feed, timing


def snapshot(feed: MetricsFeed) -> tuple:
    index = feed.index
    return (
        index.to_bytes({"source": "bench"}),
        json.dumps(list(index.recent_train), allow_nan=True),
        list(index.problems),
        index.total_records,
        index.bad_lines,
        feed.indexed_offset,
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size-mib", type=int, default=1024, help="size of the generated metrics.jsonl (default 1024)")
    parser.add_argument("--workers", default="auto", help="comma-separated worker counts to time; auto = the agent's rule (default auto)")
    parser.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()) / "eagle3-cold-index", help="where the history is generated (kept for reruns)")
    parser.add_argument(
        "--worker-nice",
        type=int,
        default=WORKER_NICE,
        help=f"niceness added to the workers (default {WORKER_NICE}, the agent's; 0 to compare like for like on a busy host)",
    )
    parser.add_argument("--out", type=Path, help="write the results here as JSON")
    args = parser.parse_args()
    args.dir.mkdir(parents=True, exist_ok=True)
    path = history_file(args.dir, args.size_mib)
    size = path.stat().st_size
    mib = size / 2**20
    cpus = available_cpus()
    auto = worker_count(size, cpus)
    counts = [0 if w.strip() == "auto" else int(w) for w in args.workers.split(",")]  # 0: the agent's rule
    result: dict = {
        "file": str(path),
        "file_mib": round(mib, 1),
        "cpus": cpus,
        "os_cpu_count": os.cpu_count(),
        "agent_rule_workers": auto,
        "python": sys.version.split()[0],
        "warm_cache_read_s": round(warm_cache(path), 3),
        "load_average_at_start": list(os.getloadavg()),
    }
    print(f"{mib:.0f} MiB, {cpus} CPUs: the agent's rule gives {auto} worker(s)", flush=True)
    expected, one = run_scan(path, None)
    one["mib_per_cpu_s"] = round(mib / one["main_process_cpu_s"], 1)  # the probe's CPU is in it too
    result["one_process"] = one
    result["records"] = expected.index.total_records
    print(f"one process : {one['wall_s']:7.2f} s wall  {one['mib_per_s']:7.1f} MiB/s  probe p99 {one['probe']['p99_ms']} ms", flush=True)
    reference = snapshot(expected)
    del expected
    result["parallel"] = []
    for count in dict.fromkeys(auto if c == 0 and auto > 1 else c for c in counts):
        if count == 0:
            print("agent's rule: 1 worker here, so the agent scans in-process (the row above)", flush=True)
            result["parallel"].append({"workers": 1, "agent_rule": True, "in_process": True, "speedup": 1.0})
            continue
        feed, timing = run_scan(path, count, args.worker_nice)
        timing["workers"] = count
        timing["worker_nice"] = args.worker_nice
        timing["equal_to_one_process"] = snapshot(feed) == reference
        timing["speedup"] = round(one["wall_s"] / timing["wall_s"], 2)
        timing["workers_mib_per_cpu_s"] = round(mib / timing["workers_cpu_s"], 1)
        del feed
        result["parallel"].append(timing)
        print(
            f"{count:2d} workers  : {timing['wall_s']:7.2f} s wall  {timing['mib_per_s']:7.1f} MiB/s  {timing['speedup']:.2f}x  "
            f"equal={timing['equal_to_one_process']}  probe p99 {timing['probe']['p99_ms']} ms  ({timing['ranges']} ranges, "
            f"{timing['workers_mib_per_cpu_s']} MiB per worker CPU s)",
            flush=True,
        )
        if not timing["equal_to_one_process"]:
            print("MISMATCH: the parallel index differs from the one-process index", file=sys.stderr)
    result["load_average_at_end"] = list(os.getloadavg())
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {args.out}")
    return 0 if all(p.get("equal_to_one_process", True) for p in result["parallel"]) else 1


if __name__ == "__main__":
    sys.exit(main())
