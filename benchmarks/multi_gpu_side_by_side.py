#!/usr/bin/env python3
"""One device call: SpecForge 20e2e3f0, SpecForge v0.3.0 and our trainer at each shape on one GPU, then ours on N GPUs.

Per shape (llama: Llama-3.1-8B draft; kimi: Kimi-K2.5 draft), one process each, one after another:

  1. SpecForge 20e2e3f0, flex_attention + FSDP   shared/tools/specforge_bench.py (its --config copy in .device/)
  2. SpecForge v0.3.0, its default flex + FSDP    benchmarks/bench_specforge_v03.py
  3. ours, 1 GPU                                  benchmarks/bench_trainer.py --specforge-json <1> <2>
  4. ours, N GPUs under torchrun                  bench_trainer.py ... --baseline-json <3>  (scaling efficiency)

Each run writes its JSON into a work folder; this script bundles them per shape into OUT/h200xN_side_by_side_<shape>.json
(every run's full JSON, its command, exit code and wall time, and a summary: ratios against each SpecForge version,
MFU, peak memory, scaling efficiency) and keeps the whole log in OUT/side_by_side_log.txt, so that few files come back.
A run that fails or overruns is recorded with its output's tail and the rest go on; runs that no longer fit in
--budget-s are skipped and named.

  device:  python3 benchmarks/multi_gpu_side_by_side.py --out $OUT --nproc 2
  CPU:     python benchmarks/multi_gpu_side_by_side.py --small --device cpu --nproc 2 --out /tmp/sbs
           (SpecForge 20e2e3f0's bench needs CUDA and is skipped; v0.3.0 needs triton's GPU kernel)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
for _key, _value in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"), ("NVSHMEM_DISABLE_NVLS", "1")):
    os.environ.setdefault(_key, _value)

OLD_SRC = ROOT / ".device" / "specforge_src"  # SpecForge 20e2e3f0 export (+ configs/kimi-k2.5-eagle3.json)
OLD_BENCH = ROOT / ".device" / "specforge_bench_cfg.py"  # shared/tools/specforge_bench.py with a --config argument
OLD_CONFIGS = {"llama": "llama3-8B-eagle3.json", "kimi": "kimi-k2.5-eagle3.json"}
TAIL_CHARS = 4000


class Log:
    def __init__(self, path: Path):
        self.file = path.open("a")

    def __call__(self, text: str) -> None:
        print(text, flush=True)
        self.file.write(text + "\n")
        self.file.flush()


def run_one(name: str, argv: list[str], env: dict, timeout: float, log: Log) -> dict:
    """Run one benchmark process; its output goes to the log; exit code, wall time and output tail come back."""
    log(f"=== {name} (timeout {timeout:.0f} s): {' '.join(argv)}")
    started = time.perf_counter()
    try:
        proc = subprocess.run(argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=timeout)
        rc, output = proc.returncode, proc.stdout
    except subprocess.TimeoutExpired as exc:
        rc = "timeout"
        raw = exc.stdout or b""
        output = raw.decode(errors="replace") if isinstance(raw, bytes) else raw
    wall = time.perf_counter() - started
    keep = [line for line in output.splitlines() if not line.startswith("warm-up") and "Warning" not in line]
    log("\n".join(keep[-40:]))
    log(f"--- {name}: exit {rc}, {wall:.1f} s")
    return {"command": " ".join(argv), "exit": rc, "wall_s": wall, "output_tail": output[-TAIL_CHARS:]}


def summarize(shape: str, runs: dict) -> dict:
    """Tokens/s, step, MFU and peak memory of every run; our ratios against each SpecForge version; scaling."""
    rows = {}
    for name, run in runs.items():
        data = run.get("result")
        if not data:
            rows[name] = {"missing": run.get("skipped") or f"exit {run.get('exit')}"}
            continue
        rows[name] = {
            "median_step_ms": data["median_step_ms"],
            "tokens_per_s_per_gpu": data.get("tokens_per_s_per_rank", data["tokens_per_s"]),
            "tokens_per_s_total": data["tokens_per_s"],
            "mfu": data.get("mfu", data.get("mfu_vs_measured_matmul")),
            "matmul_tflops": data.get("matmul_tflops", data.get("matmul_8192_bf16_tflops")),
            "peak_mem_allocated_gib": data.get("peak_mem_allocated_gib"),
            "peak_mem_reserved_gib": data.get("peak_mem_reserved_gib"),
            "world_size": data.get("world_size", 1),
        }
    summary: dict = {"shape": shape, "runs": rows}
    ours = rows.get("ours_1gpu", {})
    for peer in ("specforge_20e2e3f0", "specforge_v0.3.0"):
        theirs = rows.get(peer, {})
        if "tokens_per_s_per_gpu" in ours and "tokens_per_s_per_gpu" in theirs:
            summary[f"ours_vs_{peer}"] = {
                "tokens_per_s": ours["tokens_per_s_per_gpu"] / theirs["tokens_per_s_per_gpu"],
                "peak_memory": (
                    ours["peak_mem_allocated_gib"] / theirs["peak_mem_allocated_gib"]
                    if ours.get("peak_mem_allocated_gib") and theirs.get("peak_mem_allocated_gib")
                    else None
                ),
            }
    multi = next((runs[name].get("result") for name in runs if name.startswith("ours_") and name != "ours_1gpu"), None)
    if multi and multi.get("scaling"):
        summary["scaling"] = {**multi["scaling"], "world_size": multi["world_size"], "loss_match": multi.get("loss_match")}
    return summary


def table(summaries: list[dict]) -> list[str]:
    lines = [f"{'shape':<6}{'run':<20}{'step ms':>9}{'tok/s/GPU':>11}{'tok/s':>9}{'MFU %':>7}{'peak GiB':>10}"]
    for summary in summaries:
        for name, row in summary["runs"].items():
            if "missing" in row:
                lines.append(f"{summary['shape']:<6}{name:<20}  missing: {row['missing']}")
                continue
            peak = row["peak_mem_allocated_gib"]
            lines.append(
                f"{summary['shape']:<6}{name:<20}{row['median_step_ms']:>9.1f}{row['tokens_per_s_per_gpu']:>11.0f}"
                f"{row['tokens_per_s_total']:>9.0f}{100 * (row['mfu'] or 0):>7.1f}{peak if peak is not None else float('nan'):>10.2f}"
            )
        for key, value in summary.items():
            if key.startswith("ours_vs_"):
                memory = f" at {value['peak_memory']:.2f}x its peak memory" if value["peak_memory"] else ""
                lines.append(f"{summary['shape']:<6}ours (1 GPU) vs {key[8:]}: {value['tokens_per_s']:.2f}x tokens/s{memory}")
        if "scaling" in summary:
            scaling = summary["scaling"]
            match = scaling.get("loss_match") or {}
            lines.append(
                f"{summary['shape']:<6}scaling on {scaling['world_size']} GPUs: {100 * scaling['efficiency']:.1f}% per-GPU efficiency; "
                f"first 50 losses {'match' if match.get('match') else 'DO NOT match'} the 1-GPU run "
                f"(max rel diff {match.get('max_rel_diff', float('nan')):.4f})"
            )
    return lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="bundled JSONs and the log go here")
    parser.add_argument("--work", type=Path, help="per-run JSONs (default: OUT/../side_by_side_work or /tmp)")
    parser.add_argument("--shapes", default="llama,kimi", help="comma-separated: llama, kimi")
    parser.add_argument("--nproc", type=int, default=2, help="GPUs for our multi-GPU run (0: none)")
    parser.add_argument("--multi-shapes", default="llama,kimi", help="shapes that also get the N-GPU run")
    parser.add_argument("--small", action="store_true", help="the small CPU shape (smoke test of this script)")
    parser.add_argument("--device", help="passed to the benches (cpu for the smoke test)")
    parser.add_argument("--budget-s", type=float, default=540.0, help="stop starting runs past this many seconds")
    parser.add_argument("--run-timeout-s", type=float, default=170.0, help="limit for one run")
    parser.add_argument("--prefix", default="h200x2", help="file name prefix of the bundled JSONs")
    parser.add_argument(
        "--code-root",
        type=Path,
        help="our trainer from this tree (e.g. a `git archive HEAD backend profiles` "
        "export), so edits in progress in the working tree are not what is measured",
    )
    args = parser.parse_args(argv)
    shapes = [s for s in args.shapes.split(",") if s]
    bad = [s for s in shapes + [s for s in args.multi_shapes.split(",") if s] if s not in OLD_CONFIGS]
    if bad:
        parser.error(f"unknown shape(s) {bad}: use llama and/or kimi; nothing was run")
    args.out.mkdir(parents=True, exist_ok=True)
    work = args.work or Path(os.environ.get("TMPDIR", "/tmp")) / "side_by_side_work"
    work.mkdir(parents=True, exist_ok=True)
    log = Log(args.out / "side_by_side_log.txt")
    started = time.perf_counter()
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    import torch

    cuda = torch.cuda.is_available() and args.device != "cpu"
    log(
        f"torch {torch.__version__}; {torch.cuda.device_count() if cuda else 0} CUDA device(s): "
        f"{[torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if cuda else []}"
    )
    if cuda:
        for probe in (
            ["nvidia-smi", "--query-gpu=index,name,clocks.max.sm,power.limit,temperature.gpu,memory.used", "--format=csv"],
            ["nvidia-smi", "topo", "-m"],
        ):
            try:
                log(subprocess.run(probe, capture_output=True, text=True, timeout=30).stdout.rstrip())
            except (OSError, subprocess.TimeoutExpired) as exc:
                log(f"{probe[:2]}: {exc}")
    common = (
        (["--small"] if args.small else [])
        + (["--device", args.device] if args.device else [])
        + (["--code-root", str(args.code_root)] if args.code_root else [])
    )
    if args.code_root:
        commit = args.code_root / "COMMIT"
        log(f"our code from {args.code_root}" + (f" (commit {commit.read_text().strip()})" if commit.is_file() else ""))
    python = sys.executable
    summaries = []
    for shape in shapes:
        shape_args = [] if args.small else ["--shape", shape]
        runs: dict = {}
        files = {name: work / f"{shape}_{name}.json" for name in ("specforge_20e2e3f0", "specforge_v0.3.0", "ours_1gpu", f"ours_{args.nproc}gpu")}
        plan = []
        if cuda and not args.small and OLD_BENCH.is_file():
            old_env = dict(env, PYTHONPATH=os.pathsep.join(filter(None, [str(OLD_SRC), env.get("PYTHONPATH")])))
            plan.append(
                (
                    "specforge_20e2e3f0",
                    [
                        python,
                        str(OLD_BENCH),
                        "--config",
                        OLD_CONFIGS[shape],
                        "--backend",
                        "flex_attention",
                        "--fsdp",
                        "1",
                        "--flop-counter",
                        "0",
                        "--specforge-src",
                        str(OLD_SRC),
                        "--out",
                        str(files["specforge_20e2e3f0"]),
                    ],
                    old_env,
                )
            )
        else:
            runs["specforge_20e2e3f0"] = {"skipped": "needs CUDA, the full shapes and " + str(OLD_BENCH.relative_to(ROOT))}
        plan.append(("specforge_v0.3.0", [python, "benchmarks/bench_specforge_v03.py", *shape_args, *common, "--json", str(files["specforge_v0.3.0"])], env))
        peers = ["--specforge-json", str(files["specforge_20e2e3f0"]), "--specforge-json", str(files["specforge_v0.3.0"])]
        plan.append(
            (
                "ours_1gpu",
                [python, "benchmarks/bench_trainer.py", *shape_args, *common, *peers, "--label", f"ours {shape} 1 GPU", "--json", str(files["ours_1gpu"])],
                env,
            )
        )
        if args.nproc > 1 and shape in args.multi_shapes.split(","):
            name = f"ours_{args.nproc}gpu"
            plan.append(
                (
                    name,
                    [
                        python,
                        "-m",
                        "torch.distributed.run",
                        "--standalone",
                        f"--nproc_per_node={args.nproc}",
                        "benchmarks/bench_trainer.py",
                        *shape_args,
                        *common,
                        *peers,
                        "--baseline-json",
                        str(files["ours_1gpu"]),
                        "--label",
                        f"ours {shape} {args.nproc} GPUs",
                        "--json",
                        str(files[name]),
                    ],
                    env,
                )
            )
        for name, argv_run, run_env in plan:
            left = args.budget_s - (time.perf_counter() - started)
            if left < 45:
                runs[name] = {"skipped": f"out of time budget ({left:.0f} s left of {args.budget_s:.0f})"}
                log(f"=== {name}: skipped, {left:.0f} s left of the budget")
                continue
            files[name].unlink(missing_ok=True)
            runs[name] = run_one(f"{shape} {name}", argv_run, run_env, min(args.run_timeout_s, left), log)
            if files[name].is_file():
                runs[name]["result"] = json.loads(files[name].read_text())
        summary = summarize(shape, runs)
        summaries.append(summary)
        code_commit = args.code_root / "COMMIT" if args.code_root else None
        bundle = {
            "shape": shape,
            "command": " ".join([Path(python).name, *sys.argv]),
            "started_unix": time.time(),
            "our_code": (code_commit.read_text().strip() if code_commit and code_commit.is_file() else str(args.code_root or "working tree")),
            "summary": summary,
            "runs": runs,
        }
        (args.out / f"{args.prefix}_side_by_side_{'small' if args.small else shape}.json").write_text(json.dumps(bundle, indent=1) + "\n")
    log(f"=== done in {time.perf_counter() - started:.0f} s")
    log("\n".join(table(summaries)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
