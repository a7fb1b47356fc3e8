"""A job's record and its vocabulary: JobRecord, the JobError family, kinds and states, file names, modes and private file helpers."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from stat import S_ISDIR, S_ISREG
from typing import Any

from backend import durable
from backend.layout import rank_heartbeats
from backend.protocol import ErrorCode, JobInfo, to_dict

KINDS = ("train", "serve", "bench", "chain", "other", "adopted")
TERMINAL = ("exited", "stopped")
JOB_TOKEN_ENV = "EAGLE3_JOB_TOKEN"  # in the job's environment; inherited by everything it starts
WATCH_TOKEN_ENV = "EAGLE3_WATCH_TOKEN"  # the watcher's copy, under another name so the watcher never looks like a job process
EXIT_FILE = "exit_code"
LEADER_FILE = "leader.json"
STOP_FILE = "stop_request"  # a stop that jobs.db could not record (a full disk) is written here, into space reserved at start
EXIT_SLOT_BYTES = 32
STOP_SLOT_BYTES = 4096
START_TIMEOUT_S = 30.0  # how long a start waits for the watcher's leader line; a record older than this without a leader is stale
STOP_INCOMPLETE = "stop incomplete"
ESCAPED_NOTE = "escaped the stop"
ESCAPED_ROLE = "unproven"  # a process with a trace of a stopped job but no proof: named, never signalled
WATCHER_ROLE = "watcher"
UNVERIFIED = "unverified"  # a verdict on the stop itself: the watcher was killed, so it cannot vouch that nothing escaped
PRIVATE_FILE = 0o600  # argv and logs may carry tokens
PRIVATE_DIR = 0o700
PACKAGE_PARENT = str(Path(__file__).resolve().parents[2])  # the directory holding backend/


class JobError(Exception):
    code = ErrorCode.INTERNAL


class JobConflict(JobError):
    code = ErrorCode.CONFLICT


class JobNotFound(JobError):
    code = ErrorCode.NOT_FOUND


class JobRefused(JobError):
    code = ErrorCode.REFUSED


class JobBadParams(JobError):
    code = ErrorCode.BAD_PARAMS


class JobNoSpace(JobRefused):
    """A start refused because the run dir's disk is full (or jobs.db cannot be written): nothing was started."""


class UnsafeRunDir(JobError):
    """The run dir, jobs.db or a path the tool writes could have been changed by another user."""

    code = ErrorCode.REFUSED


@dataclass
class JobRecord:
    """A jobs.db row: the wire JobInfo plus what only the registry needs."""

    id: int
    info: JobInfo
    detail: str
    cwd: str | None
    token: str | None
    watcher_pid: int | None
    watcher_start: int | None
    stop_requested_at: float | None
    cgroup: str | None = None

    @property
    def name(self) -> str:
        return self.info.name

    def to_wire(self, stall_after: float | None = None) -> dict[str, Any]:
        """The record as the agent sends it; with `stall_after`, this host's ranks' heartbeats and the stalled ones filled in."""
        wire = {**to_dict(self.info), "detail": self.detail}
        if stall_after is not None:
            wire["ranks"], wire["stalled_ranks"] = rank_heartbeats(self.info.job_dir, self.info.state == "running", stall_after=stall_after)
        return wire


def read_exit_file(job_dir: str | Path) -> tuple[int | None, float | None]:
    """The leader's exit status and when it was written; (None, None) while the file is missing or still its blank slot."""
    path = Path(job_dir) / EXIT_FILE
    try:
        return int(path.read_text().strip()), path.stat().st_mtime
    except (OSError, ValueError):
        return None, None


def reserve_slot(path: Path, size: int) -> None:
    """A blank file of `size` bytes, written while the disk has room, so that a later overwrite needs no new space."""
    try:
        with open(path, "xb", opener=private_opener) as handle:
            handle.write(b" " * (size - 1) + b"\n")
    except OSError:
        pass  # no slot: a full disk then leaves the fact unrecorded, as before


def overwrite_slot(path: Path, text: str) -> bool:
    """Write text over a reserved slot in place, padded to its size (never growing it: no block is allocated)."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_NOFOLLOW)
    except OSError:
        return False
    try:
        size = os.fstat(fd).st_size
        data = text.encode()
        if not S_ISREG(os.fstat(fd).st_mode) or len(data) >= size:
            return False
        os.pwrite(fd, data + b" " * (size - len(data) - 1) + b"\n", 0)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


def write_stop_slot(job_dir: str | Path, at: float, detail: str) -> bool:
    """Record a stop in the job dir's reserved slot, for when jobs.db cannot be written."""
    detail = detail[:1000]
    return overwrite_slot(Path(job_dir) / STOP_FILE, json.dumps({"at": at, "detail": detail}))


def read_stop_slot(job_dir: str | Path) -> tuple[float | None, str]:
    """(when, detail) of a stop recorded in the slot; (None, "") when there is none."""
    try:
        found = json.loads((Path(job_dir) / STOP_FILE).read_text() or "null")
    except (OSError, ValueError):
        return None, ""
    if not isinstance(found, dict) or not isinstance(found.get("at"), (int, float)) or isinstance(found.get("at"), bool):
        return None, ""
    return float(found["at"]), str(found.get("detail") or "")


def private_opener(path: str, flags: int) -> int:
    """open(..., opener=private_opener) creates the file 0600 and never writes through a symbolic link."""
    return os.open(path, flags | os.O_NOFOLLOW, PRIVATE_FILE)


def write_atomic(path: Path, text: str) -> None:
    durable.write_atomic(path, text, mode=PRIVATE_FILE)


def refuse_unless_ours(path: Path, stat: os.stat_result, what: str) -> None:
    euid = os.geteuid()
    if stat.st_uid != euid:
        raise UnsafeRunDir(
            f"{what} {path} is owned by uid {stat.st_uid}, not by this user (uid {euid}): another user could change it and make this"
            " tool's stop signal processes of their choosing. Nothing was done; use a run dir of your own (--run-dir or $EAGLE3_RUN_DIR)"
        )


def check_ancestors(path: Path) -> None:
    """No directory above the run dir may let another user swap it: owned by root or us, not group/other-writable unless sticky."""
    euid = os.geteuid()
    for ancestor in path.parents:
        try:
            stat = os.stat(ancestor)
        except OSError:
            continue
        sticky = stat.st_mode & 0o1000
        if stat.st_uid not in (0, euid) or (stat.st_mode & 0o022 and not sticky):
            raise UnsafeRunDir(
                f"{ancestor} (above the run dir {path}) can be changed by another user (owner uid {stat.st_uid}, mode"
                f" {stat.st_mode & 0o7777:04o}), who could replace the run dir and its jobs.db. Nothing was done; use a run dir"
                " under a directory only you (or root) can write"
            )


def make_private_dir(path: Path, what: str = "directory") -> None:
    """Create path 0700 (parents too), or check that an existing one is ours and not a link, and tighten it to 0700."""
    path.mkdir(mode=PRIVATE_DIR, parents=True, exist_ok=True)
    found = os.lstat(path)
    if not S_ISDIR(found.st_mode):
        raise UnsafeRunDir(f"{what} {path} is a symbolic link or not a directory. Nothing was done; remove it or pick another run dir")
    refuse_unless_ours(path, found, what)
    if found.st_mode & 0o077:
        try:
            os.chmod(path, PRIVATE_DIR)
        except OSError:
            pass  # a read-only disk must not stop a stop
