"""The job registry at run_dir/jobs.db: its SQLite (schema, migration, read-only fallback), start, adopt, refresh, list, archive.

A start spawns the job under its watcher (backend/jobs/watcher.py); which processes are a job's is worked out in
backend/jobs/discovery.py and the stop lives in backend/jobs/stop.py: the registry hands them records and the
processes it stored, and stores what they report.
"""

from __future__ import annotations

import errno
import json
import os
import re
import secrets
import select
import shutil
import sqlite3
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from stat import S_ISREG
from typing import Any, Callable, Iterable, Iterator
from urllib.parse import quote

from backend.commands import NODE_ENV, check_node, node_argv_conflicts
from backend.durable import free_bytes
from backend.host import procs
from backend.jobs import discovery
from backend.jobs.discovery import RecordedProc, Target
from backend.jobs.logs import tail_lines
from backend.jobs.records import (
    JOB_TOKEN_ENV,
    KINDS,
    PACKAGE_PARENT,
    PRIVATE_DIR,
    PRIVATE_FILE,
    START_TIMEOUT_S,
    TERMINAL,
    WATCH_TOKEN_ENV,
    JobBadParams,
    JobConflict,
    JobError,
    JobNoSpace,
    JobNotFound,
    JobRecord,
    JobRefused,
    UnsafeRunDir,
    check_ancestors,
    make_private_dir,
    private_opener,
    refuse_unless_ours,
)
from backend.jobs.stop import StopLocks, preview, stop_jobs, stop_plans
from backend.jobs.watcher import watcher_argv
from backend.protocol import JobInfo, ProcessVerdict, StopPlan

NAME_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
BUSY_TIMEOUT_S = 30.0  # how long a write waits for another process's write lock on jobs.db
READ_ONLY_RETRY_S = 5.0  # how often a read-only connection (opened on a full disk) tries read-write again
UNRECORDED_KEPT = 20
START_MIN_FREE = 256 << 10  # bytes a start needs on the run dir's disk: its record in jobs.db, logs, leader.json, slots
FINISHED_KEPT = 100  # finished records listed; older ones are archived in jobs.db (JobRegistry._prune_finished)
NODE_COLUMNS = ("run_id", "node_rank", "nnodes", "rdzv_endpoint")  # a multi-node job's part on this host

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


WRITE_ERRORS = (sqlite3.Error, OSError)  # a full disk, a read-only file system or a locked database

# Our own Python commands keep PYTHONPATH and site-packages (torch lives there) but never put the cwd or the
# script's directory first on sys.path: -P on Python >= 3.11, the same by hand on 3.10; PYTHONSAFEPATH=1 in
# their environment carries it to every Python they start (torchrun's workers).
SAFE_PATH_BOOT = "import runpy, sys; del sys.path[0]; runpy.run_module(sys.argv.pop(1), run_name='__main__', alter_sys=True)"
SAFE_PATH_ENV = {"PYTHONSAFEPATH": "1"}


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
    refuse_unless_ours(path, found, "the job registry")
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
        check_ancestors(self.run_dir)
        make_private_dir(self.run_dir, "the run dir")
        make_private_dir(self.jobs_dir, "the jobs dir")
        self.db_path = self.run_dir / "jobs.db"
        prepare_db_file(self.db_path)
        self._local = threading.local()
        self._writes = 0
        self._watchers: dict[int, subprocess.Popen] = {}  # job id -> watcher we spawned (reaped by refresh)
        self._watchers_lock = threading.Lock()
        self._stop_locks = StopLocks()
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
        self.note_unrecorded(f"{self.db_path} opened read-only ({why})")
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
        self._writes += 1  # a write of this process, which PRAGMA data_version does not count on its own connection
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
            self.note_unrecorded(f"{what}: {exc}{self._free_space_note()}")
            return False

    def try_update(self, what: str, job_ids: list[int], **values: Any) -> bool:
        """Set the same column values on these jobs in one transaction, without stopping the caller when it fails."""

        def update(db: sqlite3.Connection) -> None:
            for job_id in job_ids:
                self._update(db, job_id, **values)

        return self._try_write(what, update)

    def _free_bytes(self) -> int | None:
        return free_bytes(self.run_dir)

    def _free_space_note(self) -> str:
        free = self._free_bytes()
        if free is None:
            return ""
        return f" ({free} bytes free on the disk of {self.run_dir}{': disk full' if free < 65536 else ''})"

    def note_unrecorded(self, message: str) -> None:
        notes = getattr(self._local, "unrecorded", None)
        if notes is None:
            notes = self._local.unrecorded = []
        notes.append(message)
        del notes[:-UNRECORDED_KEPT]  # a thread that keeps failing (the agent's ticker on a full disk) must not grow without end

    def unrecorded(self) -> list[str]:
        """What this thread's last stop could not write to jobs.db (empty when everything was recorded)."""
        return list(getattr(self._local, "unrecorded", None) or [])

    def forget_unrecorded(self) -> None:
        self._local.unrecorded = []

    def close(self) -> None:
        conn = getattr(self._local, "conn", None)
        if conn is not None:
            conn.close()
            self._local.conn = None
            self._local.read_only = None
        self._local.settled = None  # a new connection's data_version says nothing about the old one's

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

    def active(self, db: sqlite3.Connection | None = None, name: str | None = None) -> list[JobRecord]:
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

    def _reap_watchers(self) -> None:
        with self._watchers_lock:
            for job_id, proc in list(self._watchers.items()):
                if proc.poll() is not None:
                    del self._watchers[job_id]

    def refresh(self) -> list[JobRecord]:
        """Re-check every active job and store what changed; returns the active records.

        When every record is finished (terminal states stick) and jobs.db has not changed since this thread last
        read it, the records read then are returned again: an idle agent on a host with many finished records
        reads nothing (PRAGMA data_version counts other connections' commits, self._writes this process's)."""
        self._reap_watchers()
        self._retry_read_write()
        settled = getattr(self._local, "settled", None)
        if settled is not None and settled[0] == self._db_version():
            return list(settled[1])
        records = self._prune_finished(self.active())
        changed = []
        for record in records:
            state, detail, exit_code, ended_at = discovery.evaluate(record)
            info = record.info
            if (state, detail, exit_code, ended_at) != (info.state, record.detail, info.exit_code, info.ended_at):
                info.state, record.detail, info.exit_code, info.ended_at = state, detail, exit_code, ended_at
                changed.append(record)
        if changed:
            self._try_write("job states", lambda db: self._store_states(db, changed))
        all_finished = all(record.info.state in TERMINAL for record in records)
        # not on a read-only fallback: an immutable view never sees another process's commit
        reusable = all_finished and not changed and getattr(self._local, "read_only", None) is None
        self._local.settled = (self._db_version(), list(records)) if reusable else None
        return records

    def _db_version(self) -> tuple[int, int]:
        return self._db().execute("PRAGMA data_version").fetchone()[0], self._writes

    def _prune_finished(self, records: list[JobRecord]) -> list[JobRecord]:
        """Archive the oldest finished records beyond FINISHED_KEPT (kept in jobs.db, archived = 1, as a reused name's are).

        A long-used host gathers thousands of finished records, and every tick of the agent reads, checks and sends
        each one (10,000 took 60 % of a core). Only a record whose watcher is gone is archived: the watcher reaps the
        job's last orphan before it exits, so nothing of an archived job can still run for a stop to miss."""
        finished = [record for record in records if record.info.state in TERMINAL]
        if len(finished) <= FINISHED_KEPT:
            return records
        finished.sort(key=lambda record: (record.info.ended_at or record.info.started_at, record.id))
        prunable = [record for record in finished[: len(finished) - FINISHED_KEPT] if not discovery.watcher_alive(record)]

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
        for record in self.active(db, name):
            state, detail, _, _ = discovery.evaluate(record)
            if state in ("running", "unknown"):
                raise JobConflict(f"job {name!r} is {state} (pid {record.info.pid}); stop it or pick another name. Nothing was started")
            ctx = discovery.scan(self.active(db), self.recorded_procs())
            leftovers = [t.pid for t in discovery.plan_job(record, ctx).targets]
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
        records = self.active(name=name)
        if "error" not in leader and records:
            record = records[0]
            record.info.state, record.info.pid, record.info.pgid = "running", leader["pid"], leader["pgid"]
            record.info.start_time_ticks, record.cgroup = leader["start_time_ticks"], leader.get("cgroup")
            record.watcher_pid, record.watcher_start = leader["watcher_pid"], leader["watcher_start"]
            plan = discovery.plan_job(record, discovery.scan(self.active(), self.recorded_procs(), tokens=True))
            verdicts = stop_plans(self, [plan], 0.0, 5.0)
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
        if pid in discovery.protected_pids():
            raise JobRefused(f"PID {pid} is this tool or one of its parents; nothing was adopted")
        uid, my_uid = procs.uid_of(pid), os.getuid()
        if uid != my_uid and not (other_user and my_uid == 0):
            how = "confirm with --other-user (root only)" if my_uid == 0 else "run as root with --other-user"
            raise JobRefused(
                f"PID {pid} belongs to user {procs.user_name(uid) or '?'}, not {procs.user_name(my_uid)}; to adopt it anyway {how}. Nothing was adopted"
            )

    # ------------------------------------------------------------ the processes of jobs

    def recorded_procs(self) -> dict[int, list[RecordedProc]]:
        """{job id: its processes stored in job_procs} for every active job."""
        rows = self._db().execute("SELECT job_id, pid, start_time, role FROM job_procs WHERE job_id IN (SELECT id FROM jobs WHERE archived = 0)")
        found: dict[int, list[RecordedProc]] = {}
        for row in rows.fetchall():
            found.setdefault(row["job_id"], []).append(RecordedProc(row["pid"], row["start_time"], row["role"]))
        return found

    def remember(self, found: list[tuple[int, Target]]) -> None:
        """Store (job id, process) pairs in job_procs (best effort), so a descendant that later loses its parent is still known."""
        now = time.time()
        rows = [(job_id, t.pid, t.start, t.role, t.cmdline, now) for job_id, t in found]
        if rows:
            self._try_write("job processes", lambda db: db.executemany("INSERT OR IGNORE INTO job_procs VALUES (?, ?, ?, ?, ?, ?)", rows))

    def owned_pids(self, candidates: Iterable[int] | None = None) -> dict[int, str]:
        """{pid: job name} for live processes of active jobs; candidates not found in a job tree are checked by token."""
        records = self.refresh()
        return discovery.owners(records, self.recorded_procs(), candidates)

    def record_descendants(self) -> int:
        """Store the current processes of running jobs, so a descendant that later loses its parent is still known."""
        records = self.refresh()
        ctx = discovery.scan(records, self.recorded_procs())
        found = [
            (record.id, target)
            for record in records
            if record.info.state == "running"
            for target in discovery.plan_job(record, ctx).targets
            if target.role != "leader"
        ]
        self.remember(found)
        return len(found)

    # ------------------------------------------------------------ stop

    def stop_plan(self, names: list[str] | None = None, all_jobs: bool = False, foreign_holders: list[dict] | None = None) -> StopPlan:
        """What stop would do, computed without signalling anything."""
        return preview(discovery.job_plans(self.refresh(), self.recorded_procs(), names, all_jobs), foreign_holders)

    def stop(
        self,
        names: list[str] | None = None,
        all_jobs: bool = False,
        grace: float = 30.0,
        kill_wait: float = 5.0,
        gpu_source=None,
        gpu_release_timeout: float = 15.0,
    ) -> list[ProcessVerdict]:
        """SIGTERM each job, wait `grace`, freeze what is left, SIGKILL all of it, confirm all gone (backend/jobs/stop.py)."""
        return stop_jobs(self, self._stop_locks, names, all_jobs, grace, kill_wait, gpu_source, gpu_release_timeout)


def _quietly(action: Callable[[], object]) -> None:
    try:
        action()
    except OSError:
        pass


def _output_file(pid: int, fd: int) -> str | None:
    """Where an adopted process's stdout/stderr goes, when that is a regular file we can tail."""
    try:
        target = os.readlink(f"/proc/{pid}/fd/{fd}")
    except OSError:
        return None
    return target if target.startswith("/") and os.path.isfile(target) else None
