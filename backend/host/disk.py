"""Disk room for the run dir and data dirs: filesystem usage plus a bounded measurement of a directory's own size."""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

from backend.protocol import DiskUsage


def dir_size(path: str | Path, max_entries: int = 200_000, max_seconds: float = 2.0) -> int | None:
    """Bytes under path (files counted once, symlinks not followed); None when the walk exceeds its bounds.

    A partial number would read as a measurement, so an unfinished walk reports nothing rather than too little.
    """
    deadline = time.monotonic() + max_seconds
    total, seen, stack = 0, 0, [str(path)]
    while stack:
        try:
            entries = os.scandir(stack.pop())
        except OSError:
            continue
        with entries:
            for entry in entries:
                seen += 1
                if seen > max_entries or (seen % 1000 == 0 and time.monotonic() > deadline):
                    return None
                try:
                    if entry.is_dir(follow_symlinks=False):
                        stack.append(entry.path)
                    elif entry.is_file(follow_symlinks=False):
                        total += entry.stat(follow_symlinks=False).st_blocks * 512
                except OSError:
                    continue
    return total


def _existing(path: Path) -> Path:
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def disk_usage(path: str | Path, label: str, measure_dir: bool = False, max_entries: int = 200_000, max_seconds: float = 2.0) -> DiskUsage:
    """Usage of the filesystem holding path (its nearest existing parent if path is missing yet)."""
    path = Path(path).expanduser()
    usage = shutil.disk_usage(_existing(path))
    measured = dir_size(path, max_entries, max_seconds) if measure_dir and path.is_dir() else None
    return DiskUsage(str(path), label, usage.total, usage.used, usage.free, measured)


def disks_for(run_dir: str | Path, data_dirs: list[str] | None = None, measure_dirs: bool = True) -> list[DiskUsage]:
    disks = [disk_usage(run_dir, "run_dir", measure_dirs)]
    disks.extend(disk_usage(path, "data_dir", measure_dirs) for path in data_dirs or [])
    return disks
