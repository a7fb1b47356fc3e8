"""Durable whole-file writes: the one helper that writes a temp file beside the target, fsyncs it, renames it over, fsyncs the directory.

Standard library only. A reader sees the old file or the new one, never a half-written one; a crash leaves at
most a `.NAME.PID.tmp` beside it, which the next write of the same process replaces. The temp file is created
anew (O_EXCL) and never through a symbolic link (O_NOFOLLOW): a link planted at its predictable name is removed,
not written through.
"""

from __future__ import annotations

import os
from pathlib import Path


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


def write_atomic(path: str | os.PathLike, data: bytes | str, mode: int = 0o644) -> None:
    """Replace `path` with `data` atomically and durably; `mode` for a file that is created."""
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
    fsync_dir(path.parent)
