"""Durable whole-file writes (temp file beside the target, fsync, rename over, fsync the directory) and the room left for them.

Standard library only. A reader sees the old file or the new one, never a half-written one; a crash leaves at
most a `.NAME.PID.tmp` beside it, which the next write of the same process replaces. The temp file is created
anew (O_EXCL) and never through a symbolic link (O_NOFOLLOW): a link planted at its predictable name is removed,
not written through.
"""

from __future__ import annotations

import os
from pathlib import Path


def nearest_existing(path: str | os.PathLike) -> Path:
    """`path`, or its nearest ancestor that exists (where a file under a missing directory would land)."""
    path = Path(path)
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def free_bytes(path: str | os.PathLike) -> int | None:
    """Bytes an unprivileged writer may still use on the filesystem that holds (or would hold) `path`."""
    try:
        stats = os.statvfs(nearest_existing(path))
    except OSError:
        return None
    return stats.f_bavail * stats.f_frsize


def fsync_path(path: str | os.PathLike) -> None:
    """fsync a file or a directory by path; errors are raised (a checkpoint must know its bytes are down)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(directory: Path) -> None:
    """Make a rename in `directory` durable (best effort where directories cannot be opened)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_atomic(path: str | os.PathLike, data: bytes | str, mode: int = 0o600, *, durable: bool = True) -> None:
    """Replace `path` with `data` atomically, and durably unless `durable` is False (a file rewritten every few
    seconds, whose loss in a crash costs nothing); `mode` for a file that is created: private unless asked (results,
    heartbeats, the metrics index and job status hold paths and argv that other users of the host need not read)."""
    path = Path(path)
    payload = data.encode() if isinstance(data, str) else data
    temp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    temp.unlink(missing_ok=True)  # a crash's leftover, or a planted link (unlink removes the link, not its target)
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, mode)
    try:
        view = memoryview(payload)
        while view:
            written = os.write(fd, view)
            view = view[written:]
        if durable:
            os.fsync(fd)
    except BaseException:
        os.close(fd)
        temp.unlink(missing_ok=True)
        raise
    os.close(fd)
    try:
        os.replace(temp, path)
    except BaseException:
        temp.unlink(missing_ok=True)
        raise
    if durable:
        fsync_dir(path.parent)


def publish(temp: str | os.PathLike, path: str | os.PathLike) -> None:
    """Rename a finished file that a library wrote by name (safetensors' save_file) over `path`, durably: the file is
    fsynced first, the directory after. On any error the temp file is removed and `path` keeps its old content."""
    try:
        fsync_path(temp)
        os.replace(temp, path)
    except BaseException:
        Path(temp).unlink(missing_ok=True)
        raise
    fsync_dir(Path(path).parent)
