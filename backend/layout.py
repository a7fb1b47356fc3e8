"""The run-directory layout: every file and directory name the agent, trainer, preflight and chain agree on, and "the latest checkpoint".

Standard library only (the agent imports it on any host Python >= 3.10).

    <run_dir>/jobs.db                                 the owned-process registry (backend/jobs.py)
    <run_dir>/jobs/<job>/                             one job's directory (EAGLE3_JOB_DIR)
        metrics.jsonl                                 training metrics, one record per line (backend/metrics.py)
        metrics.index                                 the rebuildable whole-history summary (backend/metrics_index.py)
        stages.jsonl                                  stop-and-bench stages (backend/chain.py)
        checkpoints/epoch_E_step_S/                   config.json, model.safetensors, training_state.pt
        checkpoints/latest                            a file naming the current checkpoint directory
        results/stop-and-bench-*.json                 saved stop-and-bench results
"""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

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


def checkpoint_name(epoch: int, step: int) -> str:
    return f"epoch_{epoch}_step_{step}"


def checkpoints_dir_of(path: str | Path) -> Path:
    """Accept a run output dir (holding checkpoints/) or the checkpoints dir itself."""
    path = Path(path)
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
