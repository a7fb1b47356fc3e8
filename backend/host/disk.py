"""Disk room for the run dir and data dirs: filesystem usage plus a bounded measurement of a directory's own size."""

from __future__ import annotations

import math
import os
import shutil
import time
from pathlib import Path

from backend.durable import nearest_existing
from backend.protocol import DiskUsage


def dir_size(path: str | Path, max_entries: int | None = 200_000, max_seconds: float | None = 2.0) -> int | None:
    """Bytes the files under path take on disk (allocated blocks; symlinks not followed); None when the walk exceeds
    its bounds (None: unbounded, for a directory this process is writing and knows to be small or must measure whole).

    A partial number would read as a measurement, so an unfinished walk reports nothing rather than too little.
    """
    entry_limit = math.inf if max_entries is None else max_entries
    deadline = time.monotonic() + (math.inf if max_seconds is None else max_seconds)
    total, seen, stack = 0, 0, [str(path)]
    while stack:
        try:
            entries = os.scandir(stack.pop())
        except OSError:
            continue
        with entries:
            for entry in entries:
                seen += 1
                if seen > entry_limit or (seen % 1000 == 0 and time.monotonic() > deadline):
                    return None
                try:
                    if entry.is_dir(follow_symlinks=False):
                        stack.append(entry.path)
                    elif entry.is_file(follow_symlinks=False):
                        total += entry.stat(follow_symlinks=False).st_blocks * 512
                except OSError:
                    continue
    return total


def disk_usage(path: str | Path, label: str, measure_dir: bool = False, max_entries: int = 200_000, max_seconds: float = 2.0) -> DiskUsage:
    """Usage of the filesystem holding path (its nearest existing parent if path is missing yet)."""
    path = Path(path).expanduser()
    usage = shutil.disk_usage(nearest_existing(path))
    measured = dir_size(path, max_entries, max_seconds) if measure_dir and path.is_dir() else None
    return DiskUsage(str(path), label, usage.total, usage.used, usage.free, measured)


def disks_for(run_dir: str | Path, data_dirs: list[str] | None = None, measure_dirs: bool = True) -> list[DiskUsage]:
    disks = [disk_usage(run_dir, "run_dir", measure_dirs)]
    disks.extend(disk_usage(path, "data_dir", measure_dirs) for path in data_dirs or [])
    return disks
