"""TFRecord framing of a growing file: CRC32C, complete records from a byte offset, caps and skipping of gaps and garbage."""

from __future__ import annotations

import errno
import os
import re
import struct
from pathlib import Path
from typing import Any, BinaryIO

# ---------------------------------------------------------------- CRC32C (Castagnoli), for TFRecord framing

_CRC_TABLE = []
for _byte in range(256):
    _crc = _byte
    for _ in range(8):
        _crc = (_crc >> 1) ^ 0x82F63B78 if _crc & 1 else _crc >> 1
    _CRC_TABLE.append(_crc)
del _byte, _crc


def crc32c(data: bytes, crc: int = 0) -> int:
    crc ^= 0xFFFFFFFF
    table = _CRC_TABLE
    for byte in data:
        crc = table[(crc ^ byte) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


def masked_crc32c(data: bytes) -> int:
    """TFRecord's masked CRC: rotate right by 15 and add a constant (so CRCs of CRCs stay distinct)."""
    crc = crc32c(data)
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


# ---------------------------------------------------------------- TFRecord framing

MAX_RECORD_BYTES = 16 << 20  # a record whose length header says this much or more is skipped unread
ZERO_SKIP_BYTES = 64 << 20  # zero-filled bytes one poll reads past at most (the holes of a sparse file cost nothing)
_ZERO_RUN = re.compile(rb"\x00{5,}")  # a header of a record under the cap has zeros in length bytes 3..7
_ZERO_FILLED = "zero-filled, skipped"


def _next_data(handle: BinaryIO, pos: int, size: int) -> int:
    """The first offset at or after pos that is not in a hole of a sparse file (at most size); pos when unknown."""
    try:
        return min(size, max(pos, os.lseek(handle.fileno(), pos, os.SEEK_DATA)))
    except OSError as exc:
        return size if exc.errno == errno.ENXIO else pos  # ENXIO: only a hole is left


class TFRecordFollower:
    """Reads complete TFRecords of a growing file from a byte offset, in bounded memory and time per poll.

    Record: uint64 length | uint32 masked crc32c(length) | data | uint32 masked crc32c(data), little endian.
    A record not fully written yet (or whose CRC fails at the very end of the file: a torn write) is left
    for the next poll. Everything else that is no readable record is skipped, counted and noted (`notes`,
    the last MAX_NOTES byte ranges with what they held), never waited on:
    - a bad data CRC skips that record;
    - a bad length CRC resynchronizes at the next offset whose length header has a valid CRC (and whose
      record, when it is already whole, has a valid data CRC);
    - a zero-filled gap is read past (up to ZERO_SKIP_BYTES per poll; holes of a sparse file are seeked past);
    - a length header of MAX_RECORD_BYTES or more is skipped unread when a valid header (or the end of the
      file) follows where it says the record ends, and treated as corruption (resync) otherwise.
    `skipped` counts skipped records and resyncs, `skipped_bytes` the bytes they held. `at_end` tells whether
    the last poll read up to the end of the file (nothing complete is left unread).
    """

    HEADER = 12
    MAX_NOTES = 20

    def __init__(self, path: str | os.PathLike, offset: int = 0, max_bytes_per_poll: int = 1 << 20):
        self.path = Path(path)
        self.offset = offset
        self.skipped = 0
        self.skipped_bytes = 0
        self.max_bytes_per_poll = max_bytes_per_poll
        self.last_size = -1
        self.at_end = False
        self._stuck: tuple[int, int] | None = None  # (offset, size) where the last poll made no progress
        self._gaps: list[list[Any]] = []  # [start, end, what held there], contiguous ranges of one kind merged

    @property
    def notes(self) -> list[str]:
        """What was skipped, for the operator: "bytes A..B (N): what they held"."""
        return [f"bytes {start}..{end} ({end - start}): {what}" for start, end, what in self._gaps]

    def poll(self, max_bytes: int | None = None) -> list[bytes]:
        """Complete records after the offset, reading at most max_bytes (default: max_bytes_per_poll).

        One record larger than max_bytes_per_poll (and under MAX_RECORD_BYTES) is read whole; one that only
        exceeds a smaller max_bytes waits for a later poll.
        """
        try:
            size = self.path.stat().st_size
        except FileNotFoundError:
            self.at_end = True
            return []
        if size < self.offset:  # truncated or replaced: start over
            self.offset = 0
        self.last_size = size
        self.at_end = True
        if size == self.offset or self._stuck == (self.offset, size):
            return []
        limit = self.max_bytes_per_poll if max_bytes is None else min(max_bytes, self.max_bytes_per_poll)
        records, consumed, seen = self._read(size, limit)
        self.at_end = self.offset + seen >= size
        self.offset += consumed
        cut_short = limit < self.max_bytes_per_poll and not self.at_end
        self._stuck = (self.offset, size) if not consumed and not cut_short else None
        return records

    def _read(self, size: int, limit: int) -> tuple[list[bytes], int, int]:
        """(records, bytes consumed from the offset, bytes looked at from the offset)."""
        with open(self.path, "rb", buffering=0) as handle:  # unbuffered: _next_data moves the descriptor's offset
            zeros = self._skip_zeros(handle, size)
            if zeros:
                return [], zeros, zeros
            handle.seek(self.offset)
            chunk = handle.read(min(size - self.offset, limit))
            at_eof = self.offset + len(chunk) >= size
            records, consumed = self._parse(chunk, at_eof)
            if consumed or len(chunk) < self.HEADER:
                return records, consumed, len(chunk)
            state, end = self._record_at(chunk, 0)
            if state == "too_big":
                return [], self._skip_too_big(handle, size, chunk, end), len(chunk)
            if state == "short" and self.offset + end <= size and end > self.max_bytes_per_poll:
                handle.seek(self.offset)  # one record larger than the per-poll budget: read it whole
                chunk = handle.read(end)
                records, consumed = self._parse(chunk, at_eof=self.offset + end >= size)
            return records, consumed, len(chunk)

    def _skip_zeros(self, handle: BinaryIO, size: int) -> int:
        """Bytes of a zero-filled run at the offset to skip (0 when none starts there); at most ZERO_SKIP_BYTES
        are read, holes of a sparse file are seeked past. The last 8 zeros before data stay: they could be the
        length of a record."""
        handle.seek(self.offset)
        if size - self.offset < self.HEADER or handle.read(self.HEADER).strip(b"\0"):
            return 0  # twelve zero bytes are no header: masked_crc32c of a zero length is not zero
        pos, read = self.offset + self.HEADER, 0
        while pos < size and read < ZERO_SKIP_BYTES:
            pos = _next_data(handle, pos, size)
            handle.seek(pos)
            block = handle.read(min(1 << 20, size - pos))
            read += len(block)
            zeros = len(block) - len(block.lstrip(b"\0"))
            pos += zeros
            if zeros < len(block) or not block:
                break
        pos = min(pos, size) - 8
        if pos <= self.offset:
            return 0
        self._note(self.offset, pos, _ZERO_FILLED)
        return pos - self.offset

    def _skip_too_big(self, handle: BinaryIO, size: int, chunk: bytes, end: int) -> int:
        """A valid length header of MAX_RECORD_BYTES or more at the offset: bytes to skip."""
        length = end - self.HEADER - 4
        record_end = self.offset + end
        if record_end <= size:
            handle.seek(record_end)
            following = handle.read(self.HEADER)
            if len(following) < self.HEADER or self._record_at(following, 0)[0] != "bad_header":
                self.skipped += 1
                self._note(self.offset, record_end, f"a record of {length} bytes, over the {MAX_RECORD_BYTES}-byte cap: skipped unread")
                return end
        resync = self._resync(chunk, 1)
        self.skipped += 1
        self._note(self.offset, self.offset + resync, f"a length header claiming {length} bytes, followed by no record: corrupt, resynced")
        return resync

    def _parse(self, chunk: bytes, at_eof: bool) -> tuple[list[bytes], int]:
        records, pos = [], 0
        while len(chunk) - pos >= self.HEADER:
            state, end = self._record_at(chunk, pos)
            if state == "ok":
                records.append(chunk[pos + self.HEADER : end - 4])
                pos = end
            elif state == "bad_data" and (end < len(chunk) or not at_eof):
                self.skipped += 1
                self._note(self.offset + pos, self.offset + end, "a record whose data CRC fails, skipped")
                pos = end
            elif state == "bad_header":
                if not chunk[pos : pos + self.HEADER].strip(b"\0"):
                    break  # a zero-filled run: the next poll reads past it (_skip_zeros)
                next_pos = self._resync(chunk, pos + 1)
                if chunk[pos:next_pos].strip(b"\0"):
                    self.skipped += 1
                    self._note(self.offset + pos, self.offset + next_pos, "no record (bad length CRC), resynced")
                else:  # the last zeros of a zero-filled run
                    self._note(self.offset + pos, self.offset + next_pos, _ZERO_FILLED)
                pos = next_pos
            else:
                break  # short, too big (_read decides), or a bad data CRC at the end of the file: maybe torn, wait
        return records, pos

    def _record_at(self, chunk: bytes, pos: int) -> tuple[str, int]:
        header = chunk[pos : pos + 8]
        (length,) = struct.unpack("<Q", header)
        if struct.unpack("<I", chunk[pos + 8 : pos + 12])[0] != masked_crc32c(header):
            return "bad_header", pos
        end = pos + self.HEADER + length + 4
        if length >= MAX_RECORD_BYTES:
            return "too_big", end
        if end > len(chunk):
            return "short", end
        data = chunk[pos + self.HEADER : end - 4]
        if struct.unpack("<I", chunk[end - 4 : end])[0] != masked_crc32c(data):
            return "bad_data", end
        return "ok", end

    def _resync(self, chunk: bytes, start: int) -> int:
        """The first offset at or after start where a record under the cap may start (a valid length CRC, and a
        valid data CRC when the record is whole in the chunk); else where the chunk's last unchecked header starts.

        Only offsets whose length bytes 3..7 are zero can hold such a header, so only a few places around each run
        of five or more zeros are checked (a run's inner all-zero headers are not: their CRC cannot match).
        """
        last = len(chunk) - self.HEADER
        for run in _ZERO_RUN.finditer(chunk, min(start + 3, len(chunk))):
            a, b = run.span()
            for pos in (*range(max(start, a - 3), a), *range(max(start, a, b - 11), b - 7)):
                if pos > last:
                    return last + 1
                if self._record_at(chunk, pos)[0] in ("ok", "short"):
                    return pos
        return max(start, last + 1)

    def _note(self, start: int, end: int, what: str) -> None:
        self.skipped_bytes += end - start
        if self._gaps and self._gaps[-1][1] == start and self._gaps[-1][2] == what:
            self._gaps[-1][1] = end
        else:
            self._gaps = (self._gaps + [[start, end, what]])[-self.MAX_NOTES :]
