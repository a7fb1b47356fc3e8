"""ExternalRunReader, the face the agent uses: a run this tool did not start, followed read-only -> cleaned records.

Standard library only. Nothing here writes to the watched run. `ExternalRunReader(path).poll()` returns
new cleaned records (backend.metrics.records.normalize_record) each time, resuming by byte offset per file:
- a directory: every *tfevents* file under it (new files are picked up on later polls);
- a file named *tfevents*: that event file;
- any other file: a log, its format decided by its first lines (WATCH_FORMATS): a SpecForge console log
  (stdout/stderr of its trainer, `step S: {...}` lines, or the older `Eval - Step S ..., position i, Acc: a` lines),
  a plain-text log of `name value` pairs with a step, or any text log through the watcher's own line regex.
One poll reads at most MAX_BYTES_PER_POLL bytes in bounded chunks and stops early after POLL_SECONDS, so a
1 GiB file is caught up over several polls; `bytes_read` / `bytes_total` tell how far it got. No file can make a
poll hold more than one record under MAX_RECORD_BYTES (16 MiB) or wait on bytes that are no record: a larger length
header, a zero-filled gap or garbage is skipped, counted and noted (status()'s per-file `notes`), see backend/external/tfrecord.py.

A `step S: {...}` line is whole records and is handed out at once. Otherwise values of one step arrive as
several events or lines. A (split, step) group is handed out when a later step shows up in the same source,
or when a poll has read to the end of a source that has not grown since the previous poll: the newest step
of a quiet run comes one poll late. If values of an already handed-out group arrive after that (a writer
that paused mid-step), the group is handed out again, complete; series() in backend/metrics/records.py keeps the
latest record per step.
"""

from __future__ import annotations

import math
import os
import re
from pathlib import Path
from typing import Any

from backend.external.plain_log import TextLogSource, compile_line_format, parse_format_line, parse_text_line
from backend.external.sources import MAX_BYTES_PER_POLL, POLL_SECONDS, Budget, LineLogSource
from backend.external.specforge_log import SpecForgeLogSource, is_specforge_line
from backend.external.tensorboard import TensorBoardSource
from backend.metrics.records import LIST_KEYS, NONNEGATIVE_KEYS, SCALAR_KEYS, SPLITS, normalize_record

# What `w` reads, for the operator (the watch modal and a refusal say it).
WATCH_FORMATS = (
    "tensorboard: a directory of *tfevents* files (up to 4 levels down), or one tfevents file",
    "specforge: a SpecForge console log (`step S: {...}` lines, or `Eval - Step S, position i, Acc: a` lines)",
    "text: a plain-text log whose lines hold `name value` pairs with a step, e.g. "
    "`[train] step 260/300 loss 6.4713 acc0 0.784 lr 4.40e-04` or `epoch 1 step 200 loss 8.38 acc0 0.246 lr 1.2e-04`",
    "regex: any text log, through a line regex with named groups: step (required), split, epoch, loss, lr, grad_norm, "
    "acc0, acc1, ..., ploss0, ... (e.g. `it=(?P<step>\\d+) l=(?P<loss>\\S+)`)",
)
SNIFF_BYTES = 1 << 20  # a log with no line in a known format in this much of its start is "unknown"


def sniff_log_format(path: Path, line_format: re.Pattern[str] | None = None) -> tuple[str | None, int]:
    """(the format of a log file: "specforge", "text", "regex" or None while no line of its start is in one, the bytes
    looked at). ValueError for a file that is not text (NUL bytes near its start)."""
    with open(path, "rb") as handle:
        head = handle.read(SNIFF_BYTES)
    if b"\x00" in head[:4096]:
        raise ValueError(f"{path} holds binary data, not a text log; w reads: " + "; ".join(WATCH_FORMATS))
    lines = (head if len(head) < SNIFF_BYTES else head[: max(head.rfind(b"\n"), 0)]).decode("utf-8", "replace").splitlines()
    if line_format is not None:
        return ("regex" if any(parse_format_line(line_format, line) for line in lines) else None), len(head)
    if any(is_specforge_line(line) for line in lines):  # first: a SpecForge log's side lines may read as `name value` pairs
        return "specforge", len(head)
    return ("text" if any(parse_text_line(line) for line in lines) else None), len(head)


def _is_event_file(path: Path) -> bool:
    return "tfevents" in path.name


class ExternalRunReader:
    """Follows a foreign run read-only; `poll()` returns the new cleaned records (metrics schema) since the last poll.

    path: a directory (all *tfevents* files below it, up to 4 levels, new ones included), a tfevents file,
    or a SpecForge console log file. Raises FileNotFoundError when the path does not exist. One poll reads at
    most MAX_BYTES_PER_POLL bytes over all files (older event files first) and stops after POLL_SECONDS;
    `bytes_read` / `bytes_total` say how far the reader got. Records that fail normalize_record are counted in
    `bad_records` and left out.
    """

    MAX_DEPTH = 4
    MAX_PROBLEMS = 20

    def __init__(
        self,
        path: str | os.PathLike,
        max_bytes_per_poll: int = MAX_BYTES_PER_POLL,
        poll_seconds: float = POLL_SECONDS,
        line_format: str | None = None,
    ):
        self.path = Path(path)
        if not self.path.exists():
            raise FileNotFoundError(f"nothing to watch at {self.path} (no such file or directory); nothing was read")
        self.sources: dict[Path, TensorBoardSource | LineLogSource] = {}
        self.kind = "tensorboard" if self.path.is_dir() or _is_event_file(self.path) else "log"
        if max_bytes_per_poll < LineLogSource.CHUNK_BYTES:
            raise ValueError(f"max_bytes_per_poll must be at least {LineLogSource.CHUNK_BYTES} (one log chunk)")
        self.line_format = compile_line_format(line_format) if line_format else None
        if self.line_format is not None and self.kind != "log":
            raise ValueError(f"a line format reads text logs; {self.path} is TensorBoard data; nothing is watched")
        self.max_bytes_per_poll = max_bytes_per_poll
        self.poll_seconds = poll_seconds
        self.bad_records = 0
        self.problems: list[str] = []
        self.format: str | None = "tensorboard" if self.kind == "tensorboard" else None
        self.sniffed_bytes = 0
        if self.kind == "log":
            self._sniff()

    @property
    def warning(self) -> str | None:
        """Why the watch may show nothing: a log with no line in a format w reads (yet); None once one is found."""
        if self.format is not None:
            return None
        if self.sniffed_bytes == 0:
            return None  # empty so far: the first lines decide
        seen = f"the first {self.sniffed_bytes:,} bytes of {self.path}"
        what = f"line format {self.line_format.pattern!r}" if self.line_format is not None else "a format w reads"
        ending = "; read as a SpecForge log from here on" if self.sniffed_bytes >= SNIFF_BYTES else "; records appear once such a line comes"
        return f"no line in {seen} is in {what} ({'; '.join(WATCH_FORMATS)}){ending}"

    def _sniff(self) -> None:
        """Decide a log's format from its start, while undecided and the start is still being written."""
        if self.format is not None or self.sniffed_bytes >= SNIFF_BYTES:
            return
        self.format, self.sniffed_bytes = sniff_log_format(self.path, self.line_format)
        undecided = self.format is None and self.sniffed_bytes >= SNIFF_BYTES  # then read as the user's regex, or SpecForge's as before
        if self.format == "specforge" or (undecided and self.line_format is None):
            self.sources[self.path] = SpecForgeLogSource(self.path)
        elif self.format is not None or undecided:
            self.sources[self.path] = TextLogSource(self.path, self.line_format)

    @property
    def bytes_read(self) -> int:
        """Bytes consumed so far, over all followed files."""
        return sum(source.offset for source in self.sources.values())

    @property
    def bytes_total(self) -> int:
        """Sizes of the followed files when last looked at."""
        return sum(max(source.size, source.offset) for source in self.sources.values())

    def _discover(self) -> None:
        if self.kind == "log":
            self._sniff()
            return
        if self.path.is_file():
            if self.path not in self.sources:
                self.sources[self.path] = TensorBoardSource(self.path)
            return
        base_depth = len(self.path.parts)
        for root, dirs, files in os.walk(self.path):
            dirs[:] = sorted(d for d in dirs if not d.startswith("."))
            if len(Path(root).parts) - base_depth >= self.MAX_DEPTH:
                dirs[:] = []
            for name in sorted(files):
                path = Path(root) / name
                if _is_event_file(path) and path not in self.sources:
                    self.sources[path] = TensorBoardSource(path)

    def poll(self) -> list[dict[str, Any]]:
        self._discover()
        budget = Budget(self.max_bytes_per_poll, self.poll_seconds)
        records: list[dict[str, Any]] = []
        for path in sorted(self.sources, key=_event_file_order):
            if budget.spent:
                break  # the rest waits for the next poll; older files come first, as a resumed run wrote them
            records += self.sources[path].poll(budget)
        return self._cleaned(records)

    def _cleaned(self, records: list[dict[str, Any]]) -> list[dict[str, Any]]:
        out = []
        for record in records:
            if plainly_clean(record):
                out.append(record)
                continue
            clean, problems = normalize_record(record)
            if clean is None:
                self.bad_records += 1
                note = f"step {record.get('step')!r} ({record.get('split')}): " + "; ".join(problems)
                self.problems = (self.problems + [note])[-self.MAX_PROBLEMS :]
            else:
                out.append(clean)
        return out

    def status(self) -> dict[str, Any]:
        """What is being followed and what was skipped, for the operator."""
        files = []
        for path, source in self.sources.items():
            entry: dict[str, Any] = {"path": str(path), "offset": source.offset, "size": max(source.size, 0)}
            if isinstance(source, TensorBoardSource):
                follower = source.follower
                entry.update(
                    kind="tensorboard",
                    skipped_records=follower.skipped,
                    skipped_bytes=follower.skipped_bytes,
                    bad_events=source.bad_events,
                    notes=follower.notes,
                )
            else:
                entry.update(kind="log", format=self.format, skipped_bytes=source.skipped_bytes)
            files.append(entry)
        return {
            "path": str(self.path),
            "kind": self.kind,
            "format": self.format,
            "warning": self.warning,
            "files": files,
            "bytes_read": self.bytes_read,
            "bytes_total": self.bytes_total,
            "bad_records": self.bad_records,
            "problems": list(self.problems),
        }


def plainly_clean(record: dict[str, Any]) -> bool:
    """True only when normalize_record would accept the record and hand it back unchanged.

    A cheap check of exact builtin types (int/float, lists of float) in the schema's shapes; anything else
    (other keys, other types) answers False and goes through normalize_record, which costs ~50x more per record.
    """
    step = record.get("step")
    if type(step) is not int or step < 0 or record.get("split") not in SPLITS:
        return False
    for key, value in record.items():
        if key in _SCALAR_KEY_SET:
            if (type(value) is not float and type(value) is not int) or (key in _NONNEGATIVE_KEY_SET and value < 0):
                return False
        elif key in _LIST_KEY_SET:
            if type(value) is not list or not all(type(item) is float for item in value):
                return False
        elif key == "tokens":
            if type(value) is not int or value < 0:
                return False
        elif key != "step" and key != "split":
            return False
    return True


_SCALAR_KEY_SET, _LIST_KEY_SET = frozenset(SCALAR_KEYS), frozenset(LIST_KEYS)
_NONNEGATIVE_KEY_SET = frozenset(NONNEGATIVE_KEYS)


def _event_file_order(path: Path) -> tuple[float, str]:
    """events.out.tfevents.<unix time>.<host>...: older files first, so a resumed run's records come later."""
    parts = path.name.split(".")
    try:
        stamp = float(parts[parts.index("tfevents") + 1])
    except (ValueError, IndexError):
        stamp = math.inf
    return stamp, str(path)
