"""Owned jobs: the SQLite registry at run_dir/jobs.db, starting through a watcher, reaping, stop plans and identity-checked stops.

How a job runs (why there is a watcher): the agent or CLI spawns `python -m backend.jobs.registry watch JOB_DIR -- CMD...`
in a new session. The watcher starts CMD in another new session, so CMD is the job's leader (its pid is the
job pid, pgid and session id), writes leader.json, then waits for CMD and writes its exit status to the
`exit_code` file (negative = killed by that signal). The watcher is outside the job's process group, so
stopping the group never kills it, and it outlives the agent and the SSH connection: the exit code is known
even when whoever started the job has died. The watcher is also a child subreaper, so a descendant whose
parent died (or that called setsid) stays in the watcher's process tree, where stop finds it.

Where cgroup v2 is writable, the leader is moved into a cgroup of its own before it runs (procs.create_job_cgroup),
so everything it forks is in that cgroup, and the watcher moves itself out of the way (to the parent eagle3-jobs
cgroup). A stop then ends like systemd's KillMode=control-group: SIGTERM, grace, freeze the cgroup, cgroup.kill.
Elsewhere, or when the stopping process itself sits inside the job, the tree is frozen by SIGSTOP until a fresh
walk of /proc finds nothing new, then SIGKILLed, so nothing can fork its way out during the kill. The stopping
process and its ancestors are never signalled, and a stop never needs a write to succeed: signals go first,
records after, and what could not be recorded is reported (JobRegistry.unrecorded()).
"""

from __future__ import annotations

import errno
import fcntl
import json
import math
import os
import re
import secrets
import select
import shutil
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from stat import S_ISDIR, S_ISREG
from typing import Any, Callable, Iterable, Iterator, TypeGuard
from urllib.parse import quote

from backend import durable
from backend.host import procs
from backend.commands import NODE_ENV, check_node, node_argv_conflicts
from backend.layout import rank_heartbeats
from backend.protocol import ErrorCode, JobInfo, ProcessVerdict, StopPlan, to_dict

KINDS = ("train", "serve", "bench", "chain", "other", "adopted")
TERMINAL = ("exited", "stopped")
JOB_TOKEN_ENV = "EAGLE3_JOB_TOKEN"  # in the job's environment; inherited by everything it starts
WATCH_TOKEN_ENV = "EAGLE3_WATCH_TOKEN"  # the watcher's copy, under another name so the watcher never looks like a job process
EXIT_FILE = "exit_code"
LEADER_FILE = "leader.json"
STOP_FILE = "stop_request"  # a stop that jobs.db could not record (a full disk) is written here, into space reserved at start
EXIT_SLOT_BYTES = 32
STOP_SLOT_BYTES = 4096
EXIT_RETRY_S = 3600.0  # how long a watcher keeps trying to record the exit status on a full disk
NAME_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
START_TIMEOUT_S = 30.0
BUSY_TIMEOUT_S = 30.0  # how long a write waits for another process's write lock on jobs.db
MAX_GRACE_S = 86400.0
FREEZE_TIMEOUT_S = 5.0
READ_ONLY_RETRY_S = 5.0  # how often a read-only connection (opened on a full disk) tries read-write again
UNRECORDED_KEPT = 20
START_MIN_FREE = 256 << 10  # bytes a start needs on the run dir's disk: its record in jobs.db, logs, leader.json, slots
FINISHED_KEPT = 100  # finished records listed; older ones are archived in jobs.db (JobRegistry._prune_finished)
STOP_INCOMPLETE = "stop incomplete"
ESCAPED_NOTE = "escaped the stop"
WATCHER_ROLE = "watcher"
UNVERIFIED = "unverified"  # a verdict on the stop itself: the watcher was killed, so it cannot vouch that nothing escaped
WATCHER_LOST = "its watcher (PID {pid}) is gone (killed?): its exit status will not be recorded and a process it detaches cannot be followed"
NODE_COLUMNS = ("run_id", "node_rank", "nnodes", "rdzv_endpoint")  # a multi-node job's part on this host
FAILURE_TAIL_LINES = 400  # stderr lines read for torchrun's failure summary when a distributed job fails
PRIVATE_FILE = 0o600  # argv and logs may carry tokens
PRIVATE_DIR = 0o700
PACKAGE_PARENT = str(Path(__file__).resolve().parents[2])

SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    name TEXT NOT NULL,
    kind TEXT NOT NULL,
    state TEXT NOT NULL,
    detail TEXT NOT NULL DEFAULT '',
    pid INTEGER NOT NULL DEFAULT 0,
    pgid INTEGER NOT NULL DEFAULT 0,
    start_time_ticks INTEGER NOT NULL DEFAULT 0,
    argv TEXT NOT NULL,
    cwd TEXT,
    job_dir TEXT NOT NULL,
    stdout_path TEXT NOT NULL,
    stderr_path TEXT NOT NULL,
    started_at REAL NOT NULL,
    ended_at REAL,
    exit_code INTEGER,
    adopted INTEGER NOT NULL DEFAULT 0,
    token TEXT,
    watcher_pid INTEGER,
    watcher_start INTEGER,
    stop_requested_at REAL,
    archived INTEGER NOT NULL DEFAULT 0,
    cgroup TEXT,
    run_id TEXT,
    node_rank INTEGER,
    nnodes INTEGER,
    rdzv_endpoint TEXT
);
CREATE UNIQUE INDEX IF NOT EXISTS jobs_active_name ON jobs(name) WHERE archived = 0;
CREATE TABLE IF NOT EXISTS job_procs (
    job_id INTEGER NOT NULL,
    pid INTEGER NOT NULL,
    start_time INTEGER NOT NULL,
    role TEXT NOT NULL,
    cmdline TEXT NOT NULL DEFAULT '',
    seen_at REAL NOT NULL,
    PRIMARY KEY (job_id, pid, start_time)
);
"""


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


WRITE_ERRORS = (sqlite3.Error, OSError)  # a full disk, a read-only file system or a locked database


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


@dataclass
class Target:
    """A process a stop will signal, pinned by its identity (pid, start time)."""

    pid: int
    start: int
    pgid: int
    role: str  # leader | group | descendant
    job: str
    cmdline: str = ""


@dataclass
class JobPlan:
    record: JobRecord
    state: str
    targets: list[Target] = field(default_factory=list)
    group_signal: bool = False  # killpg(pgid) is safe: the leader is verified and still leads its group
    stale_reason: str | None = None
    protected: list[Target] = field(default_factory=list)  # the job's processes that are this stop's own process or its ancestors
    escaped: list[ProcessVerdict] = field(default_factory=list)  # processes with a trace of the job but no proof: named, never signalled


@dataclass
class Discovery:
    """What one round of process discovery works from."""

    table: procs.ProcTable
    token_pids: dict[str, list[int]]
    protected: set[int]
    roots: dict[int, int]  # pid of every job's leader and watcher -> job id
    cgroup_pids: dict[int, list[int]] = field(default_factory=dict)  # job id -> members of its cgroup


# The watcher is standard library only: -I (no PYTHON* variables, no user site, no script dir or cwd on sys.path),
# and the backend is imported from where this file lies, whatever the cwd: a `backend/` planted in a directory
# another user can write is never imported by root.
WATCHER_BOOT = f"import sys; sys.path.insert(0, {PACKAGE_PARENT!r}); from backend.jobs.registry import main; sys.exit(main(sys.argv[1:]))"
# Our own Python commands keep PYTHONPATH and site-packages (torch lives there) but never put the cwd or the
# script's directory first on sys.path: -P on Python >= 3.11, the same by hand on 3.10; PYTHONSAFEPATH=1 in
# their environment carries it to every Python they start (torchrun's workers).
SAFE_PATH_BOOT = "import runpy, sys; del sys.path[0]; runpy.run_module(sys.argv.pop(1), run_name='__main__', alter_sys=True)"
SAFE_PATH_ENV = {"PYTHONSAFEPATH": "1"}


def watcher_argv(job_dir: Path, argv: list[str]) -> list[str]:
    return [sys.executable, "-I", "-c", WATCHER_BOOT, "watch", str(job_dir), "--", *argv]


def safe_module_argv(module: str, args: list[str]) -> list[str]:
    """`python -m module args` that cannot import from the cwd."""
    if sys.version_info >= (3, 11):
        return [sys.executable, "-P", "-m", module, *args]
    return [sys.executable, "-c", SAFE_PATH_BOOT, module, *args]


def resolve_argv(argv: list[str]) -> list[str]:
    """`eagle3-host ...` runs as this Python's `-m backend`, whether or not the script is on PATH; a bare `python`
    (the torchrun command lines of backend/commands.py) is this Python too: the host's interpreter that has torch.
    Both with the safe path (see SAFE_PATH_BOOT)."""
    if argv and argv[0] == "eagle3-host":
        return safe_module_argv("backend", argv[1:])
    if argv and argv[0] == "python":
        if len(argv) >= 3 and argv[1] == "-m":
            return safe_module_argv(argv[2], argv[3:])
        return [sys.executable, *(["-P"] if sys.version_info >= (3, 11) else []), *argv[1:]]
    return list(argv)


def is_own_python_command(argv: list[str]) -> bool:
    return bool(argv) and argv[0] in ("eagle3-host", "python")


ROOT_CAUSE = "Root Cause (first observed failure)"
_FAILURE_FIELDS = re.compile(r"^\s*(rank|exitcode|traceback|host)\s*:\s*(.*?)\s*$")
_RANK_FIELD = re.compile(r"^(\d+) \(local_rank: (\d+)\)")
_EXIT_FIELD = re.compile(r"^(-?\d+) \(pid: (\d+)\)\s*(?:\((SIG\w+)\))?")
_RANK_ERROR = re.compile(r"^\[rank(\d+)\]: ((?:[\w.]+)(?:Error|Exception|Interrupt)\b.*)$")
_SOURCE_PREFIX = re.compile(r"\[[^\]\s]*\.(?:cc|cpp|cu|h|hpp):\d+\] ")  # gloo/NCCL's "[/__w/.../pair.cc:537] "
_TORCHRUN_SIGNALLED = re.compile(r"SignalException: Process (\d+) got signal: (\d+)")


def torchrun_failure(lines: list[str]) -> str | None:
    """What torchrun's failure summary (its "Root Cause" block) says about the first rank that failed, with that
    rank's own last exception line when its traceback is in the log; or that torchrun itself was signalled (it
    forwards the signal to its workers); None when the log says neither."""
    starts = [index for index, line in enumerate(lines) if ROOT_CAUSE in line]
    if not starts:
        signalled = [match for match in map(_TORCHRUN_SIGNALLED.search, lines) if match]
        if signalled:
            number = int(signalled[-1][2])
            try:
                name = signal.Signals(number).name
            except ValueError:
                name = f"signal {number}"
            return f"torchrun (pid {signalled[-1][1]}) got {name} and passed it to its workers"
        return None
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


TAIL_MAX_BYTES = 16 << 20  # a tail never reads more than this, however long its lines
TAIL_LINE_SHOWN = 4096  # characters kept of one line (a progress bar redrawn with \r for hours is one "line")


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


def protected_pids() -> set[int]:
    """This process and its ancestors: a stop run from inside a job must not cut the branch it sits on."""
    return {os.getpid(), *procs.ancestors(os.getpid())}


def check_stop_seconds(**values: float) -> None:
    """grace and friends must be finite, >= 0 and at most a day: NaN never compares past a deadline."""
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or not 0 <= value <= MAX_GRACE_S:
            raise JobBadParams(f"{name}: {value!r} is not a number of seconds between 0 and {MAX_GRACE_S:g}; nothing was signalled")


class UnsafeRunDir(JobError):
    """The run dir, jobs.db or a path the tool writes could have been changed by another user."""

    code = ErrorCode.REFUSED


def _refuse_unless_ours(path: Path, stat: os.stat_result, what: str) -> None:
    euid = os.geteuid()
    if stat.st_uid != euid:
        raise UnsafeRunDir(
            f"{what} {path} is owned by uid {stat.st_uid}, not by this user (uid {euid}): another user could change it and make this"
            " tool's stop signal processes of their choosing. Nothing was done; use a run dir of your own (--run-dir or $EAGLE3_RUN_DIR)"
        )


def _check_ancestors(path: Path) -> None:
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
    _refuse_unless_ours(path, found, what)
    if found.st_mode & 0o077:
        try:
            os.chmod(path, PRIVATE_DIR)
        except OSError:
            pass  # a read-only disk must not stop a stop


def prepare_db_file(path: Path) -> None:
    """Create jobs.db 0600, or check that the existing one is ours and tighten it, without ever closing a descriptor of it.

    SQLite's locks are POSIX locks, and closing ANY descriptor of the file drops all of this process's locks on it
    (sqlite.org "How To Corrupt An SQLite Database File" 2.2): the next process to open and close jobs.db then
    believes it is the last user, checkpoints the WAL and deletes it while this one writes on into the deleted file.
    So a descriptor is opened here only for a file that did not exist (O_EXCL: no connection can hold it yet); an
    existing file is checked with lstat and tightened with chmod by path. Nothing else may open jobs.db but SQLite.
    """
    try:
        os.close(os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, PRIVATE_FILE))
        return
    except FileExistsError:
        pass
    except OSError:
        return  # a full or read-only disk: the read-only connection decides what can still be done
    found = os.lstat(path)
    if not S_ISREG(found.st_mode):
        raise UnsafeRunDir(f"{path} is not a regular file (a symbolic link?). Nothing was done; remove it or pick another run dir")
    _refuse_unless_ours(path, found, "the job registry")
    if found.st_mode & 0o077:
        try:
            os.chmod(path, PRIVATE_FILE)  # by path: the run dir is ours and private, so nobody can swap the file meanwhile
        except OSError:
            pass


class JobRegistry:
    """All jobs of one run dir. Safe to use from several threads and several processes at once."""

    def __init__(self, run_dir: str | Path):
        self.run_dir = Path(run_dir).expanduser().resolve()
        self.jobs_dir = self.run_dir / "jobs"
        _check_ancestors(self.run_dir)
        make_private_dir(self.run_dir, "the run dir")
        make_private_dir(self.jobs_dir, "the jobs dir")
        self.db_path = self.run_dir / "jobs.db"
        prepare_db_file(self.db_path)
        self._local = threading.local()
        self._watchers: dict[int, subprocess.Popen] = {}  # job id -> watcher we spawned (reaped by refresh)
        self._watchers_lock = threading.Lock()
        self._stop_lock = threading.Lock()  # flock is per open file: threads of one process need this too
        self._stopping: set[int] = set()
        self._db()

    # ------------------------------------------------------------ database

    def _db(self) -> sqlite3.Connection:
        conn = getattr(self._local, "conn", None)
        if conn is None:
            conn = self._connect()
            self._local.conn = conn
        return conn

    def _retry_read_write(self) -> None:
        """A connection opened read-only (the disk was full) is reopened now and then: space may have returned, and a
        long-lived agent must be able to store what it could not (a stop's verdict) and start jobs again."""
        if getattr(self._local, "read_only", None) is None or time.monotonic() < getattr(self._local, "retry_at", 0.0):
            return
        self.close()
        self._db()
        if getattr(self._local, "read_only", None) is not None:
            self._local.retry_at = time.monotonic() + READ_ONLY_RETRY_S

    def _connect(self) -> sqlite3.Connection:
        """Read-write when possible; on a full or read-only disk a read-only view, so a stop can still find its targets.

        Never opens a descriptor of jobs.db itself (see prepare_db_file): only SQLite does."""
        conn = None
        try:
            conn = sqlite3.connect(self.db_path, timeout=BUSY_TIMEOUT_S, isolation_level=None)
            conn.row_factory = sqlite3.Row
            conn.execute(f"PRAGMA busy_timeout = {int(BUSY_TIMEOUT_S * 1000)}")
            conn.execute("PRAGMA journal_mode = WAL")
            conn.execute("PRAGMA synchronous = NORMAL")
            conn.executescript(SCHEMA)
            self._migrate(conn)
            return conn
        except sqlite3.Error as exc:
            if conn is not None:
                conn.close()
            return self._connect_read_only(exc)

    def _connect_read_only(self, why: Exception) -> sqlite3.Connection:
        self._note_unrecorded(f"{self.db_path} opened read-only ({why})")
        self._local.read_only = why
        self._local.retry_at = time.monotonic() + READ_ONLY_RETRY_S
        for mode in ("mode=ro", "immutable=1"):
            conn = None
            try:
                conn = sqlite3.connect(f"file:{quote(str(self.db_path))}?{mode}", uri=True, timeout=BUSY_TIMEOUT_S, isolation_level=None)
                conn.row_factory = sqlite3.Row
                conn.execute("SELECT count(*) FROM jobs").fetchone()
                return conn
            except sqlite3.Error:
                if conn is not None:
                    conn.close()
        raise JobError(f"cannot open {self.db_path}: {why}. Nothing was done; free disk space or fix its permissions and retry")

    @staticmethod
    def _migrate(conn: sqlite3.Connection) -> None:
        columns = {row[1] for row in conn.execute("PRAGMA table_info(jobs)")}
        for column, kind in (("cgroup", "TEXT"), ("run_id", "TEXT"), ("node_rank", "INTEGER"), ("nnodes", "INTEGER"), ("rdzv_endpoint", "TEXT")):
            if column not in columns:
                conn.execute(f"ALTER TABLE jobs ADD COLUMN {column} {kind}")

    @contextmanager
    def _write(self) -> Iterator[sqlite3.Connection]:
        """One write transaction, taken up front (BEGIN IMMEDIATE) so check-then-insert is atomic across processes."""
        db = self._db()
        db.execute("BEGIN IMMEDIATE")
        try:
            yield db
        except BaseException:
            try:
                db.execute("ROLLBACK")
            except sqlite3.Error:
                pass  # a failed COMMIT/statement may already have ended the transaction
            raise
        try:
            db.execute("COMMIT")
        except BaseException:
            try:
                db.execute("ROLLBACK")
            except sqlite3.Error:
                pass
            raise

    def _try_write(self, what: str, action: Callable[[sqlite3.Connection], object]) -> bool:
        """A write that may fail (full disk, read-only file system) without stopping the caller; failures are noted."""
        try:
            with self._write() as db:
                action(db)
            return True
        except WRITE_ERRORS as exc:
            self._note_unrecorded(f"{what}: {exc}{self._free_space_note()}")
            return False

    def _free_bytes(self) -> int | None:
        try:
            return shutil.disk_usage(self.run_dir).free
        except OSError:
            return None

    def _free_space_note(self) -> str:
        free = self._free_bytes()
        if free is None:
            return ""
        return f" ({free} bytes free on the disk of {self.run_dir}{': disk full' if free < 65536 else ''})"

    def _note_unrecorded(self, message: str) -> None:
        notes = getattr(self._local, "unrecorded", None)
        if notes is None:
            notes = self._local.unrecorded = []
        notes.append(message)
        del notes[:-UNRECORDED_KEPT]  # a thread that keeps failing (the agent's ticker on a full disk) must not grow without end

    def unrecorded(self) -> list[str]:
        """What this thread's last stop could not write to jobs.db (empty when everything was recorded)."""
        return list(getattr(self._local, "unrecorded", None) or [])

    def close(self) -> None:
        conn = getattr(self._local, "conn", None)
        if conn is not None:
            conn.close()
            self._local.conn = None
            self._local.read_only = None

    @staticmethod
    def _record(row: sqlite3.Row) -> JobRecord:
        keys = row.keys()  # a read-only view of an older jobs.db may lack the newer columns
        node = {column: row[column] for column in NODE_COLUMNS if column in keys}
        info = JobInfo(
            name=row["name"],
            kind=row["kind"],
            state=row["state"],
            pid=row["pid"],
            pgid=row["pgid"],
            start_time_ticks=row["start_time_ticks"],
            argv=json.loads(row["argv"]),
            job_dir=row["job_dir"],
            stdout_path=row["stdout_path"],
            stderr_path=row["stderr_path"],
            started_at=row["started_at"],
            ended_at=row["ended_at"],
            exit_code=row["exit_code"],
            adopted=bool(row["adopted"]),
            **node,
        )
        cgroup = row["cgroup"] if "cgroup" in keys else None
        return JobRecord(row["id"], info, row["detail"], row["cwd"], row["token"], row["watcher_pid"], row["watcher_start"], row["stop_requested_at"], cgroup)

    def _active(self, db: sqlite3.Connection | None = None, name: str | None = None) -> list[JobRecord]:
        db = db or self._db()
        if name is None:
            rows = db.execute("SELECT * FROM jobs WHERE archived = 0 ORDER BY started_at, id").fetchall()
        else:
            rows = db.execute("SELECT * FROM jobs WHERE archived = 0 AND name = ?", (name,)).fetchall()
        return [self._record(row) for row in rows]

    def _update(self, db: sqlite3.Connection, job_id: int, **values: Any) -> None:
        columns = ", ".join(f"{key} = ?" for key in values)
        db.execute(f"UPDATE jobs SET {columns} WHERE id = ?", (*values.values(), job_id))

    # ------------------------------------------------------------ state

    def _watcher_alive(self, record: JobRecord) -> bool:
        pid = record.watcher_pid
        return pid is not None and pid != 0 and procs.is_alive(pid, record.watcher_start)

    def _evaluate(self, record: JobRecord) -> tuple[str, str, int | None, float | None]:
        """(state, detail, exit_code, ended_at) from /proc, the exit file and the watcher; terminal states stick."""
        info = record.info
        if info.state in TERMINAL:
            return info.state, record.detail, info.exit_code, info.ended_at
        if info.pid == 0:
            if time.time() - info.started_at > START_TIMEOUT_S:
                return "stale", "the start never completed (no leader PID was recorded)", None, None
            return "unknown", "starting", None, None
        stat = procs.read_stat(info.pid)
        if stat is not None and stat.running and stat.start_time == info.start_time_ticks:
            if record.detail.startswith(STOP_INCOMPLETE):
                return "running", record.detail, None, None
            lost = record.watcher_pid and not self._watcher_alive(record)
            return "running", WATCHER_LOST.format(pid=record.watcher_pid) if lost else "", None, None
        exit_code, ended_at = read_exit_file(info.job_dir)
        stop_at, stop_detail = record.stop_requested_at, record.detail
        if not stop_at:  # a stop that could not be written to jobs.db (a full disk) left its record in the job dir
            stop_at, slot_detail = read_stop_slot(info.job_dir)
            stop_detail = slot_detail or stop_detail
        if exit_code is not None:
            if not stop_at:
                return "exited", self._failure_detail(record, exit_code), exit_code, ended_at
            return "stopped", stop_detail, exit_code, ended_at
        if stat is not None and stat.running:
            return (
                "stale",
                (f"PID {info.pid} now belongs to another program (start time {stat.start_time}, recorded {info.start_time_ticks}); never signalled"),
                None,
                None,
            )
        if self._watcher_alive(record):
            return "running", "leader exiting; waiting for its exit status", None, None
        if stop_at:
            return "stopped", stop_detail or "stopped; exit status not recorded", None, stop_at
        why = "adopted, so its exit status is unknown" if info.adopted else "no exit status was recorded"
        return "stale", f"process {info.pid} is gone; {why}", None, None

    @staticmethod
    def _failure_detail(record: JobRecord, exit_code: int) -> str:
        """Why a distributed job failed, from torchrun's summary in its stderr (a node's part of a multi-node run
        says which rank failed first and how); empty for a clean exit or an ordinary job."""
        info = record.info
        if exit_code == 0 or not (info.run_id or any("torch.distributed.run" in arg for arg in info.argv[:3])):
            return ""
        try:
            found = torchrun_failure(tail_lines(info.stderr_path, FAILURE_TAIL_LINES))
        except OSError:
            found = None
        return found or f"exited {exit_code}; torchrun's failure summary is not in {info.stderr_path}"

    def _reap_watchers(self) -> None:
        with self._watchers_lock:
            for job_id, proc in list(self._watchers.items()):
                if proc.poll() is not None:
                    del self._watchers[job_id]

    def refresh(self) -> list[JobRecord]:
        """Re-check every active job and store what changed; returns the active records."""
        self._reap_watchers()
        self._retry_read_write()
        records = self._prune_finished(self._active())
        changed = []
        for record in records:
            state, detail, exit_code, ended_at = self._evaluate(record)
            info = record.info
            if (state, detail, exit_code, ended_at) != (info.state, record.detail, info.exit_code, info.ended_at):
                info.state, record.detail, info.exit_code, info.ended_at = state, detail, exit_code, ended_at
                changed.append(record)
        if changed:
            self._try_write("job states", lambda db: self._store_states(db, changed))
        return records

    def _prune_finished(self, records: list[JobRecord]) -> list[JobRecord]:
        """Archive the oldest finished records beyond FINISHED_KEPT (kept in jobs.db, archived = 1, as a reused name's are).

        A long-used host gathers thousands of finished records, and every tick of the agent reads, checks and sends
        each one (10,000 took 60 % of a core). Only a record whose watcher is gone is archived: the watcher reaps the
        job's last orphan before it exits, so nothing of an archived job can still run for a stop to miss."""
        finished = [record for record in records if record.info.state in TERMINAL]
        if len(finished) <= FINISHED_KEPT:
            return records
        finished.sort(key=lambda record: (record.info.ended_at or record.info.started_at, record.id))
        prunable = [record for record in finished[: len(finished) - FINISHED_KEPT] if not self._watcher_alive(record)]

        def archive(db: sqlite3.Connection) -> None:
            for record in prunable:
                self._archive_record(db, record)

        if not prunable or not self._try_write("archive finished records", archive):
            return records
        archived = {record.id for record in prunable}
        return [record for record in records if record.id not in archived]

    def _store_states(self, db: sqlite3.Connection, records: list[JobRecord]) -> None:
        for record in records:
            info = record.info
            self._update(db, record.id, state=info.state, detail=record.detail, exit_code=info.exit_code, ended_at=info.ended_at)

    def list_jobs(self) -> list[JobInfo]:
        return [record.info for record in self.refresh()]

    def list_records(self) -> list[JobRecord]:
        return self.refresh()

    def get(self, name: str) -> JobRecord:
        for record in self.refresh():
            if record.name == name:
                return record
        raise JobNotFound(f"no job named {name!r} in {self.db_path}")

    # ------------------------------------------------------------ start

    def _job_env(self, name: str, job_dir: Path, env: dict[str, str] | None) -> dict[str, str]:
        merged = dict(os.environ)
        merged.pop(JOB_TOKEN_ENV, None)
        merged.update(env or {})
        merged["EAGLE3_JOB_DIR"] = str(job_dir)
        merged["EAGLE3_RUN_DIR"] = str(self.run_dir)
        merged["EAGLE3_JOB_NAME"] = name
        old_path = merged.get("PYTHONPATH")
        merged["PYTHONPATH"] = PACKAGE_PARENT + (os.pathsep + old_path if old_path else "")
        return merged

    @staticmethod
    def _check_start_params(name: str, kind: str, argv: Any, cwd: Any, env: Any) -> None:
        if not isinstance(name, str) or not NAME_PATTERN.match(name):
            raise JobBadParams(f"name: {name!r} is not a job name (letters, digits, '.', '_', '-'; at most 64; no '/' or ':')")
        if kind not in KINDS or kind == "adopted":
            raise JobBadParams(f"kind: {kind!r} is not one of {', '.join(k for k in KINDS if k != 'adopted')}")
        if not isinstance(argv, list) or not argv or not all(isinstance(arg, str) for arg in argv):
            raise JobBadParams("argv: expected a non-empty list of strings")
        if any("\0" in arg for arg in argv):
            raise JobBadParams("argv: an argument contains a NUL byte, which no program can receive; nothing was started")
        if cwd is not None and (not isinstance(cwd, str) or "\0" in cwd or not Path(cwd).is_dir()):
            raise JobBadParams(f"cwd: {cwd!r} is not a directory")
        if env is not None:
            JobRegistry._check_env(env)

    @staticmethod
    def _check_node(node: Any, argv: list[str]) -> dict[str, Any]:
        try:
            checked = check_node(node)
        except ValueError as exc:
            raise JobBadParams(f"{exc}; nothing was started") from None
        conflicts = node_argv_conflicts(argv, checked)
        if conflicts:
            raise JobBadParams(f"node: the command line disagrees with it ({'; '.join(conflicts)}); nothing was started")
        return checked

    @staticmethod
    def _check_env(env: Any) -> None:
        if not (isinstance(env, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in env.items())):
            raise JobBadParams("env: expected an object of string to string")
        for key, value in env.items():
            if not key or "=" in key or "\0" in key:
                raise JobBadParams(f"env: {key!r} is not a variable name (empty, or holds '=' or a NUL byte); nothing was started")
            if "\0" in value:
                raise JobBadParams(f"env: the value of {key} contains a NUL byte, which no environment can hold; nothing was started")

    @staticmethod
    def _check_executable(argv: list[str], env: dict[str, str], cwd: str | None) -> None:
        program = argv[0]
        if os.sep in program:
            path = Path(cwd or ".") / program
            if not (path.is_file() and os.access(path, os.X_OK)):
                raise JobBadParams(f"argv: {program!r} is not an executable file; nothing was started")
        elif shutil.which(program, path=env.get("PATH")) is None:
            raise JobBadParams(f"argv: {program!r} was not found on PATH; nothing was started")

    def _archive_dir(self, job_dir: Path, moved: list[tuple[Path, Path]] | None = None) -> Path:
        """Rename a finished job's directory aside (never delete): NAME.YYYYmmdd-HHMMSS[-N]; `moved` collects (old, new) for an undo."""
        stamp = time.strftime("%Y%m%d-%H%M%S")
        target = job_dir.with_name(f"{job_dir.name}.{stamp}")
        counter = 1
        while target.exists():
            target = job_dir.with_name(f"{job_dir.name}.{stamp}-{counter}")
            counter += 1
        job_dir.rename(target)
        if moved is not None:
            moved.append((job_dir, target))
        return target

    def _archive_record(self, db: sqlite3.Connection, record: JobRecord, moved: list[tuple[Path, Path]] | None = None) -> None:
        old_dir = Path(record.info.job_dir)
        new_dir = self._archive_dir(old_dir, moved) if old_dir.exists() else old_dir

        def relocated(path: str) -> str:
            return str(new_dir / Path(path).relative_to(old_dir)) if path.startswith(str(old_dir) + os.sep) else path

        self._update(
            db, record.id, archived=1, job_dir=str(new_dir), stdout_path=relocated(record.info.stdout_path), stderr_path=relocated(record.info.stderr_path)
        )

    def _claim_name(self, db: sqlite3.Connection, name: str, moved: list[tuple[Path, Path]] | None = None) -> None:
        """Raise JobConflict if `name` is in use; archive a finished job of that name otherwise."""
        for record in self._active(db, name):
            state, detail, _, _ = self._evaluate(record)
            if state in ("running", "unknown"):
                raise JobConflict(f"job {name!r} is {state} (pid {record.info.pid}); stop it or pick another name. Nothing was started")
            leftovers = [t.pid for t in self._plan_job(record, self._context(self._active(db))).targets]
            if leftovers:
                raise JobConflict(f"job {name!r} has ended but its processes {leftovers} still run; stop it first. Nothing was started")
            self._archive_record(db, record, moved)
        job_dir = self.jobs_dir / name
        if job_dir.exists():
            self._archive_dir(job_dir, moved)

    def start_job(
        self, name: str, kind: str, argv: list[str], cwd: str | None = None, env: dict[str, str] | None = None, node: dict[str, Any] | None = None
    ) -> JobInfo:
        """Start argv as job `name` in its own session, logs under run_dir/jobs/<name>/; returns once its leader is recorded.

        `node` ({"run_id", "node_rank", "nnodes", "rdzv_endpoint"}) makes it this host's part of a multi-node run:
        stored with the record, and the job's environment gains EAGLE3_RUN_ID/NODE_RANK/NNODES and commands.NODE_ENV
        (what `env` names wins).
        """
        self._check_start_params(name, kind, argv, cwd, env)
        if node is not None:
            node = self._check_node(node, argv)
            env = {**NODE_ENV, "EAGLE3_RUN_ID": node["run_id"], "EAGLE3_NODE_RANK": str(node["node_rank"]), "EAGLE3_NNODES": str(node["nnodes"]), **(env or {})}
        if is_own_python_command(argv):
            env = {**SAFE_PATH_ENV, **(env or {})}
        argv = resolve_argv(argv)
        job_dir = self.jobs_dir / name
        job_env = self._job_env(name, job_dir, env)
        self._check_executable(argv, job_env, cwd)
        self._check_room(name)
        token = secrets.token_hex(16)
        job_id = self._insert_starting(name, kind, argv, cwd, job_dir, token, node)
        try:
            leader = self._spawn_watcher(job_id, job_dir, argv, cwd, {**job_env, WATCH_TOKEN_ENV: token})
        except Exception as exc:  # the record exists: end it instead of leaving it "starting"
            leader = {"error": f"the watcher could not be started: {exc}", "exit_code": 127}
        try:
            with self._write() as db:
                self._store_leader(db, job_id, leader)
        except WRITE_ERRORS as exc:
            raise self._undo_start(name, job_id, leader, exc) from None
        if "error" in leader:
            raise JobError(f"job {name!r} could not start: {leader['error']} (record kept as exited; see {job_dir / 'stderr.log'})")
        return self.get(name).info

    def _check_room(self, name: str) -> None:
        """Refuse a start up front when the run dir's disk is (nearly) full or jobs.db can only be read: nothing is written."""
        self._db()
        self._retry_read_write()
        free = self._free_bytes()
        if free is not None and free < START_MIN_FREE:
            raise JobNoSpace(
                f"no space to start job {name!r}: {free} bytes free on the disk of {self.run_dir} (a start needs {START_MIN_FREE >> 10} KiB"
                " for its record, logs and exit status). Nothing was started and nothing was written; free space there and retry"
            )
        why = getattr(self._local, "read_only", None)
        if why is not None:
            raise JobNoSpace(f"cannot start job {name!r}: {self.db_path} can only be read ({why}). Nothing was started and nothing was written")

    def _insert_starting(self, name: str, kind: str, argv: list[str], cwd: str | None, job_dir: Path, token: str, node: dict[str, Any] | None) -> int:
        """The record of a start, committed before anything runs."""
        node_values = tuple((node or {}).get(column) for column in NODE_COLUMNS)
        values = (name, kind, json.dumps(argv), cwd, str(job_dir), str(job_dir / "stdout.log"), str(job_dir / "stderr.log"), time.time(), token, *node_values)
        sql = (
            "INSERT INTO jobs (name, kind, state, detail, argv, cwd, job_dir, stdout_path, stderr_path, started_at, token,"
            " run_id, node_rank, nnodes, rdzv_endpoint) VALUES (?, ?, 'unknown', 'starting', ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)"
        )
        return self._insert_record(f"start job {name!r}", name, job_dir, "Nothing was started and no record was written", sql, values)

    def _insert_record(self, what: str, name: str, job_dir: Path, untouched: str, sql: str, values: tuple) -> int:
        """Claim the name, make the job dir and insert its row in one transaction; on a failed write the job dirs are put back as they were."""
        moved: list[tuple[Path, Path]] = []
        created = False
        try:
            with self._write() as db:
                self._claim_name(db, name, moved)
                job_dir.mkdir(mode=PRIVATE_DIR, parents=True)
                created = True
                job_id = db.execute(sql, values).lastrowid
                assert job_id is not None  # sqlite3 sets lastrowid after every INSERT that succeeded
            return job_id
        except WRITE_ERRORS as exc:
            if created:
                _quietly(job_dir.rmdir)
            for old, new in reversed(moved):
                _quietly(lambda: new.rename(old))
            raise self._write_failed(what, exc, untouched) from None

    def _store_leader(self, db: sqlite3.Connection, job_id: int, leader: dict[str, Any]) -> None:
        if "error" in leader:
            self._update(db, job_id, state="exited", detail=leader["error"], exit_code=leader.get("exit_code"), ended_at=time.time())
            return
        self._update(
            db,
            job_id,
            state="running",
            detail="",
            pid=leader["pid"],
            pgid=leader["pgid"],
            start_time_ticks=leader["start_time_ticks"],
            watcher_pid=leader["watcher_pid"],
            watcher_start=leader["watcher_start"],
            cgroup=leader.get("cgroup"),
        )

    def _undo_start(self, name: str, job_id: int, leader: dict[str, Any], exc: BaseException) -> JobError:
        """The leader could not be recorded: kill what was started (a job nobody can stop must not run), drop the record."""
        killed = ""
        records = self._active(name=name)
        if "error" not in leader and records:
            record = records[0]
            record.info.state, record.info.pid, record.info.pgid = "running", leader["pid"], leader["pgid"]
            record.info.start_time_ticks, record.cgroup = leader["start_time_ticks"], leader.get("cgroup")
            record.watcher_pid, record.watcher_start = leader["watcher_pid"], leader["watcher_start"]
            plan = self._plan_job(record, self._context(self._active(), tokens=True))
            verdicts = self._stop_plans([plan], 0.0, 5.0)
            alive = [v.pid for v in verdicts if v.outcome == "survived"]
            killed = f"; it was killed again (PID {leader['pid']})" + (f", but PID {', '.join(map(str, alive))} still run" if alive else ", nothing of it runs")
        dropped = self._try_write("drop a half-started record", lambda db: db.execute("DELETE FROM jobs WHERE id = ?", (job_id,)))
        left = "its record was removed" if dropped else "its record stays in jobs.db as 'starting' and will show stale"
        return self._write_failed(f"start job {name!r}", exc, f"The job's start could not be recorded{killed}; {left}")

    def _write_failed(self, what: str, exc: BaseException, untouched: str) -> JobError:
        free = self._free_bytes()
        if getattr(exc, "errno", None) in (errno.ENOSPC, errno.EDQUOT) or "full" in str(exc) or (free is not None and free < 65536):
            return JobNoSpace(f"no space left on the disk of {self.run_dir} ({free} bytes free) to {what} ({exc}). {untouched}; free space and retry")
        return JobError(f"could not write to {self.db_path} to {what}: {exc}. {untouched}")

    def _spawn_watcher(self, job_id: int, job_dir: Path, argv: list[str], cwd: str | None, env: dict[str, str]) -> dict[str, Any]:
        with open(job_dir / "watcher.log", "ab", opener=private_opener) as watcher_log:
            proc = subprocess.Popen(
                watcher_argv(job_dir, argv),
                cwd=cwd,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=watcher_log,
                start_new_session=True,
            )
        with self._watchers_lock:
            self._watchers[job_id] = proc
        stdout = proc.stdout
        assert stdout is not None  # Popen(stdout=PIPE) always opens it
        try:
            ready, _, _ = select.select([stdout], [], [], START_TIMEOUT_S)
            line = stdout.readline() if ready else b""
        finally:
            stdout.close()
        try:
            return json.loads(line)
        except json.JSONDecodeError:
            log = job_dir / "watcher.log"
            why = "exited before reporting a leader" if ready else f"did not report a leader within {START_TIMEOUT_S:.0f}s"
            tail = " | ".join(tail_lines(log, 3)) if log.exists() else ""
            return {"error": f"the watcher {why} ({log}: {tail or 'empty'})"}

    # ------------------------------------------------------------ adopt

    def adopt(self, pid: int, name: str, confirm_pid: int, other_user: bool = False) -> JobInfo:
        """Register a process this tool did not start, only when the operator typed its PID a second time.

        Never a kernel thread, PID 1, this process or its ancestors; another user's process only when we are
        root and `other_user` confirms it.
        """
        if isinstance(pid, bool) or not isinstance(pid, int) or pid <= 0:
            raise JobBadParams(f"pid: {pid!r} is not a process ID; nothing was adopted")
        if confirm_pid != pid:
            raise JobRefused(f"confirmation PID {confirm_pid} does not match PID {pid}; nothing was adopted")
        if not isinstance(name, str) or not NAME_PATTERN.match(name):
            raise JobBadParams(f"name: {name!r} is not a job name")
        stat = procs.read_stat(pid)
        if stat is None or not stat.running:
            raise JobNotFound(f"no running process with PID {pid}; nothing was adopted")
        self._check_adoptable(stat, other_user)
        owner = self.owned_pids([pid]).get(pid)
        if owner is not None:
            raise JobConflict(f"PID {pid} already belongs to job {owner!r}; nothing was adopted")
        job_dir = self.jobs_dir / name
        sql = (
            "INSERT INTO jobs (name, kind, state, pid, pgid, start_time_ticks, argv, job_dir, stdout_path, stderr_path, started_at, adopted)"
            " VALUES (?, 'adopted', 'running', ?, ?, ?, ?, ?, ?, ?, ?, 1)"
        )
        stdout_path, stderr_path = _output_file(pid, 1) or str(job_dir / "stdout.log"), _output_file(pid, 2) or str(job_dir / "stderr.log")
        values = (name, pid, stat.pgid, stat.start_time, json.dumps(procs.cmdline_args(pid)), str(job_dir), stdout_path, stderr_path, time.time())
        self._insert_record(f"adopt PID {pid} as job {name!r}", name, job_dir, "Nothing was adopted and no record was written", sql, values)
        return self.get(name).info

    @staticmethod
    def _check_adoptable(stat: procs.ProcStat, other_user: bool) -> None:
        pid = stat.pid
        if pid == 1:
            raise JobRefused("PID 1 is the init process: stopping it would take the host down. Nothing was adopted")
        if stat.kernel_thread:
            raise JobRefused(f"PID {pid} [{stat.comm}] is a kernel thread, not a program: it cannot be stopped. Nothing was adopted")
        if pid in protected_pids():
            raise JobRefused(f"PID {pid} is this tool or one of its parents; nothing was adopted")
        uid, my_uid = procs.uid_of(pid), os.getuid()
        if uid != my_uid and not (other_user and my_uid == 0):
            how = "confirm with --other-user (root only)" if my_uid == 0 else "run as root with --other-user"
            raise JobRefused(
                f"PID {pid} belongs to user {procs.user_name(uid) or '?'}, not {procs.user_name(my_uid)}; to adopt it anyway {how}. Nothing was adopted"
            )

    # ------------------------------------------------------------ discovery

    def _recorded(self, job_id: int) -> list[sqlite3.Row]:
        return self._db().execute("SELECT pid, start_time, role FROM job_procs WHERE job_id = ?", (job_id,)).fetchall()

    def _token_pids(self, table: procs.ProcTable, tokens: set[str]) -> dict[str, list[int]]:
        """Processes whose start environment carries a job token (same user only; one /proc/PID/environ read each)."""
        found: dict[str, list[int]] = {}
        if not tokens:
            return found
        my_uid = os.getuid()
        for pid, stat in table.stats.items():
            if not stat.running or (my_uid != 0 and procs.uid_of(pid) != my_uid):
                continue
            value = procs.environ_value(pid, JOB_TOKEN_ENV)
            if value in tokens:
                found.setdefault(value, []).append(pid)
        return found

    def _context(self, records: list[JobRecord], tokens: bool = False) -> Discovery:
        """One /proc scan plus what every plan needs: token holders, cgroup members, protected pids, every job's leader and watcher."""
        table = procs.ProcTable.scan()
        token_pids = self._token_pids(table, {r.token for r in records if r.token}) if tokens else {}
        cgroup_pids = {r.id: procs.cgroup_pids(r.cgroup) for r in records if procs.is_job_cgroup(r.cgroup)}
        roots = {pid: r.id for r in records for pid in (r.info.pid, r.watcher_pid) if pid}
        return Discovery(table, token_pids, protected_pids(), roots, cgroup_pids)

    def _plan_job(self, record: JobRecord, ctx: Discovery, proven: Iterable[Target] = ()) -> JobPlan:
        """Every live process provably belonging to this job; another job's leader or watcher ends a walk.

        Proof is any of: the verified leader, its group and (while the leader lives, pinning the number) its session;
        a descendant of the leader, of the live watcher or of any process proven here (`proven`: found earlier in this
        stop, identity checked again); a recorded descendant with its start time; the job token in the environment; the
        job's cgroup."""
        state, detail, _, _ = self._evaluate(record)
        plan = JobPlan(record, state)
        info, table = record.info, ctx.table
        if state in ("stale", "unknown"):
            plan.stale_reason = detail or state
            return plan
        others = {pid for pid, job_id in ctx.roots.items() if job_id != record.id}
        targets: dict[int, Target] = {}
        protected: dict[int, Target] = {}

        def add(pid: int, role: str | None = None) -> None:
            stat = table.stats.get(pid)
            if pid in targets or pid in protected or pid in others or pid == record.watcher_pid or not _signallable(stat):
                return
            role = role or ("group" if stat.pgid == info.pgid else "descendant")
            target = Target(pid, stat.start_time, stat.pgid, role, info.name, procs.cmdline(pid))
            (protected if pid in ctx.protected else targets)[pid] = target

        if state == "running" and table.alive(info.pid, info.start_time_ticks):
            add(info.pid, "leader")
            leader_pgid = table.stats[info.pid].pgid
            # An adopted process may share its group with a shell that is not ours: group-signal only a group it leads.
            plan.group_signal = leader_pgid == info.pgid > 1 and (not info.adopted or info.pgid == info.pid)
            if plan.group_signal:
                for pid in table.group(info.pgid):
                    add(pid)
            for pid in table.descendants(info.pid, prune=others):
                add(pid)
            # A leader this tool started leads its own session: nobody outside the job can join it (an adopted one may
            # lead a login shell's session, so only its tree and group count)
            if table.stats[info.pid].sid == info.pid and not info.adopted:
                for pid in table.session(info.pid):
                    add(pid, None if table.stats[pid].pgid == info.pgid else "session")
        for target in proven:
            if table.alive(target.pid, target.start):
                add(target.pid, target.role)
        if record.watcher_pid and table.alive(record.watcher_pid, record.watcher_start):
            for pid in table.descendants(record.watcher_pid, prune=others):
                add(pid)
        for row in self._recorded(record.id):
            if table.alive(row["pid"], row["start_time"]):
                add(row["pid"], row["role"])
        for pid in ctx.token_pids.get(record.token or "", []) + ctx.cgroup_pids.get(record.id, []):
            add(pid)
        for pid in table.descendants_of([*targets, *protected], prune=others):  # a child of a proven process is the job's
            add(pid)
        plan.targets = sorted(targets.values(), key=lambda t: (t.role != "leader", t.pid))
        plan.protected = sorted(protected.values(), key=lambda t: t.pid)
        return plan

    def _select(self, records: list[JobRecord], names: list[str] | None, all_jobs: bool) -> list[JobRecord]:
        if all_jobs:
            return records
        by_name = {record.name: record for record in records}
        missing = [name for name in names or [] if name not in by_name]
        if missing or not names:
            raise JobNotFound(f"no job named {', '.join(map(repr, missing)) or '(none given)'}; known: {', '.join(sorted(by_name)) or 'none'}")
        return [by_name[name] for name in dict.fromkeys(names)]  # a name given twice is stopped once

    def _plans(self, names: list[str] | None, all_jobs: bool) -> list[JobPlan]:
        records = self.refresh()
        selected = self._select(records, names, all_jobs)
        ctx = self._context(records, tokens=True)
        plans = [self._plan_job(record, ctx) for record in selected]
        if all_jobs:
            plans = [plan for plan in plans if plan.targets or plan.protected or plan.state in ("stale", "unknown")]
        return plans

    def owned_pids(self, candidates: Iterable[int] | None = None) -> dict[int, str]:
        """{pid: job name} for live processes of active jobs; candidates not found in a job tree are checked by token."""
        records = self.refresh()
        ctx = self._context(records)
        owners: dict[int, str] = {}
        for record in records:
            for target in self._plan_job(record, ctx).targets:
                owners.setdefault(target.pid, record.name)
        tokens = {record.token: record.name for record in records if record.token and record.info.state != "stale"}
        for pid in candidates or []:
            if pid not in owners and ctx.table.alive(pid):
                value = procs.environ_value(pid, JOB_TOKEN_ENV)
                if value in tokens:
                    owners[pid] = tokens[value]
        return owners

    def record_descendants(self) -> int:
        """Store the current processes of running jobs, so a descendant that later loses its parent is still known."""
        records = self.refresh()
        ctx = self._context(records)
        now = time.time()
        rows = [
            (record.id, target.pid, target.start, target.role, target.cmdline, now)
            for record in records
            if record.info.state == "running"
            for target in self._plan_job(record, ctx).targets
            if target.role != "leader"
        ]
        if rows:
            self._try_write("job processes", lambda db: db.executemany("INSERT OR IGNORE INTO job_procs VALUES (?, ?, ?, ?, ?, ?)", rows))
        return len(rows)

    # ------------------------------------------------------------ stop

    def stop_plan(self, names: list[str] | None = None, all_jobs: bool = False, foreign_holders: list[dict] | None = None) -> StopPlan:
        """What stop would do, computed without signalling anything."""
        plans = self._plans(names, all_jobs)
        states = {t.pid: _process_state(t) for plan in plans for t in plan.targets}
        return StopPlan(
            jobs=[plan.record.name for plan in plans],
            will_signal=[
                {"pid": t.pid, "job": t.job, "cmdline": t.cmdline, "role": t.role, **({"state": PROCESS_STATE_NOTES[states[t.pid]]} if states[t.pid] else {})}
                for plan in plans
                for t in plan.targets
            ],
            stale=[{"job": plan.record.name, "pid": plan.record.info.pid, "reason": plan.stale_reason} for plan in plans if plan.stale_reason],
            foreign_gpu_holders=foreign_holders or [],
            checkpoint_first=any(plan.record.info.kind == "train" and _can_checkpoint(plan, states) for plan in plans),
        )

    def stop(
        self,
        names: list[str] | None = None,
        all_jobs: bool = False,
        grace: float = 30.0,
        kill_wait: float = 5.0,
        gpu_source=None,
        gpu_release_timeout: float = 15.0,
    ) -> list[ProcessVerdict]:
        """SIGTERM each job, wait `grace`, freeze what is left, SIGKILL all of it, confirm all gone.

        One stop per job at a time (a lock on its directory): a concurrent stop waits for it, then finds what is
        left, so no process gets SIGTERM twice. Writes are best effort and come after the signals they describe.
        """
        check_stop_seconds(grace=grace, kill_wait=kill_wait, gpu_release_timeout=gpu_release_timeout)
        self._local.unrecorded = []
        selected = self._select(self.refresh(), names, all_jobs)
        with self._job_locks(selected, timeout=grace + kill_wait + gpu_release_timeout + 60):
            plans = [plan for plan in self._plans(names, all_jobs) if plan.record.id in {r.id for r in selected}]
            verdicts = self._stop_plans(plans, grace, kill_wait)
            verdicts += self._escapees(plans, verdicts)
            self._confirm_gpu_released(verdicts, gpu_source, gpu_release_timeout)
            self._finish_records([plan for plan in plans if plan.targets or plan.protected], f"stopped by operator (grace {grace:g}s)", verdicts)
        self._mention_unrecorded(verdicts)
        return verdicts

    def _escapees(self, plans: list[JobPlan], verdicts: list[ProcessVerdict]) -> list[ProcessVerdict]:
        """After the kill: processes that still carry a trace of a stopped job but no proof. Named (the stop fails), never signalled.

        A trace is: stdout or stderr on the job's own log; an environment naming the job's directory without its token;
        the job's session or group number once its leader and watcher are gone (the number may be another program's
        by now). A process holding any job's token, a watcher, a job's leader, this stop and its parents are skipped."""
        if not plans:
            return []
        table = procs.ProcTable.scan()
        records = self._active()
        skip = protected_pids() | {pid for r in records for pid in (r.info.pid, r.watcher_pid) if pid}
        skip |= {t.pid for plan in plans for t in plan.targets + plan.protected}
        facts = {pid: _traces(pid) for pid, stat in table.stats.items() if pid not in skip and _signallable(stat)}
        facts = {pid: fact for pid, fact in facts.items() if not (fact.env.get(JOB_TOKEN_ENV) or fact.env.get(WATCH_TOKEN_ENV))}
        found = []
        for plan in plans:
            note = self._lost_watcher_note(plan.record)
            for pid, why in self._job_traces(plan.record, table, facts).items():
                command = procs.cmdline(pid)
                detail = (
                    f"job {plan.record.name}: NOT signalled: {'; '.join(why)}; but nothing proves it is the job's (outside its process tree,"
                    f" session and cgroup, no job token){note}. Check it and end it by hand if it is: {command[:160]}"
                )
                plan.escaped.append(ProcessVerdict(pid, "unproven", "survived", detail))
            if note:
                for verdict in verdicts:
                    if verdict.pid == plan.record.info.pid and verdict.role in ("leader", "stale"):
                        verdict.detail += note
            if note and (plan.targets or plan.protected):  # it ran until this stop: what it detached may live on untraced
                plan.escaped.append(self._unverified(plan.record))
            found += plan.escaped
        return found

    @staticmethod
    def _unverified(record: JobRecord) -> ProcessVerdict:
        """The verdict for a running job whose watcher was killed: the stop cannot vouch that nothing escaped."""
        detail = (
            f"job {record.name}: its watcher (PID {record.watcher_pid}) died while the job ran (killed?), so processes the job"
            " detached since then may live on with nothing left that ties them to it: this stop cannot vouch that nothing of the"
            " job escaped. Look for them by hand (ps -eo pid,ppid,sid,lstart,args) and end what is yours"
        )
        return ProcessVerdict(record.watcher_pid or 0, WATCHER_ROLE, UNVERIFIED, detail)

    def _lost_watcher_note(self, record: JobRecord) -> str:
        if not record.watcher_pid or self._watcher_alive(record) or read_exit_file(record.info.job_dir)[0] is not None:
            return ""
        return (
            f"; the job's watcher (PID {record.watcher_pid}) died before recording the job's exit (killed?), so a process the job"
            " detached after that could not be followed"
        )

    @staticmethod
    def _job_traces(record: JobRecord, table: procs.ProcTable, facts: dict[int, Traces]) -> dict[int, list[str]]:
        info = record.info
        logs = {info.stdout_path: "stdout", info.stderr_path: "stderr"}
        leader = table.stats.get(info.pid)
        leader_gone = leader is None or (not leader.running and leader.start_time == info.start_time_ticks)  # a zombie leader is gone too
        numbers_free = info.pid > 1 and leader_gone and not (record.watcher_pid and table.alive(record.watcher_pid, record.watcher_start))
        found: dict[int, list[str]] = {}
        for pid, fact in facts.items():
            stat = table.stats[pid]
            why = [f"its {name} is the job's {logs[path]} log {path}" for name, path in fact.stdio.items() if path in logs]
            if fact.env.get("EAGLE3_JOB_DIR") == info.job_dir:
                why.append(f"its environment names the job's directory (EAGLE3_JOB_DIR={info.job_dir}) but lacks the job's token")
            if numbers_free and (stat.sid == info.pid or stat.pgid == info.pgid == info.pid):
                what = "session" if stat.sid == info.pid else "process group"
                why.append(f"it is in the {what} of the job's leader PID {info.pid}, which is gone, so that number may belong to another program by now")
            if why:
                found[pid] = why
        return found

    def _stop_plans(self, plans: list[JobPlan], grace: float, kill_wait: float) -> list[ProcessVerdict]:
        verdicts = [
            ProcessVerdict(plan.record.info.pid, "leader", "stale_not_signalled", f"job {plan.record.name}: {plan.stale_reason}")
            for plan in plans
            if plan.stale_reason
        ]
        active = [plan for plan in plans if plan.targets or plan.protected]
        if not active:
            return verdicts
        status = self._terminate(active, grace, f"stopped by operator (grace {grace:g}s)")
        self._kill_rest(active, status, kill_wait)
        return verdicts + self._verdicts(active, status)

    def _terminate(self, active: list[JobPlan], grace: float, detail: str) -> dict[int, str]:
        """SIGTERM every target, record the stop (best effort), wait up to `grace` for the targets to go."""
        now = time.time()
        status: dict[int, str] = {}
        for plan in active:
            plan.record.stop_requested_at = now  # in memory first: discovery must not call a job we are stopping stale
            termed = self._signal_all(plan, plan.targets, signal.SIGTERM)
            self._continue_stopped(plan.targets)
            status.update({t.pid: "termed" if t.pid in termed else "already_gone" for t in plan.targets})
        self._remember(active)

        def record_stop(db: sqlite3.Connection) -> None:
            for plan in active:
                self._update(db, plan.record.id, stop_requested_at=now, detail=detail)

        if not self._try_write("stop request", record_stop):
            self._keep_in_slots(active, now, detail)
        termed_targets = [t for plan in active for t in plan.targets if status[t.pid] == "termed"]
        self._wait_gone(termed_targets, grace)
        return status

    def _kill_rest(self, active: list[JobPlan], status: dict[int, str], kill_wait: float) -> None:
        """Freeze and SIGKILL whatever of each job is still alive, forked during the grace period included."""
        records = self._active()
        sent = [target for plan in active for target in self._freeze_and_kill(plan, records, kill_wait)]
        survivors = {t.pid for t in self._wait_gone(sent, kill_wait)}
        status.update({t.pid: "survived" if t.pid in survivors else "killed" for t in sent})
        termed = {t.pid: t for plan in active for t in plan.targets if status.get(t.pid) == "termed"}
        status.update({pid: "survived" if procs.is_alive(pid, t.start) else "exited_on_term" for pid, t in termed.items()})

    def _freeze_and_kill(self, plan: JobPlan, records: list[JobRecord], kill_wait: float) -> list[Target]:
        """Freeze the job (its cgroup, else SIGSTOP until a fresh walk finds nothing new), then SIGKILL it; returns what was killed."""
        cgroup = self._usable_cgroup(plan)
        frozen_cgroup = cgroup if cgroup is not None and procs.cgroup_freeze(cgroup) else None
        inside: set[int] = set()
        found: dict[int, Target] = {}

        def discover() -> dict[int, int]:
            inside.clear()
            inside.update(procs.cgroup_pids(frozen_cgroup) if frozen_cgroup is not None else ())
            fresh = {t.pid: t for t in self._plan_job(plan.record, self._context(records, tokens=True), [*plan.targets, *found.values()]).targets}
            found.update(fresh)
            return {pid: t.start for pid, t in fresh.items() if pid not in inside}

        procs.freeze(discover, FREEZE_TIMEOUT_S)
        if frozen_cgroup is not None:
            found.update(self._cgroup_targets(plan, frozen_cgroup))  # complete: nothing in a frozen cgroup can fork
        self._add_late_targets(plan, found.values())
        sent = [t for t in found.values() if t.pid not in inside and procs.send_signal(t.pid, t.start, signal.SIGKILL)]
        if frozen_cgroup is not None:
            procs.cgroup_kill(frozen_cgroup, kill_wait)
            sent += [t for t in found.values() if t.pid in inside]
            procs.remove_cgroup(frozen_cgroup)
        return sent

    def _usable_cgroup(self, plan: JobPlan) -> Path | None:
        """The job's cgroup, unless it is gone or holds this process or an ancestor (freezing it would freeze us)."""
        path = plan.record.cgroup
        if not procs.is_job_cgroup(path) or set(procs.cgroup_pids(path)) & protected_pids():
            return None
        return Path(path)

    @staticmethod
    def _cgroup_targets(plan: JobPlan, cgroup: Path) -> dict[int, Target]:
        info = plan.record.info
        targets = {}
        for pid in procs.cgroup_pids(cgroup):
            stat = procs.read_stat(pid)
            if _signallable(stat):
                leader = pid == info.pid and stat.start_time == info.start_time_ticks
                role = "leader" if leader else "group" if stat.pgid == info.pgid else "descendant"
                targets[pid] = Target(pid, stat.start_time, stat.pgid, role, info.name, procs.cmdline(pid))
        return targets

    @staticmethod
    def _add_late_targets(plan: JobPlan, found: Iterable[Target]) -> None:
        known = {(t.pid, t.start) for t in plan.targets}
        plan.targets.extend(t for t in found if (t.pid, t.start) not in known)

    @contextmanager
    def _job_locks(self, records: list[JobRecord], timeout: float) -> Iterator[None]:
        """Hold every selected job's stop lock (in job id order, so two stops of overlapping sets cannot deadlock)."""
        deadline = time.monotonic() + timeout
        releases: list[Callable[[], None]] = []
        try:
            for record in sorted(records, key=lambda r: r.id):
                releases.append(self._lock_job(record, deadline))
            yield
        finally:
            for release in reversed(releases):
                release()

    def _lock_job(self, record: JobRecord, deadline: float) -> Callable[[], None]:
        """This thread's claim on the job, then an flock on its directory for other processes; flock dies with its holder."""
        while not self._claim_in_process(record.id):
            self._wait_for_other_stop(record, deadline)
        fd = None
        try:
            fd = os.open(record.info.job_dir, os.O_RDONLY | os.O_DIRECTORY)
            while not _try_flock(fd):
                self._wait_for_other_stop(record, deadline)
        except FileNotFoundError:
            pass  # no directory to lock (removed by hand): the in-process claim is all there is
        except BaseException:
            self._release_job(record.id, fd)
            raise
        return lambda: self._release_job(record.id, fd)

    def _claim_in_process(self, job_id: int) -> bool:
        with self._stop_lock:
            if job_id in self._stopping:
                return False
            self._stopping.add(job_id)
            return True

    def _release_job(self, job_id: int, fd: int | None) -> None:
        if fd is not None:
            os.close(fd)
        with self._stop_lock:
            self._stopping.discard(job_id)

    @staticmethod
    def _wait_for_other_stop(record: JobRecord, deadline: float) -> None:
        if time.monotonic() >= deadline:
            raise JobConflict(f"job {record.name!r} is being stopped by another stop that has not finished; this one signalled nothing. Try again when it ends")
        time.sleep(0.05)

    def _remember(self, plans: list[JobPlan]) -> None:
        now = time.time()
        rows = [(plan.record.id, t.pid, t.start, t.role, t.cmdline, now) for plan in plans for t in plan.targets if t.role != "leader"]
        if rows:
            self._try_write("job processes", lambda db: db.executemany("INSERT OR IGNORE INTO job_procs VALUES (?, ?, ?, ?, ?, ?)", rows))

    @staticmethod
    def _continue_stopped(targets: list[Target]) -> None:
        """SIGCONT every stopped target right after its SIGTERM (as systemd does): a stopped process keeps a SIGTERM
        pending until continued, so a SIGSTOPped trainer would never run its checkpoint and be SIGKILLed after the grace.
        After the SIGTERM, not before, so a continued process handles the TERM first instead of running on."""
        for target in targets:
            if _process_state(target) == "T":
                procs.send_signal(target.pid, target.start, signal.SIGCONT)  # identity checked again there

    @staticmethod
    def _signal_all(plan: JobPlan, targets: list[Target], signum: int) -> set[int]:
        """Signal the group once when it is provably ours, and every target outside it by identity; returns pids reached."""
        pgid = plan.record.info.pgid
        alive = {t.pid for t in targets if procs.is_alive(t.pid, t.start)}
        group_sent = False
        # A live, identity-checked member keeps the pgid number from being reused, so the group is still ours.
        # killpg would also reach a stopper that runs inside the group: then every member is signalled one by one.
        if plan.group_signal and not _group_holds_protected(pgid) and any(t.pid in alive and procs.pgid_of(t.pid) == pgid for t in targets):
            try:
                os.killpg(pgid, signum)
                group_sent = True
            except ProcessLookupError:
                pass
        reached = set()
        for target in targets:
            if target.pid not in alive:
                continue
            if (group_sent and target.pgid == pgid) or procs.send_signal(target.pid, target.start, signum):
                reached.add(target.pid)
        return reached

    @staticmethod
    def _wait_gone(targets: list[Target], timeout: float) -> list[Target]:
        deadline = time.monotonic() + timeout
        while True:
            alive = [t for t in targets if procs.is_alive(t.pid, t.start)]
            if not alive or time.monotonic() >= deadline:
                return alive
            time.sleep(0.05)

    @staticmethod
    def _verdicts(plans: list[JobPlan], outcome: dict[int, str]) -> list[ProcessVerdict]:
        verdicts = []
        for plan in plans:
            for target in plan.targets:
                result = outcome.get(target.pid, "already_gone")
                detail = f"job {target.job}: {target.cmdline[:120]}"
                if result == "survived":
                    stat = procs.read_stat(target.pid)
                    detail += f" (still alive in state {stat.state if stat else '?'} after SIGKILL)"
                verdicts.append(ProcessVerdict(target.pid, target.role, result, detail))
            for target in plan.protected:
                alive = procs.is_alive(target.pid, target.start)
                detail = (
                    f"job {target.job}: NOT signalled: it is this stop's own process or one of its parents; "
                    f"stop the job from outside it to end it ({target.cmdline[:120]})"
                )
                verdicts.append(ProcessVerdict(target.pid, target.role, "survived" if alive else "already_gone", detail))
        return verdicts

    @staticmethod
    def _confirm_gpu_released(verdicts: list[ProcessVerdict], gpu_source, timeout: float) -> None:
        """When a GPU source is available, wait until no stopped PID is listed as a compute process."""
        if gpu_source is None or getattr(gpu_source, "name", "none") == "none":
            return
        stopped = {v.pid for v in verdicts if v.outcome in ("exited_on_term", "killed", "already_gone")}
        deadline = time.monotonic() + timeout
        holding: dict[int, float | None] = {}
        while True:
            holding = {p.pid: p.used_memory_mib for s in gpu_source.sample() for p in s.processes if p.pid in stopped}
            if not holding or time.monotonic() >= deadline:
                break
            time.sleep(0.25)
        for verdict in verdicts:
            if verdict.pid in holding:
                verdict.detail += f"; GPU memory NOT released after {timeout:g}s ({holding[verdict.pid]} MiB still listed)"
            elif verdict.pid in stopped:
                verdict.detail += "; GPU memory released"

    def _finish_records(self, plans: list[JobPlan], detail: str, verdicts: list[ProcessVerdict]) -> None:
        """Wait briefly for each watcher's exit file, then store the stopped state, or what survived (best effort)."""
        survived = {v.pid for v in verdicts if v.outcome == "survived"}
        deadline = time.monotonic() + 3.0
        for plan in plans:
            left = sorted(t.pid for t in plan.targets + plan.protected if t.pid in survived)
            if left:
                note = f"{STOP_INCOMPLETE}: PID {', '.join(map(str, left))} still alive"
                self._try_write("stop result", lambda db: self._update(db, plan.record.id, detail=note))
                continue
            escaped = [v.pid for v in plan.escaped if v.outcome != UNVERIFIED]
            if escaped:
                detail = f"{detail}; {ESCAPED_NOTE}: PID {', '.join(map(str, escaped))} (not provably the job's, NOT signalled)"
            if any(v.outcome == UNVERIFIED for v in plan.escaped):
                detail += f"; {UNVERIFIED}: its watcher had been killed, so a process it detached may have escaped untraced"
            info = plan.record.info
            exit_code, ended_at = read_exit_file(info.job_dir)
            while exit_code is None and info.state == "running" and self._watcher_alive(plan.record) and time.monotonic() < deadline:
                time.sleep(0.02)
                exit_code, ended_at = read_exit_file(info.job_dir)
            if info.state == "running":
                # detail again: a refresh from another process may have written a transient one meanwhile
                values = dict(
                    state="stopped", detail=detail, exit_code=exit_code, ended_at=ended_at or time.time(), stop_requested_at=plan.record.stop_requested_at
                )
                if not self._try_write("stopped state", lambda db: self._update(db, plan.record.id, **values)):
                    self._keep_in_slots([plan], plan.record.stop_requested_at or time.time(), detail)
        self.refresh()

    def _keep_in_slots(self, plans: list[JobPlan], at: float, detail: str) -> None:
        """jobs.db refused the stop: keep it in each job dir's reserved slot, read back until jobs.db can store it."""
        for plan in plans:
            if write_stop_slot(plan.record.info.job_dir, at, detail):
                self._note_unrecorded(f"job {plan.record.name}: the stop is kept in {Path(plan.record.info.job_dir) / STOP_FILE} until jobs.db can be written")

    def _mention_unrecorded(self, verdicts: list[ProcessVerdict]) -> None:
        notes = self.unrecorded()
        if notes:
            for verdict in verdicts:
                verdict.detail += f"; NOT recorded in jobs.db ({notes[-1][:160]})"


PROCESS_STATE_NOTES = {
    "T": "stopped (SIGSTOP): continued after its SIGTERM",
    "t": "stopped by a debugger: cannot handle SIGTERM until the debugger lets it go",
    "D": "in uninterruptible sleep: handles SIGTERM only when its I/O returns",
}


@dataclass
class Traces:
    """What a process shows that could tie it to a job without proving it: where its stdout/stderr go, a few variables."""

    stdio: dict[str, str]  # "stdout"/"stderr" -> the file it writes to
    env: dict[str, str]


TRACE_VARIABLES = (JOB_TOKEN_ENV, WATCH_TOKEN_ENV, "EAGLE3_JOB_DIR")


def _traces(pid: int) -> Traces:
    return Traces(procs.stdio_files(pid), procs.environ_values(pid, TRACE_VARIABLES))


def _process_state(target: Target) -> str:
    """The /proc state letter of a target that will not simply handle its SIGTERM at once (a PROCESS_STATE_NOTES key), else ""."""
    stat = procs.read_stat(target.pid)
    if stat is None or stat.start_time != target.start or stat.state not in PROCESS_STATE_NOTES:
        return ""
    return stat.state


def _can_checkpoint(plan: JobPlan, states: dict[int, str]) -> bool:
    """A training job checkpoints on SIGTERM unless its leader is held by a debugger (a SIGSTOPped one is continued)."""
    leaders = [t for t in plan.targets if t.role == "leader"] or plan.targets
    return bool(leaders) and not any(states.get(t.pid) == "t" for t in leaders)


def _signallable(stat: procs.ProcStat | None) -> TypeGuard[procs.ProcStat]:
    """A live process that a stop may ever signal: never PID 1, never a kernel thread."""
    return stat is not None and stat.running and stat.pid > 1 and not stat.kernel_thread


def _group_holds_protected(pgid: int) -> bool:
    return pgid <= 1 or any(procs.pgid_of(pid) == pgid for pid in protected_pids())


def _quietly(action: Callable[[], object]) -> None:
    try:
        action()
    except OSError:
        pass


def _try_flock(fd: int) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False


def _output_file(pid: int, fd: int) -> str | None:
    """Where an adopted process's stdout/stderr goes, when that is a regular file we can tail."""
    try:
        target = os.readlink(f"/proc/{pid}/fd/{fd}")
    except OSError:
        return None
    return target if target.startswith("/") and os.path.isfile(target) else None


# ---------------------------------------------------------------- the watcher process


def _become_subreaper() -> None:
    """Orphaned descendants of the job get re-parented to the watcher instead of init (Linux prctl)."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER
    except (OSError, AttributeError):
        pass


def _report_leader(message: dict[str, Any]) -> None:
    """One JSON line to whoever started us, then stdout goes to /dev/null so a dead starter cannot hurt us."""
    try:
        sys.stdout.write(json.dumps(message) + "\n")
        sys.stdout.flush()
    except (BrokenPipeError, OSError):
        pass
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    os.close(devnull)


def _watcher_cgroup(job_dir: Path, token: str) -> Path | None:
    """The job's own cgroup (None where cgroup v2 is not writable); the watcher itself moves beside it, out of any job's."""
    cgroup = procs.create_job_cgroup(f"{job_dir.name}-{(token or str(os.getpid()))[:12]}")
    if cgroup is not None:
        procs.enter_cgroup(cgroup.parent)  # started from inside another job: stopping that job must not kill this watcher
    return cgroup


def _spawn_leader(argv: list[str], out, err, env: dict[str, str], cgroup: Path | None) -> tuple[subprocess.Popen, Path | None]:
    """Start argv in a new session, inside the cgroup when one is given (moved before exec, so before it can fork)."""
    common = dict(stdin=subprocess.DEVNULL, stdout=out, stderr=err, env=env, start_new_session=True)
    if cgroup is not None:

        def enter() -> None:
            if not procs.enter_cgroup(cgroup):
                raise OSError("could not enter the job cgroup")

        try:
            return subprocess.Popen(argv, preexec_fn=enter, **common), cgroup
        except subprocess.SubprocessError:
            procs.remove_cgroup(cgroup)  # could not enter it: run without a cgroup, the freeze-walk stop still holds
    return subprocess.Popen(argv, **common), None


def _write_exit_code(job_dir: Path, code: int) -> bool:
    """Replace the exit file atomically; on a full disk, write over the slot reserved at start. False when neither worked."""
    try:
        write_atomic(job_dir / EXIT_FILE, f"{code}\n")
        return True
    except OSError as exc:  # a full disk must not end the watcher: it still reaps the job's orphans
        if overwrite_slot(job_dir / EXIT_FILE, f"{code}"):
            return True
        try:
            print(f"eagle3 watcher: could not record exit code {code} yet: {exc}", file=sys.stderr, flush=True)
        except OSError:
            pass
        return False


def _retry_exit_code(job_dir: Path, code: int, deadline: float) -> None:
    """Keep trying to record the exit status until space returns (the job shows "waiting for its exit status" meanwhile)."""
    while time.monotonic() < deadline:
        time.sleep(2.0)
        if _write_exit_code(job_dir, code):
            return


def watch(job_dir: Path, argv: list[str]) -> int:
    """Run argv as the job leader, record leader.json and exit_code, reap orphans until none remain."""
    _become_subreaper()
    reserve_slot(job_dir / EXIT_FILE, EXIT_SLOT_BYTES)
    reserve_slot(job_dir / STOP_FILE, STOP_SLOT_BYTES)
    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(signum, lambda *_: None)  # a handler, not SIG_IGN: the job must start with default dispositions
    env = dict(os.environ)
    env[JOB_TOKEN_ENV] = env.pop(WATCH_TOKEN_ENV, "")
    cgroup = _watcher_cgroup(job_dir, env[JOB_TOKEN_ENV])
    with open(job_dir / "stdout.log", "ab", opener=private_opener) as out, open(job_dir / "stderr.log", "ab", opener=private_opener) as err:
        try:
            child, cgroup = _spawn_leader(argv, out, err, env, cgroup)
        except OSError as exc:
            err.write(f"eagle3 watcher: could not start {argv[0]!r}: {exc}\n".encode())
            _write_exit_code(job_dir, 127)
            if cgroup is not None:
                procs.remove_cgroup(cgroup)
            _report_leader({"error": f"could not start {argv[0]!r}: {exc}", "exit_code": 127})
            return 127
    stat = procs.read_stat(child.pid)
    leader = {
        "pid": child.pid,
        "pgid": stat.pgid if stat else child.pid,
        "start_time_ticks": stat.start_time if stat else 0,
        "watcher_pid": os.getpid(),
        "watcher_start": procs.start_time(os.getpid()),
        "cgroup": str(cgroup) if cgroup else None,
    }
    try:
        write_atomic(job_dir / LEADER_FILE, json.dumps(leader) + "\n")
    except OSError:
        pass  # the starter gets the same facts on stdout
    _report_leader(leader)
    code, recorded = _reap_all(child, job_dir)
    if not recorded:
        _retry_exit_code(job_dir, code, time.monotonic() + EXIT_RETRY_S)
    if cgroup is not None:
        procs.remove_cgroup(cgroup)
    return 128 - code if code < 0 else code


def _reap_all(child: subprocess.Popen, job_dir: Path) -> tuple[int, bool]:
    """Wait for the leader (recording its exit code) and every orphan handed to us; returns the leader's code and whether it was recorded."""
    code, recorded = 0, False
    while True:
        try:
            pid, status = os.waitpid(-1, 0)
        except ChildProcessError:
            return code, recorded
        if pid == child.pid:
            child.returncode = code = os.waitstatus_to_exitcode(status)
            recorded = _write_exit_code(job_dir, code)


def main(argv: list[str]) -> int:
    if len(argv) >= 4 and argv[0] == "watch" and argv[2] == "--":
        return watch(Path(argv[1]), argv[3:])
    print("usage: python -m backend.jobs.registry watch JOB_DIR -- CMD [ARGS...]  (started by JobRegistry.start_job)", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
