"""Two torchrun "nodes" on one GPU host, one GPU each, trained as one job over NCCL: the multi-node path on GPUs.

Each node is started exactly as the agent starts a node job (backend.commands.torchrun_train_argv, static rendezvous
on 127.0.0.1, the node environment with NVLink multicast off), with its own job dir and CUDA_VISIBLE_DEVICES, so
the ranks talk over NCCL as two nodes would. Prints and writes a JSON report: exit codes, steps, rank 0's speed,
the checkpoint node 0 wrote, both ranks' heartbeats. On a host without GPUs the same run uses gloo on CPU.

    python benchmarks/multinode_nccl_check.py --out /tmp/nccl-check [--steps 60] [--profile tiny]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from backend.commands import NODE_ENV, torchrun_train_argv, train_argv  # noqa: E402
from backend.layout import list_checkpoints, read_heartbeats  # noqa: E402


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def node_command(profile: str, steps: int, rank: int, nnodes: int, endpoint: str) -> list[str]:
    train = train_argv(profile, ["--max-steps", str(steps), "--save-interval", str(steps), "--eval-interval", str(steps), "--log-interval", "1"])
    argv = torchrun_train_argv(train, run_id="nccl-check", node_rank=rank, nnodes=nnodes, rdzv_endpoint=endpoint)
    return [sys.executable if part == "python" else part for part in argv]


def probe_gpus() -> list[str]:
    """The GPUs of this host (nvidia-smi names); [] on a machine without them, where the ranks use gloo on CPU."""
    try:
        done = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return []
    return [line.strip() for line in done.stdout.splitlines() if line.strip()]


def last_record(path: Path) -> dict:
    lines = [line for line in path.read_text().splitlines() if line.strip()] if path.exists() else []
    records = [json.loads(line) for line in lines]
    train = [r for r in records if isinstance(r, dict) and r.get("split") == "train"]
    return train[-1] if train else {}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--profile", default="tiny")
    parser.add_argument("--timeout", type=float, default=480)
    parser.add_argument("--cache", type=Path, help="cache dir holding (or receiving) the built target and data (default: under --out)")
    args = parser.parse_args()
    work = args.out / "work"
    work.mkdir(parents=True, exist_ok=True)
    base_env = {**os.environ, "HOME": str(work / "home"), "EAGLE3_CACHE_DIR": str(args.cache or work / "cache"), **NODE_ENV}
    endpoint = f"127.0.0.1:{free_port()}"
    procs, dirs = [], []
    started = time.monotonic()
    for rank in range(args.nodes):
        job_dir = work / f"node{rank}"
        job_dir.mkdir(exist_ok=True)
        dirs.append(job_dir)
        env = {**base_env, "CUDA_VISIBLE_DEVICES": str(rank), "EAGLE3_JOB_DIR": str(job_dir)}
        with open(job_dir / "stderr.log", "wb") as err:
            procs.append(
                subprocess.Popen(
                    node_command(args.profile, args.steps, rank, args.nodes, endpoint),
                    cwd=ROOT,
                    env=env,
                    stdout=err,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            )
    codes = []
    for proc in procs:
        try:
            codes.append(proc.wait(timeout=max(1.0, args.timeout - (time.monotonic() - started))))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            codes.append("timeout")
    took = time.monotonic() - started
    record = last_record(dirs[0] / "metrics.jsonl")
    report = {
        "nodes": args.nodes,
        "profile": args.profile,
        "steps": args.steps,
        "rendezvous": endpoint,
        "exit_codes": codes,
        "seconds": round(took, 1),
        "rank0_last": {k: record.get(k) for k in ("step", "loss", "step_time", "tokens_per_s", "mfu", "peak_mem_gib")},
        "checkpoints_node0": [p.name for p in list_checkpoints(dirs[0])],
        "checkpoints_other_nodes": [p.name for d in dirs[1:] for p in list_checkpoints(d)],
        "metrics_on_other_nodes": [(d / "metrics.jsonl").exists() for d in dirs[1:]],
        "heartbeats": {d.name: read_heartbeats(d) for d in dirs},
        "gpus": probe_gpus(),
        "stderr_tail_node0": (dirs[0] / "stderr.log").read_text(errors="replace")[-1500:],
    }
    report["ok"] = (
        codes == [0] * args.nodes
        and record.get("step") == args.steps
        and len(report["checkpoints_node0"]) >= 1
        and not report["checkpoints_other_nodes"]
        and not any(report["metrics_on_other_nodes"])
    )
    (args.out / "multinode_nccl_check.json").write_text(json.dumps(report, indent=2, default=str))
    print(json.dumps({k: v for k, v in report.items() if k != "stderr_tail_node0"}, indent=2, default=str))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
