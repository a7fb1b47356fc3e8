"""Append-only JSON-lines files: a writer that never glues records and a follower that resumes by byte offset."""

from __future__ import annotations

import errno
import fcntl
import json
import os
from pathlib import Path
from typing import Any

DISK_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)


class AppendError(OSError):
    """An append that did not complete: names the file, the bytes it needed, what it wrote and the space free.

    `errno` is the write's errno (ENOSPC for a short write on a full disk); `written` is how many bytes
    reached the file (a short write leaves that many bytes of a torn line, which the next append terminates).
    """

    def __init__(self, path: str, code: int, needed: int, written: int, free: int | None, message: str):
        super().__init__(code, message, path)
        self.path, self.needed, self.written, self.free, self.message = path, needed, written, free, message

    def __str__(self) -> str:
        return self.message


def free_bytes(path: str | os.PathLike) -> int | None:
    """Bytes an unprivileged writer may still use on the filesystem holding `path` (its folder if it is missing)."""
    target = Path(path)
    for candidate in (target, target.parent):
        try:
            stats = os.statvfs(candidate)
        except OSError:
            continue
        return stats.f_bavail * stats.f_frsize
    return None


def _ends_with_newline(fd: int) -> bool:
    size = os.fstat(fd).st_size
    return size == 0 or os.pread(fd, 1, size - 1) == b"\n"


def _append_error(path: str, code: int | None, needed: int, written: int, cause: str) -> AppendError:
    free = free_bytes(path)
    room = f"{needed} bytes needed, {'unknown' if free is None else free} free"
    full = code in DISK_FULL_ERRNOS or (code is None and free is not None and free < needed - written)
    what = f"disk full: {room}" if full else f"{cause}; {room}"
    if written:
        done = f"wrote {written} of {needed} bytes; the cut line is skipped by readers and the next append starts on a new line"
    else:
        done = "nothing was written"
    return AppendError(path, errno.ENOSPC if full else (code or errno.EIO), needed, written, free, f"could not append a record to {path}: {what}; {done}")


def append_record(path: str | os.PathLike, record: dict[str, Any]) -> None:
    """Append one record as one line with a single write(), never gluing it onto a torn line.

    Under an exclusive flock (so our writers never interleave a check and a write), the file's last byte
    is checked first: a file that does not end in a newline (an earlier write cut short by a full disk, or
    a writer killed mid-line) gets one in the same write, so readers drop only the torn line. A write that
    fails or comes back short raises AppendError naming the path, the bytes needed and the bytes free.
    """
    line = (json.dumps(record, separators=(",", ":"), allow_nan=True) + "\n").encode()
    name = os.fspath(path)
    try:
        fd = os.open(name, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)
    except OSError as exc:
        raise _append_error(name, exc.errno, len(line), 0, f"cannot open ({exc.strerror})") from exc
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        data = line if _ends_with_newline(fd) else b"\n" + line
        try:
            written = os.write(fd, data)
        except OSError as exc:
            raise _append_error(name, exc.errno, len(data), 0, exc.strerror or "write failed") from exc
        if written < len(data):
            try:  # terminate the torn line now if a byte of room is left; else the next append does it
                os.write(fd, b"\n")
            except OSError:
                pass
            raise _append_error(name, None, len(data), written, "short write")
    finally:
        os.close(fd)  # closing releases the lock


def read_complete_lines(path: Path, offset: int, max_bytes: int, line_ends: bytes = b"\n") -> tuple[int | None, bytes, int]:
    """(file size or None when missing, the complete new lines after offset, the offset after them).

    A partial last line stays unread; a file that shrank (rotated or truncated) is read from the start.
    `line_ends` lists the bytes that end a line (b"\n", or b"\n\r" for logs that redraw with \r).
    """
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        return None, b"", offset
    if size < offset:
        offset = 0
    if size == offset:
        return size, b"", offset
    with open(path, "rb") as handle:
        handle.seek(offset)
        chunk = handle.read(min(size - offset, max_bytes))
    end = max(chunk.rfind(bytes([byte])) for byte in line_ends)
    if end < 0:
        return size, b"", offset
    return size, chunk[: end + 1], offset + end + 1


class JsonlFollower:
    """Reads new complete lines of a growing file from a byte offset.

    A partial last line (a writer mid-append) is left for the next poll; a line that is not a JSON
    object is counted in `bad_lines` and skipped, never fatal. If the file shrinks (rotated or
    truncated), reading restarts from the beginning.
    """

    def __init__(self, path: str | os.PathLike, offset: int = 0, max_bytes_per_poll: int = 8 << 20):
        self.path = Path(path)
        self.offset = offset
        self.bad_lines = 0
        self.max_bytes_per_poll = max_bytes_per_poll

    def poll(self) -> list[dict[str, Any]]:
        _size, data, self.offset = read_complete_lines(self.path, self.offset, self.max_bytes_per_poll)
        return self._parse(data) if data else []

    def _parse(self, data: bytes) -> list[dict[str, Any]]:
        records = []
        for raw in data.splitlines():
            if not raw.strip():
                continue
            try:
                record = json.loads(raw)
            except (json.JSONDecodeError, UnicodeDecodeError):
                self.bad_lines += 1
                continue
            if isinstance(record, dict):
                records.append(record)
            else:
                self.bad_lines += 1
        return records

    def read_all(self) -> list[dict[str, Any]]:
        """Everything complete up to now (loops over poll until caught up)."""
        records: list[dict[str, Any]] = []
        while True:
            batch = self.poll()
            if not batch:
                return records
            records.extend(batch)
