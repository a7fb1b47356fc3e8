"""Cost of one GPU sample: NVML in-process vs spawning `nvidia-smi --query-gpu` vs one line of a long-lived `nvidia-smi -lms` stream.

Run on a GPU host from the repository root (one command; exits cleanly with a message where there is no driver):

    python3 benchmarks/bench_gpu_sampling.py --json gpu_sampling.json

Each path goes through backend/host/gpu.py (the code the agent runs). Wall time is the latency of getting a full
sample; CPU time counts this process plus its children (nvidia-smi), which is what a 1 Hz agent pays.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from backend.host import gpu

TICKS = os.sysconf("SC_CLK_TCK")


def process_cpu(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS


def self_and_children_cpu() -> float:
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


def timed(call, count: int) -> tuple[list[float], float, object]:
    """Wall milliseconds of each call, CPU seconds per call (self + children), and the last result."""
    result = call()  # warm up
    cpu0, walls = self_and_children_cpu(), []
    for _ in range(count):
        started = time.perf_counter()
        result = call()
        walls.append((time.perf_counter() - started) * 1000)
    return walls, (self_and_children_cpu() - cpu0) / count, result


def summary(walls: list[float]) -> dict[str, float]:
    ordered = sorted(walls)
    return {"median_ms": statistics.median(ordered), "p90_ms": ordered[int(0.9 * (len(ordered) - 1))], "min_ms": ordered[0], "n": len(ordered)}


def bench_nvml(count: int) -> dict | str:
    nvml, status = gpu.probe_nvml()
    if nvml is None:
        return status
    source = gpu.NvmlSource(nvml)
    try:
        walls, cpu, samples = timed(source.sample, count)
    finally:
        source.close()
    return {**summary(walls), "cpu_ms_per_sample": cpu * 1000, "gpus": len(samples), "driver": source.driver}


def bench_spawn(smi: str, count: int) -> dict:
    walls, cpu, samples = timed(lambda: gpu.query_gpus(smi), count)
    return {**summary(walls), "cpu_ms_per_sample": cpu * 1000, "gpus": len(samples)}


def bench_stream(smi: str, seconds: float, interval_s: float) -> dict:
    """Lines of one -lms process: arrival spacing (is it flushed per line on a pipe?), its CPU per line, our cost per read."""
    source = gpu.SmiStreamSource(smi, "benchmark", interval_s=interval_s, apps_every_s=1e9)
    try:
        if not source.wait_for_line(after=0, timeout=30):
            return {"error": f"no line from the stream in 30 s: {source.message}"}
        gpus = max(1, len(source.sample()))
        arrivals, lines = [], source.lines
        smi_cpu0, started = process_cpu(source._proc.pid), time.monotonic()
        while time.monotonic() - started < seconds:
            if source.wait_for_line(after=lines + gpus - 1, timeout=5):  # one frame = one line per GPU
                arrivals.append(time.monotonic())
                lines = source.lines
        smi_cpu = process_cpu(source._proc.pid) - smi_cpu0
        read_walls, _, samples = timed(source.sample, 1000)  # what a tick pays: the latest frame, already parsed
        line = ",".join(["0", "NVIDIA H200", "GPU-x", "21455", "143771", "96", "58", "695.52"])
        parse_walls, _, _ = timed(lambda: gpu.parse_query_gpu_line(line), 1000)
        gaps = [(b - a) * 1000 for a, b in zip(arrivals, arrivals[1:])]
        return {
            **summary(read_walls),
            "interval_ms": source.interval_ms,
            "frames": len(arrivals),
            "frame_gap_median_ms": statistics.median(gaps) if gaps else None,
            "frame_gap_max_ms": max(gaps) if gaps else None,
            "nvidia_smi_cpu_ms_per_sample": smi_cpu * 1000 / max(1, len(arrivals)),
            "parse_line_median_ms": statistics.median(parse_walls),
            "gpus": len(samples),
            "bad_lines": source.bad_lines,
        }
    finally:
        source.close()


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a and b else None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=500, help="NVML samples")
    parser.add_argument("--spawns", type=int, default=40, help="nvidia-smi --query-gpu spawns")
    parser.add_argument("--stream-seconds", type=float, default=10.0)
    parser.add_argument("--stream-interval", type=float, default=0.2, help="-lms period in seconds")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()

    smi = shutil.which("nvidia-smi")
    nvml = bench_nvml(args.samples)
    if isinstance(nvml, str) and smi is None:
        message = f"no NVIDIA driver here ({nvml}; nvidia-smi not on PATH): nothing to measure. Run this on a GPU host."
        print(message)
        if args.json:
            args.json.write_text(json.dumps({"skipped": message}, indent=2) + "\n")
        return 0
    results: dict = {"host": os.uname().nodename, "nvml": nvml if isinstance(nvml, dict) else {"unavailable": nvml}}
    if smi:
        results["spawn_query_gpu"] = bench_spawn(smi, args.spawns)
        results["lms_stream"] = bench_stream(smi, args.stream_seconds, args.stream_interval)
    nvml_ms = results["nvml"].get("median_ms")
    spawn_ms = results.get("spawn_query_gpu", {}).get("median_ms")
    stream = results.get("lms_stream", {})
    results["ratios"] = {
        "spawn_over_nvml_wall": ratio(spawn_ms, nvml_ms),
        "spawn_over_stream_read_wall": ratio(spawn_ms, stream.get("median_ms")),
        "spawn_over_nvml_cpu": ratio(results.get("spawn_query_gpu", {}).get("cpu_ms_per_sample"), results["nvml"].get("cpu_ms_per_sample")),
        "spawn_over_stream_cpu": ratio(results.get("spawn_query_gpu", {}).get("cpu_ms_per_sample"), stream.get("nvidia_smi_cpu_ms_per_sample")),
    }

    def show(label: str, data: dict) -> None:
        if "median_ms" in data:
            cpu = data.get("cpu_ms_per_sample", data.get("nvidia_smi_cpu_ms_per_sample"))
            print(
                f"  {label:<34} median {data['median_ms']:9.3f} ms   p90 {data.get('p90_ms', float('nan')):9.3f} ms   cpu {cpu if cpu is not None else float('nan'):8.3f} ms/sample"
            )
        else:
            print(f"  {label:<34} {data}")

    print(f"GPU sampling on {results['host']} (one full sample of every GPU):")
    show("NVML (NvmlSource.sample)", results["nvml"])
    if smi:
        show("spawn nvidia-smi --query-gpu", results["spawn_query_gpu"])
        show("-lms stream: read latest frame", stream)
        print(
            f"  -lms {stream.get('interval_ms')}: a frame every {stream.get('frame_gap_median_ms') or float('nan'):.1f} ms (max gap {stream.get('frame_gap_max_ms') or float('nan'):.1f} ms;"
            " a max far above the period means nvidia-smi buffers its pipe output)"
        )
    for name, value in results["ratios"].items():
        print(f"  ratio {name:<28} {value:10.1f}x" if value else f"  ratio {name:<28} n/a")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
