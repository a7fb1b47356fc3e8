"""One TensorBoard event file -> records: TFRecord framing, Event decoding and tag mapping put together."""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any

from backend.external.sources import ChunkedSource
from backend.external.tags import map_tag
from backend.external.tfevent import ProtobufError, parse_event
from backend.external.tfrecord import TFRecordFollower


class TensorBoardSource(ChunkedSource):
    """One tfevents file -> records."""

    CHUNK_BYTES = 256 << 10  # events parse at a few MiB/s in pure Python: small chunks keep a poll near its deadline

    def __init__(self, path: Path):
        super().__init__(path)
        self.follower = TFRecordFollower(path, max_bytes_per_poll=self.CHUNK_BYTES)
        self.bad_events = 0

    @property
    def offset(self) -> int:
        return self.follower.offset

    @property
    def size(self) -> int:
        return self.follower.last_size

    @property
    def at_end(self) -> bool:
        return self.follower.at_end

    def _read_chunk(self, max_bytes: int) -> list[dict[str, Any]]:
        records: list[dict[str, Any]] = []
        for payload in self.follower.poll(max_bytes):
            try:
                wall_time, step, scalars = parse_event(payload)
            except (ProtobufError, struct.error, UnicodeDecodeError):
                self.bad_events += 1
                continue
            for tag, value in scalars:
                if step < 0:
                    continue
                mapped = map_tag(tag)
                if mapped is not None:
                    split, key, index = mapped
                    records += self.assembler.add(split, step, key, index, value, time=wall_time)
                else:
                    records += self.assembler.add_extra(step, tag, value, time=wall_time)
        return records
