"""Append-only JSON-lines files: a writer that never leaves a torn line and a follower that resumes by byte offset."""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


def append_record(path: str | os.PathLike, record: dict[str, Any]) -> None:
    """Append one record as one line with a single write(), so readers never see half a record of ours."""
    line = (json.dumps(record, separators=(",", ":"), allow_nan=True) + "\n").encode()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line)
    finally:
        os.close(fd)


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
        records = []
        while True:
            batch = self.poll()
            if not batch:
                return records
            records.extend(batch)
