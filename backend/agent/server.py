"""The host agent: reads JSON-line requests on stdin, answers them and streams GPU, job, metrics, stage, disk and log events on stdout."""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import signal
import socket
import sys
import threading
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Callable

from backend.commands import STOP_GRACE_MAX_S
from backend.external.reader import ExternalRunReader
from backend.host import holders as holders_mod
from backend.host.disk import dir_size, disks_for
from backend.host.gpu import GpuSource, driver_state, open_gpu_source
from backend.jobs.logs import TAIL_LINE_SHOWN, display_lines, tail_lines
from backend.jobs.records import TERMINAL, JobError, JobNotFound, JobRecord, UnsafeRunDir
from backend.jobs.registry import JobRegistry
from backend.jobs.usage import JobUsage, UsageMeter
from backend.jsonl import JsonlFollower, read_complete_lines
from backend.layout import (
    INDEX_FILENAME,
    METRICS_FILENAME,
    STAGES_FILENAME,
    STALL_AFTER_S,
    checkpoint_listing,
    default_data_dir,
    latest_checkpoint,
    list_results,
)
from backend.metrics.records import MetricsReader
from backend.metrics.index import MetricsFeed, MetricsIndex
from backend.metrics.parallel import backlog_step, close_scan
from backend.metrics.signals import compute_signals
from backend.protocol import (
    PROTOCOL_VERSION,
    ErrorCode,
    Event,
    MAX_LINE_BYTES,
    HelloInfo,
    MalformedMessage,
    Request,
    cut_text,
    decode,
    encode,
    reply_error,
    reply_ok,
    to_dict,
)

JOBS_EVERY_TICKS = 5
USAGE_EVERY_TICKS = JOBS_EVERY_TICKS  # CPU % and RSS ride along with the jobs event sent every JOBS_EVERY_TICKS
USAGE_FIELDS = ("cpu_pct", "rss_bytes")
DESCENDANTS_EVERY_TICKS = 5
DISK_EVERY_TICKS = 10
DIR_SIZE_EVERY_S = 60.0
HISTORY_LIMIT = 20_000
BACKLOG_BYTES = 4 << 20
LIVE_POLL_S = 0.05  # metrics and stages files are checked this often (a stat each when nothing changed)
QUOTED_CHARS = 80  # a request's value quoted in an error reply (a 3 MB type was echoed whole)
FINISHED_POLL_S = 1.0  # a finished job's files: a last line written as it exited still arrives within a second
# ... and once it has been finished this long and a poll found nothing new, its files are settled: not polled or
# scanned again (the watcher reaped the job's last process before it exited; a host keeps up to FINISHED_KEPT)
FINISHED_SETTLE_S = 30.0
PROGRESS_EVERY_S = 0.5
SIDECAR_SAVE_EVERY_S = 60.0
SERIES_POINTS_MAX = 4096
WINDOW_RECORDS_MAX = 5000
SERIES_KEYS_MAX = 64
LOG_CHUNK_BYTES = 1 << 20
TAIL_LINES_MAX = 10_000
STALL_AFTER_MAX_S = 86400.0
EXTERNAL_PREFIX = "ext:"  # a watched run's job name is this and the name it was watched as


class BadParams(Exception):
    def __init__(self, param: str, problem: str):
        super().__init__(f"{param}: {problem}")
        self.param = param


def param(message: dict[str, Any], key: str, kind: type | tuple[type, ...], default: Any = ..., choices: tuple | None = None) -> Any:
    """Read one request param, raising BadParams that names it when it is missing or of the wrong type."""
    value = message.get(key)
    if value is None:
        if default is ...:
            raise BadParams(key, "missing")
        return default
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if isinstance(value, bool) and kind is not bool or not isinstance(value, kind):
        name = kind.__name__ if isinstance(kind, type) else "/".join(k.__name__ for k in kind)
        raise BadParams(key, f"expected {name}, got {type(value).__name__} {value!r}"[:200])
    if choices is not None and value not in choices:
        raise BadParams(key, f"{value!r} is not one of {', '.join(map(str, choices))}")
    return value


class Output:
    """One JSON message per line on the protocol stream; writes are serialized and flushed each line."""

    def __init__(self, stream: BinaryIO):
        self._stream = stream
        self._lock = threading.Lock()
        self.closed = threading.Event()

    def send(self, message: dict[str, Any]) -> None:
        data = encode(message)
        with self._lock:
            if self.closed.is_set():
                return
            try:
                self._stream.write(data)
                self._stream.flush()
            except (BrokenPipeError, OSError, ValueError):
                self.closed.set()


def sglang_version() -> str | None:
    """The installed SGLang version from package metadata; sglang itself is never imported here (it pulls in torch)."""
    try:
        return importlib.metadata.version("sglang")
    except importlib.metadata.PackageNotFoundError:
        return None


def last_record(path: Path) -> dict[str, Any] | None:
    """The last complete JSON object line of a file (reads only its tail)."""
    try:
        lines = tail_lines(path, 5)
    except OSError:
        return None
    for line in reversed(lines):
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict):
            return record
    return None


@dataclass(frozen=True)
class MetricsSource:
    """What a metrics request reads: a job's feed (None for a watched run), its index, lock, progress and cache."""

    index: MetricsIndex
    lock: threading.RLock
    progress: dict[str, Any]
    cache: dict[str, Any]
    feed: MetricsFeed | None


class JobFiles:
    """One job's metrics feed (live records + the whole-history index) and its stages.jsonl follower."""

    def __init__(self, record: JobRecord, from_end: bool):
        job_dir = Path(record.info.job_dir)
        self.record_id = record.id
        # A file already large when first met (an adopted job, a restarted agent) is a backlog for the indexer,
        # not megabytes of live events.
        backlog = self._size(job_dir / METRICS_FILENAME) > BACKLOG_BYTES
        self.metrics = MetricsFeed(job_dir / METRICS_FILENAME, job_dir / INDEX_FILENAME, live_from_end=from_end or backlog)
        self.stages = JsonlFollower(job_dir / STAGES_FILENAME, self._size(job_dir / STAGES_FILENAME) if from_end else 0)
        self.latest = last_record(job_dir / METRICS_FILENAME) if from_end else None
        self.progress_sent_at = float("-inf")
        self.had_backlog = False
        self.saved_at = time.monotonic()
        self.cache: dict[str, Any] = {}  # "signals": (index version, signals)
        self.finished = False  # the job's record is terminal: its files are polled once a FINISHED_POLL_S
        self.finished_seen: float | None = None  # when this agent first saw the record terminal (monotonic)
        self.settled = False  # finished FINISHED_SETTLE_S ago and a poll since found nothing: no more polls or scans
        self.polled_at = float("-inf")

    @staticmethod
    def _size(path: Path) -> int:
        try:
            return path.stat().st_size
        except OSError:
            return 0


class Agent:
    def __init__(
        self,
        run_dir: str | Path,
        interval: float = 1.0,
        data_dirs: list[str] | None = None,
        out: BinaryIO | None = None,
        gpu_source: GpuSource | None = None,
        stall_after: float = STALL_AFTER_S,
    ):
        self.run_dir = Path(run_dir).expanduser().resolve()
        self.interval = interval
        self.data_dirs = list(data_dirs or [])  # given explicitly: always reported
        self.stall_after = stall_after
        self.registry = JobRegistry(self.run_dir)
        self.gpu = gpu_source if gpu_source is not None else open_gpu_source(stream=True, interval_s=interval)
        self.out = Output(out if out is not None else sys.stdout.buffer)
        self.stopping = threading.Event()
        self._pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="agent-request")
        self._lock = threading.Lock()
        self._files: dict[str, JobFiles] = {}
        self._finished_wires: dict[int, tuple[tuple, dict[str, Any]]] = {}  # record id -> (what it depends on, wire)
        self._initial_jobs = {record.name for record in self.registry.list_records()}
        self._last_gpus: list[dict] = []
        self._last_jobs: list[dict] | None = None
        self._last_disks: list[dict] = []
        self._dir_sizes_at = float("-inf")
        self._checkpoint_bytes: int | None = None
        self._jobs_dirty = threading.Event()
        self._followed_log: dict[str, Any] | None = None
        self._externals: dict[str, dict[str, Any]] = {}
        self._usage_meter = UsageMeter()
        self._usage: dict[str, JobUsage] = {}
        self._handlers: dict[str, Callable[[dict], Any]] = {
            Request.PING: self._ping,
            Request.SNAPSHOT: self._snapshot,
            Request.START_JOB: self._start_job,
            Request.STOP_PLAN: self._stop_plan,
            Request.STOP_JOB: self._stop_job,
            Request.ADOPT_JOB: self._adopt_job,
            Request.LIST_JOBS: self._list_jobs,
            Request.HOLDERS: self._holders,
            Request.TAIL_LOG: self._tail_log,
            Request.METRICS_HISTORY: self._metrics_history,
            Request.METRICS_SERIES: self._metrics_series,
            Request.METRICS_WINDOW: self._metrics_window,
            Request.STAGES_HISTORY: self._stages_history,
            Request.FOLLOW_LOG: self._follow_log,
            Request.LIST_CHECKPOINTS: self._list_checkpoints,
            Request.SIGNALS: self._signals,
            Request.WATCH_EXTERNAL: self._watch_external,
            Request.UNWATCH_EXTERNAL: self._unwatch_external,
            Request.DATA_SCALING: self._data_scaling,
            Request.RESULTS: self._results,
            Request.SHUTDOWN: self._shutdown,
        }
        self._inline = {Request.PING, Request.SHUTDOWN, Request.FOLLOW_LOG}

    # ------------------------------------------------------------ lifecycle

    def hello(self) -> HelloInfo:
        return HelloInfo(
            protocol=PROTOCOL_VERSION,
            host=socket.gethostname(),
            python=platform.python_version(),
            agent_pid=os.getpid(),
            run_dir=str(self.run_dir),
            driver=self.gpu.driver,
            nvml=self.gpu.nvml,
            gpu_source=self.gpu.name,
            sglang=sglang_version(),
            backend_hash=os.environ.get("EAGLE3_BACKEND_HASH") or None,
        )

    def run(self, stdin: BinaryIO) -> int:
        """Serve until EOF on stdin, a shutdown request or a closed stdout. Jobs keep running afterwards."""
        with self._lock:  # so a snapshot asked right after hello already knows each job's latest metrics
            self._sync_files(self.registry.list_records())
        self.out.send({"type": Event.HELLO, **to_dict(self.hello())})
        ticker = threading.Thread(target=self._tick_loop, name="agent-ticker", daemon=True)
        ticker.start()
        live = threading.Thread(target=self._live_loop, name="agent-live", daemon=True)
        live.start()
        indexer = threading.Thread(target=self._index_loop, name="agent-indexer", daemon=True)
        indexer.start()
        try:
            while not self.stopping.is_set() and not self.out.closed.is_set():
                line = stdin.readline(MAX_LINE_BYTES + 1)
                if not line:
                    break
                if len(line) > MAX_LINE_BYTES and not line.endswith(b"\n"):
                    self._refuse_long_line(stdin, len(line))
                elif line.strip():
                    self.handle_line(line)
        finally:
            self.stopping.set()
            self._pool.shutdown(wait=True)  # a stop in its grace period finishes: no job is left half-stopped
            ticker.join(timeout=max(5.0, 3 * self.interval))
            live.join(timeout=5.0)
            indexer.join(timeout=5.0)
            self._save_sidecars(force=True)
            self.gpu.close()
            self.registry.close()
        return 0

    def _refuse_long_line(self, stdin: BinaryIO, read: int) -> None:
        """Skip the rest of an over-long request line (never held whole in memory) and say so."""
        while True:
            rest = stdin.readline(1 << 20)
            read += len(rest)
            if not rest or rest.endswith(b"\n"):
                break
        self.out.send(reply_error(None, ErrorCode.MALFORMED, f"request line of {read} bytes is longer than the {MAX_LINE_BYTES}-byte limit; skipped"))

    def _tick_loop(self) -> None:
        started = time.monotonic()
        tick = 0
        while not self.stopping.is_set() and not self.out.closed.is_set():
            self.tick(tick)
            tick += 1
            self.stopping.wait(max(0.0, started + tick * self.interval - time.monotonic()))

    def tick(self, tick: int) -> None:
        """One telemetry round; a failing part is reported on stderr and the others still run."""
        parts: list[tuple[str, Callable[[], object]]] = [("gpus", self._emit_gpus)]
        if tick % USAGE_EVERY_TICKS == 0:
            parts.append(("usage", self._measure_usage))
        parts += [
            ("jobs", lambda: self._emit_jobs(force=tick % JOBS_EVERY_TICKS == 0)),
            ("log", self._emit_log),
            ("external", self._emit_externals),
        ]
        if tick % DESCENDANTS_EVERY_TICKS == 0:
            parts.append(("descendants", self.registry.record_descendants))
        if tick % DISK_EVERY_TICKS == 0:
            parts.append(("disks", self._emit_disks))
        for name, part in parts:
            try:
                part()
            except Exception:
                print(f"agent: {name} failed:\n{traceback.format_exc()}", file=sys.stderr, flush=True)

    # ------------------------------------------------------------ streams

    def _emit_gpus(self) -> None:
        gpus = to_dict(self.gpu.sample())
        self._last_gpus = gpus
        self.out.send({"type": Event.GPUS, "gpus": gpus, "driver": driver_state(self.gpu)})

    def _emit_jobs(self, force: bool = False) -> None:
        records = self.registry.list_records()
        wire = [self._wire(record) for record in records]
        # Heartbeat ages and CPU/RSS change all the time: they ride along with the forced event; a new stalled rank is a change.
        steady = [{key: value for key, value in job.items() if key != "ranks" and key not in USAGE_FIELDS} for job in wire]
        with self._lock:
            changed = steady != self._last_jobs
            self._last_jobs = steady
            self._sync_files(records)
        if changed or force or self._jobs_dirty.is_set():
            self._jobs_dirty.clear()
            self.out.send({"type": Event.JOBS, "jobs": wire})

    def _wire(self, record: JobRecord) -> dict[str, Any]:
        """A record as sent; a finished one's never changes again, so it is built once (a host keeps up to
        FINISHED_KEPT of them, and to_wire reads heartbeat files)."""
        if record.info.state not in TERMINAL:
            return self._with_usage(record, record.to_wire(self.stall_after))
        key = (record.id, record.info.state, record.detail, record.info.exit_code, record.info.ended_at)
        cached = self._finished_wires.get(record.id)
        if cached is None or cached[0] != key:
            cached = self._finished_wires[record.id] = (key, record.to_wire(self.stall_after))
        return dict(cached[1])

    def _measure_usage(self) -> None:
        """Every running job's CPU % (since the last measure) and RSS, for the jobs events and replies."""
        self._usage = self._usage_meter.measure(self.registry.list_records(), self.registry.recorded_procs())

    def _with_usage(self, record: JobRecord, wire: dict[str, Any]) -> dict[str, Any]:
        usage = self._usage.get(record.name) if record.info.state == "running" else None
        if usage is not None:
            wire["cpu_pct"], wire["rss_bytes"] = usage.cpu_pct, usage.rss_bytes
        return wire

    def _sync_files(self, records: list[JobRecord]) -> None:
        names = set()
        for record in records:
            names.add(record.name)
            files = self._files.get(record.name)
            if files is None or files.record_id != record.id:
                from_end = record.name in self._initial_jobs and files is None
                self._files[record.name] = files = JobFiles(record, from_end)
            files.finished = record.info.state in TERMINAL
            if files.finished and files.finished_seen is None:
                files.finished_seen = time.monotonic()
        for name in set(self._files) - names:
            close_scan(self._files.pop(name).metrics)  # its worker processes, if a cold scan was running
        live_ids = {record.id for record in records}
        for record_id in set(self._finished_wires) - live_ids:
            del self._finished_wires[record_id]

    def _live_loop(self) -> None:
        """New metrics and stage lines reach the console within ~LIVE_POLL_S: one stat per file when idle."""
        while not self.stopping.is_set() and not self.out.closed.is_set():
            try:
                self._emit_files()
            except Exception:
                print(f"agent: live files failed:\n{traceback.format_exc()}", file=sys.stderr, flush=True)
            self.stopping.wait(LIVE_POLL_S)

    def _emit_files(self) -> None:
        with self._lock:
            items = list(self._files.items())
        now = time.monotonic()
        for name, files in items:
            if files.finished:  # nothing writes a finished job's files any more but a last straggler: a poll a second
                if files.settled or now - files.polled_at < FINISHED_POLL_S:
                    continue
                files.polled_at = now
            records, start, end = files.metrics.poll_live()
            if records:
                files.latest = records[-1]
            if end != start:
                self.out.send({"type": Event.METRICS, "job": name, "records": records, "offset": end, "start_offset": start})
            stages_start = files.stages.offset
            stages = files.stages.poll()
            if stages:
                self.out.send({"type": Event.STAGES, "job": name, "records": stages, "offset": files.stages.offset, "start_offset": stages_start})
            quiet = end == start and not stages
            if files.finished and quiet and files.finished_seen is not None and now - files.finished_seen >= FINISHED_SETTLE_S:
                files.settled = True

    def _index_loop(self) -> None:
        """Scan backlogs (files the agent never saw whole) in chunks, report progress, save the sidecars."""
        try:
            self._index_backlogs()
        finally:
            with self._lock:
                feeds = [files.metrics for files in self._files.values()]
            for feed in feeds:
                close_scan(feed)

    def _index_backlogs(self) -> None:
        while not self.stopping.is_set() and not self.out.closed.is_set():
            busy = False
            with self._lock:
                items = list(self._files.items())
            for name, files in items:
                if self.stopping.is_set():
                    return
                if files.settled and files.metrics.caught_up:
                    continue  # a finished job's whole file is indexed and nothing writes it any more
                try:
                    more = backlog_step(files.metrics)  # a large backlog on worker processes, merged on this thread
                except OSError as exc:
                    print(f"agent: indexing {name} failed: {exc}", file=sys.stderr, flush=True)
                    continue
                busy = busy or more
                self._report_progress(name, files, done=not more)
                if more:
                    time.sleep(0.001)  # let request threads take the GIL between chunks (not after a file with nothing to do)
            self._save_sidecars()
            if not busy:
                self.stopping.wait(self.interval)

    def _report_progress(self, name: str, files: JobFiles, done: bool) -> None:
        """INDEX_PROGRESS while a backlog is scanned (at most every PROGRESS_EVERY_S), and once when it is done."""
        now = time.monotonic()
        if not done:
            files.had_backlog = True
            if now - files.progress_sent_at < PROGRESS_EVERY_S:
                return
        elif not files.had_backlog:
            return
        else:
            files.had_backlog = False
            files.metrics.save_sidecar()
        files.progress_sent_at = now
        self.out.send({"type": Event.INDEX_PROGRESS, "job": name, **files.metrics.progress()})

    def _save_sidecars(self, force: bool = False) -> None:
        now = time.monotonic()
        with self._lock:
            items = list(self._files.values())
        for files in items:
            if files.metrics.caught_up and (force or now - files.saved_at >= SIDECAR_SAVE_EVERY_S):
                files.saved_at = now
                files.metrics.save_sidecar()

    def _emit_log(self) -> None:
        """New lines of the followed log; `\r` ends a line too. A line longer than a chunk is shown cut, once, and read
        past by jumping to the file's last chunk: a tick reads at most two chunks, however long the line."""
        follow = self._followed_log
        if follow is None:
            return
        path, offset = Path(follow["path"]), follow["offset"]
        size, data, end = read_complete_lines(path, offset, LOG_CHUNK_BYTES, line_ends=b"\n\r")
        if size is None:
            return
        lines: list[str] = []
        if end < offset:  # truncated or replaced: read from its start, a fresh line
            follow["in_long_line"] = False
        if follow.get("in_long_line") and data:  # the rest of the line shown cut: dropped
            data = data[min(data.find(byte) for byte in (b"\n", b"\r") if byte in data) + 1 :]
            follow["in_long_line"] = False
        if not data and size - end >= LOG_CHUNK_BYTES:  # no line ends in a whole chunk: one line longer than a chunk
            if not follow.get("in_long_line"):
                with open(path, "rb") as handle:
                    handle.seek(end)
                    head = handle.read(TAIL_LINE_SHOWN)
                lines.append(head.decode(errors="replace") + f" … (a line over {LOG_CHUNK_BYTES} bytes, cut)")
            end = self._past_long_line(follow, path, end, size)
        else:
            lines = [line for line in display_lines(data)[:-1] if line]
        follow["offset"] = end
        if lines:
            self.out.send({"type": Event.LOG, "job": follow["job"], "stream": follow["stream"], "lines": lines})

    @staticmethod
    def _past_long_line(follow: dict[str, Any], path: Path, start: int, size: int) -> int:
        """Where to read on inside a line longer than a chunk: after its end when that lies in the file's last chunk,
        else at the file's end, still inside the line (`in_long_line`: the next line end found ends it)."""
        tail_start = max(start, size - LOG_CHUNK_BYTES)
        with open(path, "rb") as handle:
            handle.seek(tail_start)
            tail = handle.read(size - tail_start)
        ends = [at for at in (tail.find(b"\n"), tail.find(b"\r")) if at >= 0]
        follow["in_long_line"] = not ends
        return tail_start + min(ends) + 1 if ends else tail_start + len(tail)

    def _emit_externals(self) -> None:
        for name, watch in list(self._externals.items()):
            reader = watch["reader"]
            records = reader.poll()
            with watch["lock"]:  # requests read the same index and records; an unwatch waits for this round's events
                if not watch.get("unwatched"):
                    self._emit_external(name, watch, records)

    def _emit_external(self, name: str, watch: dict[str, Any], records: list[dict[str, Any]]) -> None:
        reader = watch["reader"]
        start = watch["count"]
        if records:
            watch["index"].fold_records(records)
            watch["records"].extend(records)
            del watch["records"][:-WINDOW_RECORDS_MAX]
            watch["count"] += len(records)
        behind = getattr(reader, "bytes_read", 0) < getattr(reader, "bytes_total", 0)
        if behind or watch.get("catching_up"):  # a big backlog: progress and the index, not megabytes of events
            watch["catching_up"] = behind
            self.out.send(
                {
                    "type": Event.INDEX_PROGRESS,
                    "job": name,
                    "indexed_bytes": reader.bytes_read,
                    "file_bytes": reader.bytes_total,
                    "caught_up": not behind,
                    "total_records": watch["index"].total_records,
                }
            )
        elif records:
            self.out.send({"type": Event.METRICS, "job": name, "records": records, "offset": watch["count"], "start_offset": start})

    def reported_data_dirs(self) -> list[str]:
        """The data dirs whose disks are reported: those given, else <run_dir>/data when it is on another filesystem."""
        if self.data_dirs:
            return self.data_dirs
        default = default_data_dir(self.run_dir)
        return [str(default)] if _filesystem(default) != _filesystem(self.run_dir) else []

    def _emit_disks(self) -> None:
        measure = time.monotonic() - self._dir_sizes_at >= DIR_SIZE_EVERY_S
        disks = to_dict(disks_for(self.run_dir, self.reported_data_dirs(), measure_dirs=measure))
        if measure:
            self._dir_sizes_at = time.monotonic()
            self._checkpoint_bytes = self._running_checkpoint_bytes()
        else:
            previous = {(d["path"], d["label"]): d["dir_bytes"] for d in self._last_disks}
            for disk in disks:
                disk["dir_bytes"] = previous.get((disk["path"], disk["label"]))
        for disk in disks:
            if disk["label"] == "run_dir":
                disk["checkpoint_bytes"] = self._checkpoint_bytes
        self._last_disks = disks
        self.out.send({"type": Event.DISK, "disks": disks})

    def _running_checkpoint_bytes(self) -> int | None:
        """Size of the largest latest checkpoint among running training jobs: what their next save needs on the run dir's disk."""
        sizes = []
        for record in self.registry.list_records():
            if record.info.kind == "train" and record.info.state == "running":
                latest = latest_checkpoint(record.info.job_dir)
                size = dir_size(latest) if latest is not None else None
                if size:
                    sizes.append(size)
        return max(sizes) if sizes else None

    # ------------------------------------------------------------ requests

    def handle_line(self, line: bytes) -> None:
        try:
            message = decode(line, max_bytes=MAX_LINE_BYTES)
        except MalformedMessage as exc:
            self.out.send(reply_error(_id_of(line), ErrorCode.MALFORMED, str(exc)))
            return
        request_id = message.get("id")
        handler = self._handlers.get(message["type"])
        if handler is None:
            known = ", ".join(sorted(self._handlers))
            self.out.send(
                reply_error(request_id, ErrorCode.UNKNOWN_REQUEST, f"unknown request type {cut_text(repr(message['type']), QUOTED_CHARS)}; known: {known}")
            )
            return
        if message["type"] in self._inline:
            self._answer(handler, message)
        else:
            self._pool.submit(self._answer, handler, message)

    def _answer(self, handler: Callable[[dict], Any], message: dict[str, Any]) -> None:
        request_id = message.get("id")
        try:
            reply = reply_ok(request_id, handler(message))
        except BadParams as exc:
            reply = reply_error(request_id, ErrorCode.BAD_PARAMS, str(exc))
        except JobError as exc:
            reply = reply_error(request_id, exc.code, str(exc))
        except Exception as exc:
            print(f"agent: {message['type']} failed:\n{traceback.format_exc()}", file=sys.stderr, flush=True)
            reply = reply_error(request_id, ErrorCode.INTERNAL, f"{type(exc).__name__}: {exc}")
        self.out.send(reply)

    def _names(self, message: dict[str, Any]) -> tuple[list[str] | None, bool]:
        all_jobs = param(message, "all", bool, False)
        name = param(message, "name", str, None)
        if not all_jobs and name is None:
            raise BadParams("name", "give a job name, or all: true")
        return ([name] if name and not all_jobs else None), all_jobs

    def _ping(self, message: dict) -> dict:
        return {"pong": True, "time": time.time()}

    def _snapshot(self, message: dict) -> dict:
        with self._lock:
            latest = {name: files.latest for name, files in self._files.items() if files.latest is not None}
        latest.update({name: watch["records"][-1] for name, watch in self._externals.items() if watch["records"]})
        return {
            "hello": to_dict(self.hello()),
            "gpus": self._last_gpus,
            "driver": driver_state(self.gpu),
            "jobs": [self._with_usage(record, record.to_wire(self._stall_after(message))) for record in self.registry.list_records()],
            "metrics": latest,
            "disks": self._last_disks,
        }

    def _stall_after(self, message: dict) -> float:
        value = param(message, "stall_after_s", float, self.stall_after)
        if not 0 < value <= STALL_AFTER_MAX_S:  # also refuses NaN
            raise BadParams("stall_after_s", f"must be a number of seconds in (0, {STALL_AFTER_MAX_S:g}], got {value!r}")
        return value

    def _start_job(self, message: dict) -> dict:
        info = self.registry.start_job(
            param(message, "name", str),
            param(message, "kind", str, "other"),
            param(message, "argv", list),
            cwd=param(message, "cwd", str, None),
            env=param(message, "env", dict, None),
            node=param(message, "node", dict, None),
        )
        self._jobs_dirty.set()
        return {"job": self.registry.get(info.name).to_wire(self.stall_after)}

    def _foreign_holders(self) -> list[dict]:
        report = holders_mod.list_holders(self.gpu, owner_lookup=self.registry.owned_pids)
        return [{"pid": h.pid, "user": h.user, "cmdline": h.cmdline, "used_memory_mib": h.used_memory_mib} for h in report.foreign]

    def _stop_plan(self, message: dict) -> Any:
        names, all_jobs = self._names(message)
        return self.registry.stop_plan(names, all_jobs, foreign_holders=self._foreign_holders())

    def _stop_job(self, message: dict) -> dict:
        names, all_jobs = self._names(message)
        grace = param(message, "grace", float, 30.0)
        if not 0 <= grace <= STOP_GRACE_MAX_S:  # also refuses NaN
            raise BadParams("grace", f"must be a number of seconds in 0..{STOP_GRACE_MAX_S:g}, got {grace!r}")
        verdicts = self.registry.stop(names, all_jobs, grace=grace, gpu_source=self.gpu)
        self._jobs_dirty.set()
        return {"verdicts": verdicts, "unrecorded": self.registry.unrecorded()}

    def _adopt_job(self, message: dict) -> dict:
        info = self.registry.adopt(
            param(message, "pid", int), param(message, "name", str), param(message, "confirm_pid", int), other_user=param(message, "other_user", bool, False)
        )
        self._jobs_dirty.set()
        return {"job": self.registry.get(info.name).to_wire(self.stall_after)}

    def _list_jobs(self, message: dict) -> dict:
        stall_after = self._stall_after(message)
        return {"jobs": [self._with_usage(record, record.to_wire(stall_after)) for record in self.registry.list_records()]}

    def _holders(self, message: dict) -> dict:
        return holders_mod.list_holders(self.gpu, owner_lookup=self.registry.owned_pids).to_dict()

    def _tail_log(self, message: dict) -> dict:
        record = self.registry.get(param(message, "name", str))
        stream = param(message, "stream", str, "stdout", choices=("stdout", "stderr"))
        count = param(message, "lines", int, 100)
        if not 0 <= count <= TAIL_LINES_MAX:
            raise BadParams("lines", f"must be 0..{TAIL_LINES_MAX}")
        path = record.info.stdout_path if stream == "stdout" else record.info.stderr_path
        try:
            return {"lines": tail_lines(path, count), "path": path}
        except FileNotFoundError:
            raise JobError(f"job {record.name!r} has no {stream} log at {path}") from None

    def _metrics_history(self, message: dict) -> dict:
        """Raw records from a byte offset, a bounded page at a time (small runs; long ones use metrics_series)."""
        name = param(message, "name", str)
        offset = param(message, "offset", int, 0)
        if offset < 0:
            raise BadParams("offset", "must be >= 0")
        if name in self._externals:
            page = self._externals[name]["records"][offset:]
            return {"records": page, "offset": offset + len(page), "more": False}
        record = self.registry.get(name)
        reader = MetricsReader(Path(record.info.job_dir) / METRICS_FILENAME, offset)
        records: list[dict] = []
        while len(records) < HISTORY_LIMIT:
            batch = reader.poll()
            if not batch:
                break
            records.extend(batch)
        return {"records": records, "offset": reader.offset, "bad_lines": reader.bad_records + reader.follower.bad_lines, "more": len(records) >= HISTORY_LIMIT}

    def _source(self, name: str) -> MetricsSource:
        """The whole-history index of a job or watched run, with its lock, progress and cache (one lookup)."""
        if name in self._externals:
            watch = self._externals[name]
            reader = watch["reader"]
            progress = {
                "indexed_bytes": getattr(reader, "bytes_read", None),
                "file_bytes": getattr(reader, "bytes_total", None),
                "caught_up": not watch.get("catching_up"),
                "total_records": watch["index"].total_records,
            }
            return MetricsSource(watch["index"], watch["lock"], progress, watch["cache"], None)
        self.registry.get(name)  # NOT_FOUND for an unknown job
        with self._lock:
            files = self._files.get(name)
            if files is None:  # started a moment ago, before the next tick listed it
                self._sync_files(self.registry.list_records())
                files = self._files.get(name)
        if files is None:
            raise JobNotFound(f"job {name!r} has no metrics feed yet; try again in a second")
        return MetricsSource(files.metrics.index, files.metrics.lock, files.metrics.progress(), files.cache, files.metrics)

    def _metrics_series(self, message: dict) -> dict:
        name = param(message, "name", str)
        keys = param(message, "keys", list, None)
        points = param(message, "points", int, 200)
        step_from = param(message, "from", int, None)
        step_to = param(message, "to", int, None)
        log_x = param(message, "log_x", bool, False)
        if not 1 <= points <= SERIES_POINTS_MAX:
            raise BadParams("points", f"must be 1..{SERIES_POINTS_MAX}")
        if keys is not None and (len(keys) > SERIES_KEYS_MAX or not all(isinstance(k, str) for k in keys)):
            raise BadParams("keys", f"a list of at most {SERIES_KEYS_MAX} series names")
        if step_from is not None and step_to is not None and step_to < step_from:
            raise BadParams("to", "must be >= from")
        source = self._source(name)
        index = source.index
        with source.lock:
            known = index.keys()
            wanted = known if keys is None else expand_keys(keys, known)
            series = {key: index.buckets(key, step_from, step_to, points, log_x) for key in wanted}
            span = index.step_range()
            nonfinite = {key: sum(b["nonfinite"] for b in buckets) for key, buckets in series.items()}
            return {
                "job": name,
                "series": series,
                "keys": known,
                "step_range": list(span) if span else None,
                "points": points,
                "log_x": log_x,
                "from": step_from,
                "to": step_to,
                "nonfinite": nonfinite,
                "version": index.version,
                **source.progress,
            }

    def _metrics_window(self, message: dict) -> dict:
        """The last `last` records and the last `val` val records, for the live tail and the accuracy table."""
        name = param(message, "name", str)
        last = param(message, "last", int, 1000)
        val = param(message, "val", int, 8)
        if not 0 <= last <= WINDOW_RECORDS_MAX or not 0 <= val <= WINDOW_RECORDS_MAX:
            raise BadParams("last", f"last and val must be 0..{WINDOW_RECORDS_MAX}")
        source = self._source(name)
        feed = source.feed
        if feed is None:  # a watched run: its reader's records, kept in memory
            watch = self._externals[name]
            with source.lock:
                records = watch["records"][-last:] if last else []
                return {"records": records, "val": source.index.latest_val(val) if val else [], "offset": watch["count"]}
        with feed.lock:
            offset = feed.live_offset
        records = feed.tail_records(last, end=offset) if last else []  # exactly the records before the offset sent
        vals = source.index.latest_val(val) if feed.caught_up else feed.tail_records(val, split="val", end=offset)
        return {"records": records, "val": vals if val else [], "offset": offset}

    def _stages_history(self, message: dict) -> dict:
        record = self.registry.get(param(message, "name", str))
        follower = JsonlFollower(Path(record.info.job_dir) / STAGES_FILENAME)
        return {"records": follower.read_all(), "offset": follower.offset}

    def _follow_log(self, message: dict) -> dict:
        name = param(message, "name", str, None)
        if name is None:
            self._followed_log = None
            return {}
        stream = param(message, "stream", str, "stdout", choices=("stdout", "stderr"))
        record = self.registry.get(name)
        path = record.info.stdout_path if stream == "stdout" else record.info.stderr_path
        offset = os.path.getsize(path) if os.path.exists(path) else 0
        self._followed_log = {"job": name, "stream": stream, "path": path, "offset": offset}
        return {"path": path, "offset": offset}

    def _list_checkpoints(self, message: dict) -> dict:
        record = self.registry.get(param(message, "name", str))
        return {"checkpoints": checkpoint_listing(record.info.job_dir)}

    def _signals(self, message: dict) -> Any:
        """Grokking signals from the run's index (no re-read of metrics.jsonl), recomputed only when it changed."""
        name = param(message, "name", str)
        source = self._source(name)
        cached = source.cache.get("signals")
        if cached is not None and cached[0] == source.index.version:
            return cached[1]
        with source.lock:
            version = source.index.version
            records = source.index.signal_records()
            total = source.index.total_records
        signals = compute_signals(records)
        signals["n_records"] = total
        source.cache["signals"] = (version, signals)
        return signals

    def _watch_external(self, message: dict) -> dict:
        name = param(message, "name", str)
        path = param(message, "path", str)
        line_format = param(message, "line_format", str, None)
        try:
            reader = ExternalRunReader(path, line_format=line_format or None)
        except (OSError, ValueError, RuntimeError) as exc:
            raise BadParams("path", f"{path!r} cannot be watched: {exc}") from None
        job = f"{EXTERNAL_PREFIX}{name}"
        self._externals[job] = {"reader": reader, "path": path, "records": [], "count": 0, "index": MetricsIndex(), "lock": threading.RLock(), "cache": {}}
        return {"job": job, "format": reader.format, "warning": reader.warning}

    def _unwatch_external(self, message: dict) -> dict:
        """Stop reading a watched run: its reader and index go; nothing on the host is touched (the agent only ever read it)."""
        name = param(message, "name", str)
        job = name if name.startswith(EXTERNAL_PREFIX) else f"{EXTERNAL_PREFIX}{name}"
        watch = self._externals.get(job)
        if watch is None:
            raise JobNotFound(f"no watched run named {job!r}; watched: {', '.join(sorted(self._externals)) or 'none'}")
        with watch["lock"]:  # after this, no event of it is sent (the ticker checks the mark under the same lock)
            watch["unwatched"] = True
            if self._externals.get(job) is watch:  # not a new watch of that name registered meanwhile
                del self._externals[job]
        return {"job": job, "path": watch["path"]}

    def _data_scaling(self, message: dict) -> dict:
        from backend.host.datascale import data_scaling

        shape = param(message, "shape", dict, None)
        try:
            return data_scaling(param(message, "data_dir", str), shape)
        except (OSError, ValueError, KeyError, RuntimeError) as exc:  # RuntimeError: "~user" with no such user
            raise BadParams("data_dir", str(exc)) from None

    def _results(self, message: dict) -> dict:
        return {"results": list_results(self.registry.get(param(message, "name", str)).info.job_dir)}

    def _shutdown(self, message: dict) -> dict:
        self.stopping.set()
        return {}


def expand_keys(keys: list[str], known: list[str]) -> list[str]:
    """Series names as asked; "prefix.*" stands for every known series under that prefix (e.g. weight_norm.*)."""
    out: list[str] = []
    for key in keys:
        matches = [k for k in known if k.startswith(key[:-1])] if key.endswith(".*") else [key]
        out += [k for k in matches if k not in out]
    return out


def _filesystem(path: Path) -> int | None:
    """The device number of the filesystem holding path (its nearest existing parent), None when unreadable."""
    path = Path(path)
    while not path.exists() and path != path.parent:
        path = path.parent
    try:
        return path.stat().st_dev
    except OSError:
        return None


def _id_of(line: bytes) -> Any:
    """The id of a malformed request when it is a JSON object that has one (null otherwise)."""
    if len(line) > 4096:
        return None  # not worth parsing twice
    try:
        message = json.loads(line)
    except (ValueError, UnicodeDecodeError, RecursionError):
        return None
    return message.get("id") if isinstance(message, dict) else None


def protocol_stdout() -> BinaryIO:
    """Keep the protocol stream private: fd 1 becomes a copy of stderr so a stray print cannot corrupt it."""
    stream = os.fdopen(os.dup(1), "wb", buffering=0)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    return stream


def run_agent(run_dir: str | Path, interval: float = 1.0, data_dirs: list[str] | None = None, stall_after: float = STALL_AFTER_S) -> int:
    out = protocol_stdout()

    def terminate(signum, frame):
        raise SystemExit(0)

    signal.signal(signal.SIGTERM, terminate)
    try:
        agent = Agent(run_dir, interval, data_dirs, out=out, stall_after=stall_after)
    except UnsafeRunDir as exc:
        print(f"agent: {exc}", file=sys.stderr)
        return 2
    try:
        return agent.run(sys.stdin.buffer)
    except (SystemExit, KeyboardInterrupt):
        return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m backend.agent", description="eagle3 host agent: JSON lines on stdin/stdout")
    parser.add_argument("--run-dir", required=True, type=Path, help="where jobs.db and job directories live")
    parser.add_argument("--interval", type=float, default=1.0, help="seconds between telemetry ticks (default 1.0)")
    parser.add_argument(
        "--data-dir",
        action="append",
        default=[],
        help="a data directory whose disk room is reported (repeatable; default: <run-dir>/data when it is on another filesystem)",
    )
    parser.add_argument(
        "--stall-after",
        type=float,
        default=STALL_AFTER_S,
        metavar="S",
        help=f"a running job's rank whose heartbeat is older than S seconds is stalled (default {STALL_AFTER_S:g})",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.interval <= 0:
        print("agent: --interval must be > 0", file=sys.stderr)
        return 2
    if not 0 < args.stall_after <= STALL_AFTER_MAX_S:
        print(f"agent: --stall-after must be in (0, {STALL_AFTER_MAX_S:g}] seconds", file=sys.stderr)
        return 2
    return run_agent(args.run_dir, args.interval, args.data_dir, args.stall_after)
