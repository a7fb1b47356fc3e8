"""Append-only JSON-lines files: a writer that never glues records and a follower that resumes by byte offset."""

from __future__ import annotations

import errno
import fcntl
import json
import os
from pathlib import Path
from typing import Any, NamedTuple

from backend.durable import free_bytes

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
    fails or comes back short raises AppendError naming the path, the bytes needed and the bytes free. The file is
    created 0600 and never opened through a symbolic link (a link there is refused with AppendError).
    """
    line = (json.dumps(record, separators=(",", ":"), allow_nan=True) + "\n").encode()
    name = os.fspath(path)
    try:
        fd = os.open(name, os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)  # metrics may name data and paths: private
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


MAX_LINE_BYTES = 1 << 20  # a JSON line longer than this (newline not counted) is dropped, its byte range noted


def describe_dropped(start: int, end: int, max_line: int = MAX_LINE_BYTES) -> str:
    """What a LineReader dropped, for the operator."""
    if end - start - 1 > max_line:
        return f"bytes {start}..{end}: a line of {end - start - 1} bytes, over the {max_line}-byte cap: dropped"
    return f"bytes {start}..{end}: the end of a line that began before byte {start} (where reading started): dropped"


class LineChunk(NamedTuple):
    """One read of a LineReader."""

    size: int | None  # the file's size; None when it is missing
    data: bytes  # complete lines after the offset, none longer than the cap
    offset: int  # where the next read starts
    dropped: list[tuple[int, int]]  # (start, end) of each over-cap line whose end came in this read; end is past its newline


class LineReader:
    """Complete lines of a growing file from a byte offset, in bounded memory: a line over `max_line` bytes is dropped.

    A complete over-cap line is cut out of the data. One still unfinished but already over the cap is read past, a
    read at a time (a 1 GiB line costs a thousand reads of a megabyte, never a megabyte more memory), and reported
    in `dropped` once its newline arrives. An offset in the middle of a line (the byte before it is no newline: an
    agent that met the file mid-append, an index saved mid-way through a long line) reads past the rest of that
    line the same way. A partial last line under the cap waits for the next read; a file that shrank (rotated or
    truncated) is read from its start. Pass each read the offset the previous one returned.
    """

    def __init__(self, max_line: int = MAX_LINE_BYTES):
        self.max_line = max_line
        self._long: tuple[int, int] | None = None  # (start of the line being read past, the offset its reading resumes at)

    def read(self, path: Path, offset: int, max_bytes: int, stop: int | None = None) -> LineChunk:
        """Lines after offset from at most max_bytes (more, up to one line over the cap, when no line ends in them),
        never past stop."""
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            return LineChunk(None, b"", offset, [])
        if size < offset:
            offset, self._long = 0, None
        limit = size if stop is None else min(size, stop)
        if limit <= offset:
            return LineChunk(size, b"", offset, [])
        long, self._long = (self._long if self._long and self._long[1] == offset else None), None
        with open(path, "rb") as handle:
            handle.seek(max(0, offset - 1))
            mid_line = offset > 0 and handle.read(1) != b"\n"
            chunk = handle.read(min(limit - offset, max_bytes))
            if chunk.find(b"\n") < 0 and len(chunk) <= self.max_line < limit - offset:
                chunk += handle.read(min(limit - offset, self.max_line + 1) - len(chunk))  # enough to tell an over-cap line
        if long is None and mid_line:
            long = (offset, offset)
        return self._split(chunk, offset, long, size)

    def _split(self, chunk: bytes, offset: int, long: tuple[int, int] | None, size: int) -> LineChunk:
        pos, dropped = 0, []
        if long is not None:
            end = chunk.find(b"\n")
            if end < 0:
                self._long = (long[0], offset + len(chunk))
                return LineChunk(size, b"", offset + len(chunk), [])
            dropped.append((long[0], offset + end + 1))
            pos = end + 1
        tail = max(pos, chunk.rfind(b"\n") + 1)
        body, cut = self._without_long_lines(chunk[pos:tail], offset + pos)
        dropped += cut
        if len(chunk) - tail > self.max_line:  # the unfinished last line is over the cap already
            self._long = (offset + tail, offset + len(chunk))
            return LineChunk(size, body, offset + len(chunk), dropped)
        return LineChunk(size, body, offset + tail, dropped)

    def _without_long_lines(self, body: bytes, base: int) -> tuple[bytes, list[tuple[int, int]]]:
        """Complete lines minus those over the cap. Looks at one window of max_line + 1 bytes per step: a line
        starting at `start` is under the cap exactly when a newline lies in the window from there."""
        kept, dropped = [], []
        start = keep_from = 0
        while len(body) - start > self.max_line + 1:
            newline = body.rfind(b"\n", start, start + self.max_line + 1)
            if newline >= 0:
                start = newline + 1
                continue
            end = body.find(b"\n", start + self.max_line + 1) + 1
            kept.append(body[keep_from:start])
            dropped.append((base + start, base + end))
            start = keep_from = end
        if not dropped:
            return body, []
        kept.append(body[keep_from:])
        return b"".join(kept), dropped


class JsonlFollower:
    """Reads new complete lines of a growing file from a byte offset.

    A partial last line (a writer mid-append) is left for the next poll; a line that is not a JSON
    object is counted in `bad_lines` and skipped, never fatal. A line over MAX_LINE_BYTES is dropped
    (counted in `bad_lines`, its byte range described in `problems`), never waited on: the lines after it
    are read. If the file shrinks (rotated or truncated), reading restarts from the beginning.
    """

    MAX_PROBLEMS = 20

    def __init__(self, path: str | os.PathLike, offset: int = 0, max_bytes_per_poll: int = 8 << 20):
        self.path = Path(path)
        self.offset = offset
        self.bad_lines = 0
        self.problems: list[str] = []
        self.max_bytes_per_poll = max_bytes_per_poll
        self.lines = LineReader()

    def poll(self) -> list[dict[str, Any]]:
        """The records of the complete lines read by one bounded read (it may consume bytes and return none)."""
        chunk = self.lines.read(self.path, self.offset, self.max_bytes_per_poll)
        self.offset = chunk.offset
        if chunk.dropped:
            self.bad_lines += len(chunk.dropped)
            self.problems = (self.problems + [describe_dropped(*span) for span in chunk.dropped])[-self.MAX_PROBLEMS :]
        return self._parse(chunk.data) if chunk.data else []

    def _parse(self, data: bytes) -> list[dict[str, Any]]:
        records = []
        for raw in data.splitlines():
            if not raw.strip():
                continue
            try:
                record = json.loads(raw)
            except (json.JSONDecodeError, UnicodeDecodeError, RecursionError):
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
            before = self.offset
            records.extend(self.poll())
            if self.offset == before:
                return records
