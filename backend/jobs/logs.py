"""A job's logs as lines to show: the bounded tail, display lines, and what torchrun's failure summary says."""

from __future__ import annotations

import os
import re
import signal
from pathlib import Path

from backend.protocol import JobInfo

TAIL_MAX_BYTES = 16 << 20  # a tail never reads more than this, however long its lines
TAIL_LINE_SHOWN = 4096  # characters kept of one line (a progress bar redrawn with \r for hours is one "line")
FAILURE_TAIL_LINES = 400  # stderr lines read for torchrun's failure summary when a distributed job fails

ROOT_CAUSE = "Root Cause (first observed failure)"
_FAILURE_FIELDS = re.compile(r"^\s*(rank|exitcode|traceback|host)\s*:\s*(.*?)\s*$")
_RANK_FIELD = re.compile(r"^(\d+) \(local_rank: (\d+)\)")
_EXIT_FIELD = re.compile(r"^(-?\d+) \(pid: (\d+)\)\s*(?:\((SIG\w+)\))?")
_RANK_ERROR = re.compile(r"^\[rank(\d+)\]: ((?:[\w.]+)(?:Error|Exception|Interrupt)\b.*)$")
_SOURCE_PREFIX = re.compile(r"\[[^\]\s]*\.(?:cc|cpp|cu|h|hpp):\d+\] ")  # gloo/NCCL's "[/__w/.../pair.cc:537] "
_TORCHRUN_SIGNALLED = re.compile(r"SignalException: Process (\d+) got signal: (\d+)")


def tail_lines(path: str | Path, count: int, block: int = 65536, max_bytes: int = TAIL_MAX_BYTES) -> list[str]:
    """The last `count` lines of a file, reading backwards in blocks: linear in what it reads, at most max_bytes.

    `\r` ends a line as `\n` does (progress bars redraw with it); longer lines are cut to TAIL_LINE_SHOWN.
    """
    if count <= 0:
        return []
    blocks: list[bytes] = []
    ends = 0
    with open(path, "rb") as handle:
        handle.seek(0, os.SEEK_END)
        end = handle.tell()
        read = 0
        while end > 0 and ends <= count and read < max_bytes:
            step = min(block, end, max_bytes - read)
            end -= step
            handle.seek(end)
            data = handle.read(step)
            blocks.append(data)
            read += step
            ends += data.count(b"\n") + data.count(b"\r")
    lines = display_lines(b"".join(reversed(blocks)))
    if lines and lines[-1] == "":
        lines.pop()
    if end > 0 and lines:  # the first line is cut at its start by the read window: marked, and kept if room is left
        lines[0] = "… " + lines[0]
    return lines[-count:]


def display_lines(data: bytes) -> list[str]:
    """Log bytes as lines to show: `\r` ends a line as `\n` does, a line over TAIL_LINE_SHOWN characters is cut (and says so)."""
    text = data.replace(b"\r\n", b"\n").replace(b"\r", b"\n").decode(errors="replace")
    return [line if len(line) <= TAIL_LINE_SHOWN else line[:TAIL_LINE_SHOWN] + f" … ({len(line)} characters)" for line in text.split("\n")]


def torchrun_failure(lines: list[str]) -> str | None:
    """What torchrun's failure summary (its "Root Cause" block) says about the first rank that failed, with that
    rank's own last exception line when its traceback is in the log; or that torchrun itself was signalled (it
    forwards the signal to its workers); None when the log says neither."""
    starts = [index for index, line in enumerate(lines) if ROOT_CAUSE in line]
    if not starts:
        return _torchrun_signalled(lines)
    fields: dict[str, str] = {}
    for line in lines[starts[-1] + 1 : starts[-1] + 12]:
        match = _FAILURE_FIELDS.match(line)
        if match:
            fields.setdefault(match[1], match[2])
    rank = _RANK_FIELD.match(fields.get("rank", ""))
    exit_match = _EXIT_FIELD.match(fields.get("exitcode", ""))
    who = f"rank {rank[1]} (local rank {rank[2]}" if rank else "a rank ("
    who += f"{', ' if rank else ''}pid {exit_match[2]})" if exit_match else ")"
    how = f"exited {exit_match[1]}{f' ({exit_match[3]})' if exit_match and exit_match[3] else ''}" if exit_match else "failed"
    why = fields.get("traceback", "")
    if rank:
        errors = [m[2] for m in map(_RANK_ERROR.match, lines[: starts[-1]]) if m and m[1] == rank[1]]
        if errors:
            why = errors[-1]
    if why.startswith("To enable traceback"):
        why = ""
    why = _SOURCE_PREFIX.sub("", why)
    detail = f"torchrun: {who} {how}{': ' + why if why else ''}"
    return detail if len(detail) <= 400 else detail[:399] + "…"


def _torchrun_signalled(lines: list[str]) -> str | None:
    """That torchrun itself got a signal (it passes it on to its workers), from its SignalException line; else None."""
    signalled = [match for match in map(_TORCHRUN_SIGNALLED.search, lines) if match]
    if not signalled:
        return None
    number = int(signalled[-1][2])
    try:
        name = signal.Signals(number).name
    except ValueError:
        name = f"signal {number}"
    return f"torchrun (pid {signalled[-1][1]}) got {name} and passed it to its workers"


def failure_detail(info: JobInfo, exit_code: int) -> str:
    """Why a distributed job failed, from torchrun's summary in its stderr (a node's part of a multi-node run
    says which rank failed first and how); empty for a clean exit or an ordinary job."""
    if exit_code == 0 or not (info.run_id or any("torch.distributed.run" in arg for arg in info.argv[:3])):
        return ""
    try:
        found = torchrun_failure(tail_lines(info.stderr_path, FAILURE_TAIL_LINES))
    except OSError:
        found = None
    return found or f"exited {exit_code}; torchrun's failure summary is not in {info.stderr_path}"
