"""SIGKILL real checkpoint saves and metrics writes at random moments, on a normal disk and on a tiny tmpfs that fills up.

Each trial forks a saver from this (already torch-importing) process, so a trial costs well under a second.
The saver loops: append one metrics record with backend.metrics.records.MetricsWriter, then save a freshly
initialised tiny draft (seeded by its step, with an AdamW-shaped training state) through
backend.train.checkpoint.save_checkpoint. Trials come in series of five sharing one run dir: each saver
starts by re-saving the step `latest` names (what a resume followed by a stop does), then moves on. On the
tmpfs another job's writer (a thread) grabs space in 64 KiB chunks while the saver runs, and now and then the
disk is filled to the last byte, so saves are refused up front or fail mid-save, metrics writes are cut short or
refused, and the saver frees room the way an operator's retention would (drop the data, then the oldest
checkpoint `latest` does not name). The parent kills the saver after a random
delay, often mid-save, and counts

  unreadable latest    `latest` absent after a save was acknowledged, or naming a dir that does not load
                       (strict keys and shapes, training_state.pt with weights_only=True, the step's exact tensors)
  lost metrics         records the writer reported written that a reader cannot find
  saver errors         anything the saver raised other than the disk-full error ("disk full: N bytes needed, M free")

and, for information, kills that landed mid-save, same-step re-saves, disk-full refusals, metrics writes that
failed, torn metrics lines (terminated, skipped by readers) and records still held in memory at the kill
(never acknowledged). Exit 1 if any counted number is non-zero. Needs root for the tmpfs (else --no-tmpfs).

Usage: python benchmarks/kill_checkpoint.py --trials 100 [--seed 1] [--tmpfs-size 2m] [--no-tmpfs] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch

from backend.metrics.records import MetricsReader, MetricsWriter
from backend.train.checkpoint import CheckpointDiskFullError, load_checkpoint, save_checkpoint
from backend.layout import list_checkpoints
from backend.train.draft import DraftModelConfig, Eagle3Draft

SERIES = 5  # trials sharing one run dir
STEP_BASE = 1_000_000  # metrics step = trial * STEP_BASE + k: unique across a series
CONFIG = DraftModelConfig(
    hidden_size=64,
    num_attention_heads=2,
    num_key_value_heads=2,
    head_dim=32,
    intermediate_size=128,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    max_position_embeddings=256,
    vocab_size=256,
    draft_vocab_size=128,
    target_hidden_size=64,
    aux_layer_ids=[1, 2, 3],
    torch_dtype="float32",
)


def draft_for(step: int) -> Eagle3Draft:
    torch.manual_seed(step)
    return Eagle3Draft(CONFIG)


def adam_state(draft: Eagle3Draft) -> dict:
    """A real AdamW state_dict after one step (what the trainer saves): twice the weights again on disk."""
    params = [p for p in draft.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-3)
    for param in params:
        param.grad = torch.ones_like(param)
    optimizer.step()
    return optimizer.state_dict()


# --- the saver (a forked child) ------------------------------------------------------------------


def saver(run: Path, trial: int, start_step: int, optimizer: dict, on_tmpfs: bool, report) -> None:
    rng = random.Random(trial)
    writer = MetricsWriter(run / "metrics.jsonl", on_error=lambda _message: None)
    data = run / "data"
    if on_tmpfs:  # another job filling the disk while we save
        threading.Thread(target=_other_writer, args=(data, random.Random(-trial)), daemon=True).start()
    step = start_step
    k = 0
    while True:
        if on_tmpfs and rng.random() < 0.25:
            _grab_space(data / f"fill-{k}", None)
        writer.write(step=trial * STEP_BASE + k, split="train", loss=1.0 / (k + 1), note="m" * rng.randint(50, 900))
        report(f"m {writer.written} {writer.pending} {writer.failed_writes}")
        k += 1
        state = {"step": step, "trial": trial, "optimizer": optimizer, "rng": {"torch": torch.get_rng_state(), "python": random.getstate()}}
        try:
            save_checkpoint(run, draft_for(step), CONFIG, epoch=0, step=step, training_state=state)
        except CheckpointDiskFullError as exc:
            if not str(exc).startswith("disk full: ") or "`latest` still names" not in str(exc):
                raise
            report("f " + ("upfront" if "nothing was written" in str(exc) else "midsave"))
            _free_room(run, data)
            continue
        report(f"c {step}")
        step += 1


def _other_writer(data: Path, rng: random.Random) -> None:
    n = 0
    while True:
        time.sleep(rng.uniform(0.0, 0.01))
        _grab_space(data / f"other-{n}", 64 * 1024)
        n += 1


def _grab_space(path: Path, size: int | None) -> None:
    """Write `size` bytes (None: until the disk refuses more) to a new file; a full disk keeps what fit."""
    try:
        path.parent.mkdir(exist_ok=True)
        with open(path, "wb", buffering=0) as handle:
            while True:
                if handle.write(b"\0" * (size or 65536)) is None or size is not None:
                    return
    except OSError:
        pass  # the disk is full: that is the point


def _free_room(run: Path, data: Path) -> None:
    shutil.rmtree(data, ignore_errors=True)
    checkpoints = run / "checkpoints"
    try:
        named = (checkpoints / "latest").read_text().strip()
    except OSError:
        named = None
    for old in list_checkpoints(run):
        if old.name != named:
            shutil.rmtree(old, ignore_errors=True)
            return


# --- one trial (the parent) ----------------------------------------------------------------------


class Totals:
    def __init__(self):
        self.counted = {"unreadable_latest": 0, "lost_metrics_records": 0, "saver_errors": 0}
        self.info = {
            "trials": 0,
            "tmpfs_trials": 0,
            "kills_mid_save": 0,
            "same_step_resaves": 0,
            "checkpoints_saved": 0,
            "disk_full_refused_upfront": 0,
            "disk_full_mid_save": 0,
            "metrics_writes_failed": 0,
            "torn_metrics_lines": 0,
            "records_held_at_kill": 0,
            "metrics_records_acknowledged": 0,
        }
        self.problems: list[str] = []


def latest_step(run: Path) -> int | None:
    try:
        name = (run / "checkpoints" / "latest").read_text().strip()
    except OSError:
        return None
    return int(name.rsplit("_", 1)[1]) if name.startswith("epoch_") else None


def verify_latest(run: Path, expected_cache: dict) -> str | None:
    """None when `latest` names a checkpoint that loads and holds exactly its step's tensors."""
    checkpoints = run / "checkpoints"
    try:
        name = (checkpoints / "latest").read_text().strip()
    except OSError as exc:
        return f"`latest` unreadable: {exc}"
    try:
        draft, _, meta, state = load_checkpoint(checkpoints / name)
    except Exception as exc:
        return f"`latest` names {name!r}, which does not load: {exc}"
    step = meta.get("step")
    if state is None or state.get("step") != step or name != f"epoch_0_step_{step}":
        return f"`latest` names {name!r} holding meta step {step} and state {None if state is None else state.get('step')}"
    if step not in expected_cache:
        expected_cache[step] = {k: v for k, v in draft_for(step).state_dict().items() if k != "embed_tokens.weight"}
    loaded = draft.state_dict()
    for key, tensor in expected_cache[step].items():
        if not torch.equal(loaded[key], tensor):
            return f"`latest` {name}: {key} differs from step {step}'s weights"
    return None


def run_trial(
    run: Path,
    trial: int,
    optimizer: dict,
    on_tmpfs: bool,
    acked: set,
    saved_before: bool,
    rng: random.Random,
    totals: Totals,
    expected_cache: dict,
    kill_window: float,
) -> bool:
    start = latest_step(run)
    start_step = 0 if start is None else start
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # the saver: never returns into the parent's code
        code = 0
        try:
            os.close(read_fd)
            torch.set_num_threads(1)
            out = os.fdopen(write_fd, "w", buffering=1)
            saver(run, trial, start_step, optimizer, on_tmpfs, lambda line: out.write(line + "\n"))
        except BaseException as exc:
            try:
                out.write(f"e {type(exc).__name__}: {str(exc)[:300]}\n".replace("\n", " ") + "\n")
            except Exception:
                pass
            code = 1
        finally:
            os._exit(code)
    os.close(write_fd)
    time.sleep(rng.uniform(0.0, kill_window))
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    with os.fdopen(read_fd) as messages:
        lines = messages.read().splitlines()
    totals.info["trials"] += 1
    totals.info["tmpfs_trials"] += on_tmpfs
    checkpoints = run / "checkpoints"
    if checkpoints.is_dir() and any(p.name.startswith(".tmp-") and p.is_dir() for p in checkpoints.iterdir()):
        totals.info["kills_mid_save"] += 1
    written = held = failed = 0
    saved = [int(line.split()[1]) for line in lines if line.startswith("c ")]
    for line in lines:
        if line.startswith("m "):
            written, held, failed = (int(x) for x in line.split()[1:])
        elif line == "f upfront":
            totals.info["disk_full_refused_upfront"] += 1
        elif line == "f midsave":
            totals.info["disk_full_mid_save"] += 1
        elif line.startswith("e "):
            totals.counted["saver_errors"] += 1
            totals.problems.append(f"trial {trial}: saver raised {line[2:]}")
    totals.info["checkpoints_saved"] += len(saved)
    totals.info["same_step_resaves"] += bool(saved and start is not None and saved[0] == start)
    totals.info["metrics_writes_failed"] += failed
    totals.info["records_held_at_kill"] += held
    totals.info["metrics_records_acknowledged"] += written
    acked.update(trial * STEP_BASE + k for k in range(written))
    saved_before = saved_before or bool(saved)
    if saved_before:
        problem = verify_latest(run, expected_cache)
        if problem:
            totals.counted["unreadable_latest"] += 1
            totals.problems.append(f"trial {trial}: {problem}")
    reader = MetricsReader(run / "metrics.jsonl")
    found = {record["step"] for record in reader.poll()}
    missing = acked - found
    if missing:
        totals.counted["lost_metrics_records"] += len(missing)
        totals.problems.append(f"trial {trial}: {len(missing)} acknowledged metrics records missing, e.g. step {min(missing)}")
        acked.difference_update(missing)  # count each loss once
    return saved_before


def finish_series(run: Path, totals: Totals) -> None:
    reader = MetricsReader(run / "metrics.jsonl")
    reader.poll()
    totals.info["torn_metrics_lines"] += reader.follower.bad_lines + reader.bad_records


def mount_tmpfs(size: str) -> Path | None:
    mount = Path(tempfile.mkdtemp(prefix="kill-checkpoint-tmpfs-"))
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(mount)], capture_output=True, text=True)
    if done.returncode != 0:
        mount.rmdir()
        print(f"note: no tmpfs ({done.stderr.strip() or done.returncode}); running every trial on the normal disk", file=sys.stderr)
        return None
    return mount


def unmount(mount: Path) -> None:
    if subprocess.run(["umount", str(mount)], capture_output=True).returncode != 0:
        subprocess.run(["umount", "-l", str(mount)], capture_output=True)
    mount.rmdir()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=100)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--tmpfs-size", default="2m", help="size of the tmpfs that fills up (default 2m)")
    parser.add_argument("--no-tmpfs", action="store_true", help="every trial on the normal disk")
    parser.add_argument("--kill-window", type=float, default=0.3, help="kill after uniform(0, this) seconds")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    if args.trials < 1:
        parser.error("--trials must be at least 1")
    torch.set_num_threads(1)  # forking after multi-threaded OpenMP work is unsafe; one thread keeps it single
    rng = random.Random(args.seed)
    optimizer = adam_state(draft_for(0))
    totals, expected_cache = Totals(), {}
    began = time.perf_counter()
    work = Path(tempfile.mkdtemp(prefix="kill-checkpoint-"))
    mount = None if args.no_tmpfs else mount_tmpfs(args.tmpfs_size)
    try:
        for first in range(0, args.trials, SERIES):
            on_tmpfs = mount is not None and (first // SERIES) % 2 == 1
            base = mount if on_tmpfs else work
            run = base / f"run-{first}"
            acked: set = set()
            saved_before = False
            for trial in range(first, min(first + SERIES, args.trials)):
                saved_before = run_trial(run, trial, optimizer, on_tmpfs, acked, saved_before, rng, totals, expected_cache, args.kill_window)
            finish_series(run, totals)
            shutil.rmtree(run, ignore_errors=True)
    finally:
        if mount is not None:
            unmount(mount)
        shutil.rmtree(work, ignore_errors=True)
    seconds = time.perf_counter() - began
    result = {
        **totals.counted,
        **totals.info,
        "seconds": round(seconds, 1),
        "seconds_per_trial": round(seconds / max(1, totals.info["trials"]), 3),
        "problems": totals.problems[:20],
    }
    if args.json:
        print(json.dumps(result, indent=1))
    else:
        print(f"kill_checkpoint: {totals.info['trials']} trials ({totals.info['tmpfs_trials']} on a {args.tmpfs_size} tmpfs that fills up) in {seconds:.1f} s")
        for key, value in totals.counted.items():
            print(f"  {key.replace('_', ' '):<30} {value}")
        print("  --")
        for key, value in totals.info.items():
            if key not in ("trials", "tmpfs_trials"):
                print(f"  {key.replace('_', ' '):<30} {value}")
        for problem in totals.problems[:20]:
            print(f"  ! {problem}")
    return 1 if any(totals.counted.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
