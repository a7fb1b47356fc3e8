"""Small standard-library helpers for durable writes: fsync a file or directory by path, and whether a pid still runs."""
from __future__ import annotations

import os
from pathlib import Path


def fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def pid_alive(pid: int) -> bool:
    """Signal 0 probe: a pid owned by another user (PermissionError) still counts as alive."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
