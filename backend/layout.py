"""The run-directory layout: every file and directory name the agent, trainer, preflight and chain agree on, and "the latest checkpoint".

Standard library only (the agent imports it on any host Python >= 3.10).

    <run_dir>/jobs.db                                 the owned-process registry (backend/jobs/registry.py)
    <run_dir>/jobs/<job>/                             one job's directory (EAGLE3_JOB_DIR)
        metrics.jsonl                                 training metrics, one record per line (backend/metrics/records.py)
        metrics.index                                 the rebuildable whole-history summary (backend/metrics/index.py)
        stages.jsonl                                  stop-and-bench stages (backend/chain/run.py)
        checkpoints/epoch_E_step_S/                   config.json, model.safetensors, training_state.pt
        checkpoints/latest                            a file naming the current checkpoint directory
        results/stop-and-bench-*.json                 saved stop-and-bench results
        heartbeat/rank<R>.json                        each local training rank's liveness and step (trainer writes, agent reads)
    <run_dir>/data/                                   the default data dir (a profile's data dir under its run dir moves with --run-dir)
    <extract out>/meta.json                           offline shards' index (backend/train/extract.py); <split>/shard-NNNNN.safetensors
"""

from __future__ import annotations

import json
import math
import os
import re
import threading
import time
from pathlib import Path
from typing import Any

from backend.durable import write_atomic

METRICS_FILENAME = "metrics.jsonl"
INDEX_FILENAME = "metrics.index"
STAGES_FILENAME = "stages.jsonl"
CHECKPOINTS_DIR = "checkpoints"
LATEST_FILE = "latest"
CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
STATE_FILE = "training_state.pt"
RESULTS_DIRNAME = "results"
RESULTS_GLOB = "stop-and-bench-*.json"
CHECKPOINT_NAME = re.compile(r"^epoch_(\d+)_step_(\d+)$")
HEARTBEAT_DIR = "heartbeat"
HEARTBEAT_NAME = re.compile(r"^rank(\d+)\.json$")
HEARTBEAT_EVERY_S = 1.0  # how often each rank rewrites its heartbeat
STALL_AFTER_S = 30.0  # a running job's rank whose heartbeat is older than this is stalled (agent --stall-after changes it)
HEARTBEAT_DONE_PHASES = ("done", "stopped", "failed")  # a rank that said it ended is never stalled
DATA_DIRNAME = "data"
SHARD_META = "meta.json"  # an `extract` output dir's index: its format, target, splits and shard files
SHARD_FORMAT = "eagle3-console-shards/1"  # the format stamp in SHARD_META; readers refuse any other


def default_data_dir(run_dir: str | Path) -> Path:
    """<run_dir>/data: where data lives when nothing names another place."""
    return Path(run_dir).expanduser() / DATA_DIRNAME


def heartbeat_path(job_dir: str | Path, rank: int) -> Path:
    return Path(job_dir) / HEARTBEAT_DIR / f"rank{int(rank)}.json"


def read_heartbeats(job_dir: str | Path) -> list[dict[str, Any]]:
    """Every rank<R>.json under <job_dir>/heartbeat that parses (a file being replaced is skipped, never an error), by rank."""
    directory = Path(job_dir) / HEARTBEAT_DIR
    try:
        names = [entry.name for entry in os.scandir(directory) if HEARTBEAT_NAME.match(entry.name)]
    except OSError:
        return []
    beats = []
    for name in names:
        try:
            record = json.loads((directory / name).read_text())
        except (OSError, ValueError):
            continue
        if isinstance(record, dict) and isinstance(record.get("rank"), int) and not isinstance(record.get("rank"), bool):
            beats.append(record)
    return sorted(beats, key=lambda beat: beat["rank"])


class HeartbeatWriter:
    """One training rank's heartbeat/rank<R>.json, rewritten by a thread every `every` seconds (the trainer's).

    Every rank writes its own, on its own host (that host's agent job dir, $EAGLE3_JOB_DIR), so the agent there
    reads it with its own clock. The thread keeps beating while the rank waits in a collective, so a stale heartbeat
    means a stopped, dead or starved process; `step_time` says when the rank's step last advanced. A small JSON
    replaced atomically; a write that fails (a full disk) is said once through `log` and retried, never raised.
    """

    def __init__(self, job_dir: str | Path, rank: int, local_rank: int = 0, world_size: int = 1, step: int = 0, every: float = HEARTBEAT_EVERY_S, log=None):
        self.path = heartbeat_path(job_dir, rank)
        self.every = every
        self.log = log or (lambda _message: None)
        self.fixed = {
            "rank": rank,
            "local_rank": local_rank,
            "world_size": world_size,
            "local_world_size": _env_int("LOCAL_WORLD_SIZE", 1),
            "node_rank": _env_int("EAGLE3_NODE_RANK", _env_int("GROUP_RANK", 0)),
            "run_id": os.environ.get("EAGLE3_RUN_ID"),
            "pid": os.getpid(),
        }
        self.step, self.step_time, self.phase = step, time.time(), "setup"
        self.failing = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="heartbeat", daemon=True)
        self.write()
        self._thread.start()

    def beat(self, step: int, phase: str | None = None) -> None:
        """The loop's progress; no file I/O here (the thread writes)."""
        if step != self.step:
            self.step, self.step_time = step, time.time()
        if phase is not None:
            self.phase = phase

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            self.write()

    def write(self) -> bool:
        record = {**self.fixed, "step": self.step, "step_time": self.step_time, "phase": self.phase, "time": time.time()}
        try:
            if not self.path.parent.is_dir():
                if not self.path.parent.parent.is_dir():  # another host's output dir (no agent job dir here): nowhere to beat
                    return False
                self.path.parent.mkdir(exist_ok=True)
            write_atomic(self.path, json.dumps(record) + "\n", durable=False)  # rewritten every few seconds: no fsync
        except OSError as exc:
            if not self.failing:
                self.log(f"heartbeat {self.path} not written ({exc}); retrying every {self.every:g} s")
            self.failing = True  # write_atomic removed its temp file
            return False
        if self.failing:
            self.log(f"heartbeat {self.path} written again")
        self.failing = False
        return True

    def close(self, phase: str) -> None:
        """The last beat, saying how the rank ended (done, stopped, failed: never stalled after that)."""
        self.phase = phase
        self._stop.set()
        self._thread.join(timeout=5.0)
        self.write()


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name, "")
    return int(value) if value.strip().isdigit() else default


def rank_heartbeats(job_dir: str | Path, running: bool, now: float | None = None, stall_after: float = STALL_AFTER_S) -> tuple[list[dict[str, Any]], list[int]]:
    """(ranks, stalled ranks) of one job on this host, ages from this host's clock (the writers share it).

    age_s: since the rank's last heartbeat (written by a thread, so it stops only when the process is stopped or
    gone); step_age_s: since its step last advanced (a rank waiting in a collective beats on without advancing).
    Stalled: the job runs, the rank has not said it ended, and its heartbeat is older than stall_after.
    """
    now = time.time() if now is None else now
    ranks, stalled = [], []
    for beat in read_heartbeats(job_dir):
        wrote = _number(beat.get("time"))
        stepped = _number(beat.get("step_time"))
        age = None if wrote is None else round(max(0.0, now - wrote), 1)
        step_age = None if stepped is None else round(max(0.0, now - stepped), 1)
        phase = beat.get("phase") if isinstance(beat.get("phase"), str) else None
        ranks.append(
            {
                "rank": beat["rank"],
                "local_rank": beat.get("local_rank"),
                "node_rank": beat.get("node_rank"),
                "step": beat.get("step"),
                "age_s": age,
                "step_age_s": step_age,
                "pid": beat.get("pid"),
                "phase": phase,
            }
        )
        if running and phase not in HEARTBEAT_DONE_PHASES and (age is None or age > stall_after):
            stalled.append(beat["rank"])
    return ranks, stalled


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return float(value)


def checkpoint_name(epoch: int, step: int) -> str:
    return f"epoch_{epoch}_step_{step}"


def checkpoints_dir_of(path: str | Path) -> Path:
    """Accept a run output dir (holding checkpoints/), the checkpoints dir itself, or its `latest` pointer file."""
    path = Path(path)
    if path.name == LATEST_FILE and path.is_file():
        return path.parent
    return path / CHECKPOINTS_DIR if (path / CHECKPOINTS_DIR).is_dir() else path


def is_complete(checkpoint_dir: Path) -> bool:
    """Both files a loader needs are there (a save writes them in a temp dir and renames it whole)."""
    return (checkpoint_dir / CONFIG_FILE).is_file() and (checkpoint_dir / WEIGHTS_FILE).is_file()


def list_checkpoints(path: str | Path) -> list[Path]:
    """Complete epoch_E_step_S dirs, oldest first by (epoch, step); temp dirs are never listed."""
    directory = checkpoints_dir_of(path)
    if not directory.is_dir():
        return []
    found = []
    for entry in directory.iterdir():
        match = CHECKPOINT_NAME.match(entry.name)
        if match and entry.is_dir() and not entry.is_symlink() and is_complete(entry):
            found.append(((int(match[1]), int(match[2])), entry))
    return [entry for _, entry in sorted(found)]


def latest_name(path: str | Path) -> str | None:
    """What the `latest` pointer names (a file holding the name; a symlink from older tools), or None."""
    pointer = checkpoints_dir_of(path) / LATEST_FILE
    try:
        if pointer.is_symlink():
            return Path(pointer.readlink()).name or None
        return pointer.read_text().strip() or None
    except (FileNotFoundError, NotADirectoryError, IsADirectoryError, OSError):
        return None


def latest_checkpoint(path: str | Path) -> Path | None:
    """The checkpoint `latest` names when it is complete; else the newest complete one; else None."""
    directory = checkpoints_dir_of(path)
    name = latest_name(directory)
    if name and CHECKPOINT_NAME.match(name) and is_complete(directory / name):
        return directory / name
    listed = list_checkpoints(directory)
    return listed[-1] if listed else None


def checkpoint_listing(job_dir: str | Path) -> list[dict[str, Any]]:
    """The agent's `list_checkpoints` answer: complete checkpoints, oldest first, the current one marked."""
    current = latest_checkpoint(job_dir)
    out = []
    for entry in list_checkpoints(job_dir):
        match = CHECKPOINT_NAME.match(entry.name)
        assert match is not None  # list_checkpoints lists only names that match
        out.append({"path": str(entry), "epoch": int(match[1]), "step": int(match[2]), "latest": entry == current})
    return out


def list_results(train_job_dir: str | Path) -> list[dict[str, Any]]:
    """Saved stop-and-bench results of a training run, oldest first, for comparison."""
    results = []
    for path in sorted((Path(train_job_dir) / RESULTS_DIRNAME).glob(RESULTS_GLOB)):
        try:
            document = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(document, dict):
            results.append({"path": str(path), **(document.get("result") or {})})
    return results
