"""What the console knows about the host: the latest agent events folded into plain objects the screens read.

No Textual here: the state is built from protocol messages and tested on its own.
"""

from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

from backend.protocol import DiskUsage, Event, GpuHolder, GpuSample, HelloInfo, JobInfo, from_dict

LOG_LINES_KEPT = 2000
TAIL_POINTS_MAX = 20_000  # raw points kept per series; the rest of the history is the host's index (buckets)
NONFINITE_STEPS_KEPT = 1000
VAL_ACC_ROWS_KEPT = 64
SUMMARY_KEYS = ["train.loss", "val.loss", "val.acc.0", "lr", "grad_norm", "weight_norm", "weight_norm.*"]  # what the screens plot (metrics_series keys)
EXTERNAL_PREFIX = "ext:"
CONNECTED = "connected"
CONNECTING = "connecting"
RECONNECTING = "reconnecting"
FAILED = "failed"
CLOSED = "closed"


@dataclass
class ConnectionStatus:
    """Where the link to the agent stands; anything but CONNECTED means the screens show stale data."""

    state: str = CONNECTING
    detail: str = ""
    since: float = 0.0
    attempt: int = 0
    retry_in: float | None = None

    @property
    def connected(self) -> bool:
        return self.state == CONNECTED


@dataclass
class Series:
    """Raw points of one quantity (the live tail): finite values plotted, non-finite ones counted with their steps.

    At most TAIL_POINTS_MAX points are kept: older ones are dropped from the front (the host's index has them).
    """

    steps: list[float] = field(default_factory=list)
    values: list[float] = field(default_factory=list)
    nonfinite: int = 0
    nonfinite_steps: list[float] = field(default_factory=list)
    version: int = 0

    def append(self, step: Any, value: Any) -> None:
        if not isinstance(value, (int, float)) or not isinstance(step, (int, float)) or isinstance(value, bool):
            return
        self.version += 1
        if not math.isfinite(value):
            self.nonfinite += 1
            self.nonfinite_steps.append(float(step))
            del self.nonfinite_steps[:-NONFINITE_STEPS_KEPT]
            return
        if self.steps and step < self.steps[-1]:
            self._insert_sorted(float(step), float(value))
        else:
            self.steps.append(float(step))
            self.values.append(float(value))
        if len(self.steps) > TAIL_POINTS_MAX:
            drop = len(self.steps) - TAIL_POINTS_MAX * 9 // 10
            del self.steps[:drop], self.values[:drop]

    def _insert_sorted(self, step: float, value: float) -> None:
        from bisect import bisect_right

        i = bisect_right(self.steps, step)
        self.steps.insert(i, step)
        self.values.insert(i, value)

    def nonfinite_after(self, step: float | None) -> list[float]:
        return [s for s in self.nonfinite_steps if step is None or s > step]

    def __len__(self) -> int:
        return len(self.steps)


@dataclass
class Summary:
    """Buckets of several series over one step range, from the host's index (`metrics_series`)."""

    buckets: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    step_range: tuple[int, int] | None = None  # of the whole run, when asked
    step_from: int | None = None
    step_to: int | None = None
    log_x: bool = False

    @property
    def end_step(self) -> int | None:
        """The last step these buckets cover (live points after it are drawn from the tail)."""
        if self.step_to is not None:
            return self.step_to
        return self.step_range[1] if self.step_range else None

    def nonfinite(self, key: str) -> int:
        return sum(int(b.get("nonfinite") or 0) for b in self.buckets.get(key, []))

    def nonfinite_steps(self, key: str) -> list[float]:
        return [(b["step_lo"] + b["step_hi"]) / 2 for b in self.buckets.get(key, []) if b.get("nonfinite")]


@dataclass
class JobMetrics:
    """Metrics of one job, from metrics.jsonl records (see backend/protocol.py for the keys)."""

    train_loss: Series = field(default_factory=Series)
    val_loss: Series = field(default_factory=Series)
    lr: Series = field(default_factory=Series)
    grad_norm: Series = field(default_factory=Series)
    weight_norm: Series = field(default_factory=Series)
    weight_norm_modules: dict[str, Series] = field(default_factory=dict)
    val_acc: list[tuple[float, list[float]]] = field(default_factory=list)
    latest: dict[str, Any] = field(default_factory=dict)
    latest_train: dict[str, Any] = field(default_factory=dict)
    latest_val: dict[str, Any] = field(default_factory=dict)
    offset: int = 0
    records: int = 0
    history_loaded: bool = False
    needs_catchup: bool = False
    loading: bool = False  # a metrics_history request is in flight: events wait for it (see _on_metrics)
    seen_end: int = 0  # the furthest offset an event reported while loading
    summaries: dict[bool, Summary] = field(default_factory=dict)  # whole history, keyed by log_x
    zoom: Summary | None = None  # a zoomed step range (Training / Grokking, keys + - , . 0)
    progress: dict[str, Any] = field(default_factory=dict)  # the host's indexing progress (a backlog being scanned)
    total_records: int | None = None  # records in the whole history, as the host's index counts them

    def add(self, record: dict[str, Any]) -> None:
        step = record.get("step")
        if not isinstance(step, (int, float)):
            return
        self.records += 1
        self.latest = record
        if record.get("split", "train") == "val":
            self.latest_val = record
            self.val_loss.append(step, record.get("loss"))
            acc = record.get("acc")
            if isinstance(acc, list):
                self.val_acc.append((step, _acc_row(acc)))
                del self.val_acc[:-VAL_ACC_ROWS_KEPT]
        else:
            self.latest_train = record
            self.train_loss.append(step, record.get("loss"))
            self._add_norms(step, record)
        if "lr" in record:
            self.lr.append(step, record.get("lr"))

    def _add_norms(self, step: float, record: dict[str, Any]) -> None:
        if "grad_norm" in record:
            self.grad_norm.append(step, record.get("grad_norm"))
        if "weight_norm" in record:
            self.weight_norm.append(step, record.get("weight_norm"))
        modules = record.get("weight_norm_modules")
        if isinstance(modules, dict):
            for module, norm in modules.items():
                self.weight_norm_modules.setdefault(str(module), Series()).append(step, norm)

    @property
    def version(self) -> int:
        return self.train_loss.version + self.val_loss.version + self.lr.version

    def summary(self, log_x: bool) -> Summary | None:
        return self.summaries.get(log_x) or self.summaries.get(not log_x)

    def nonfinite_count(self, key: str, tail: Series) -> int:
        """NaN/inf values of a series over the whole history: the host's buckets, plus live ones after them."""
        summary = self.summary(False)
        if summary is None or key not in summary.buckets:
            return tail.nonfinite
        return summary.nonfinite(key) + len(tail.nonfinite_after(summary.end_step))

    def history_points(self, key: str) -> int | None:
        summary = self.summary(False)
        if summary is None or key not in summary.buckets:
            return None
        return sum(int(b.get("count") or 0) + int(b.get("nonfinite") or 0) for b in summary.buckets[key])


@dataclass
class LogBuffer:
    """The tail of one job stream; `total` counts every line ever added so a view can append only new ones."""

    lines: deque = field(default_factory=lambda: deque(maxlen=LOG_LINES_KEPT))
    total: int = 0
    generation: int = 0  # bumped when the tail is replaced, so views redraw instead of appending

    def extend(self, new_lines: list[str]) -> None:
        for line in new_lines:
            self.lines.append(line.rstrip("\n"))
        self.total += len(new_lines)

    def replace(self, new_lines: list[str]) -> None:
        self.generation += 1
        self.lines.clear()
        self.extend(new_lines)


@dataclass
class ConsoleState:
    """Everything the screens draw. `apply()` folds one agent message in and says which sections changed."""

    target: str = "local"
    clock: Callable[[], float] = time.time
    connection: ConnectionStatus = field(default_factory=ConnectionStatus)
    hello: HelloInfo | None = None
    gpus: list[GpuSample] = field(default_factory=list)
    driver: dict[str, Any] = field(default_factory=dict)
    holders: list[GpuHolder] = field(default_factory=list)
    jobs: dict[str, JobInfo] = field(default_factory=dict)
    job_details: dict[str, str] = field(default_factory=dict)
    metrics: dict[str, JobMetrics] = field(default_factory=dict)
    stages: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    stages_offset: dict[str, int] = field(default_factory=dict)  # bytes of a chain's stages.jsonl the records above cover
    stages_seen_end: dict[str, int] = field(default_factory=dict)  # the furthest byte any stages event reached
    signals: dict[str, dict[str, Any]] = field(default_factory=dict)  # job -> the agent's `signals` reply
    signals_at: dict[str, float] = field(default_factory=dict)
    data_scaling: dict[str, dict[str, Any]] = field(default_factory=dict)  # job -> `data_scaling` reply (or {"error"})
    results: dict[str, list[dict[str, Any]]] = field(default_factory=dict)  # training job -> saved stop-and-bench results
    externals: dict[str, str] = field(default_factory=dict)  # "ext:<name>" -> watched path (read-only runs)
    disks: list[DiskUsage] = field(default_factory=list)
    logs: dict[tuple[str, str], LogBuffer] = field(default_factory=dict)
    updated_at: dict[str, float] = field(default_factory=dict)
    agent_stderr: deque = field(default_factory=lambda: deque(maxlen=200))
    actions: deque = field(default_factory=lambda: deque(maxlen=50))
    last_data_at: float | None = None

    @property
    def stale(self) -> bool:
        return not self.connection.connected

    @property
    def no_driver(self) -> bool:
        """True when the host reported it has no usable NVIDIA driver (a state, not an error)."""
        if self.gpus:
            return False
        if "available" in self.driver:
            return not self.driver["available"]
        return bool(self.hello and self.hello.gpu_source == "none")

    @property
    def gpu_status_text(self) -> str:
        return str(self.driver.get("message") or (self.hello.nvml if self.hello else "") or "")

    @property
    def disk_warning(self) -> str | None:
        """Red before a checkpoint fails: the run dir's disk has less than two of the running jobs' checkpoints free."""
        for disk in self.disks:
            need = disk.checkpoint_bytes
            if need and disk.free_bytes < 2 * need:
                return (
                    f"disk nearly full: {disk.free_bytes / 2**30:.1f} GiB free on {disk.path}, a checkpoint needs "
                    f"~{need / 2**30:.1f} GiB: the next save may fail (the previous checkpoint stays); free space now"
                )
        return None

    def job_metrics(self, name: str) -> JobMetrics:
        if name not in self.metrics:
            self.metrics[name] = JobMetrics()
        return self.metrics[name]

    def log(self, job: str, stream: str) -> LogBuffer:
        key = (job, stream)
        if key not in self.logs:
            self.logs[key] = LogBuffer()
        return self.logs[key]

    def note_action(self, text: str) -> None:
        self.actions.append((self.clock(), text))

    def set_connection(self, status: ConnectionStatus) -> set[str]:
        self.connection = status
        return {"connection"}

    # -- folding agent messages -------------------------------------------------------------

    def apply(self, message: dict[str, Any]) -> set[str]:
        """Fold one event into the state; returns the names of the sections that changed."""
        kind = message.get("type")
        handler = _HANDLERS.get(kind) if isinstance(kind, str) else None
        if handler is None:
            return set()
        changed = handler(self, message)
        now = self.clock()
        self.last_data_at = now
        for section in changed:
            self.updated_at[section] = now
        return changed

    def apply_snapshot(self, result: dict[str, Any]) -> set[str]:
        """Fold a `snapshot` reply (hello, gpus, jobs, latest metrics per job, disks)."""
        changed: set[str] = set()
        if result.get("hello"):
            changed |= self.apply({"type": Event.HELLO, **result["hello"]})
        gpus = result.get("gpus")
        if isinstance(gpus, dict):
            changed |= self.apply({"type": Event.GPUS, **gpus})
        elif isinstance(gpus, list):
            changed |= self.apply({"type": Event.GPUS, "gpus": gpus, "driver": result.get("driver")})
        if "jobs" in result:
            changed |= self.apply({"type": Event.JOBS, "jobs": result["jobs"]})
        if result.get("disks"):  # empty until the agent's first disk tick: keep what the DISK event said
            changed |= self.apply({"type": Event.DISK, "disks": result["disks"]})
        for job, record in (result.get("metrics") or {}).items():
            if isinstance(record, dict):
                metrics = self.job_metrics(job)
                if not metrics.latest:
                    metrics.latest = record
                    bucket = "latest_val" if record.get("split") == "val" else "latest_train"
                    setattr(metrics, bucket, record)
                changed.add("metrics")
        if "holders" in result:
            changed |= self.apply_holders(result["holders"])
        return changed

    def apply_holders(self, holders: list[dict[str, Any]]) -> set[str]:
        self.holders = [from_dict(GpuHolder, h) for h in holders]
        self.updated_at["holders"] = self.clock()
        return {"holders"}

    def apply_metrics_history(self, job: str, result: dict[str, Any], *, reset: bool) -> set[str]:
        metrics = self.job_metrics(job)
        if reset:
            fresh = JobMetrics(loading=metrics.loading, seen_end=metrics.seen_end)
            self.metrics[job] = metrics = fresh
        for record in result.get("records") or []:
            if isinstance(record, dict):
                metrics.add(record)
        if isinstance(result.get("offset"), int):
            metrics.offset = result["offset"]
        metrics.history_loaded = True
        metrics.needs_catchup = metrics.seen_end > metrics.offset
        return {"metrics"}

    def apply_series(self, job: str, result: dict[str, Any], *, zoom: bool = False) -> set[str]:
        """Fold a `metrics_series` reply: the whole history (per log_x) or a zoomed range."""
        metrics = self.job_metrics(job)
        span = result.get("step_range")
        summary = Summary(
            buckets={k: v for k, v in (result.get("series") or {}).items() if isinstance(v, list)},
            step_range=(int(span[0]), int(span[1])) if isinstance(span, list) and len(span) == 2 else None,
            step_from=result.get("from"),
            step_to=result.get("to"),
            log_x=bool(result.get("log_x")),
        )
        if zoom:
            metrics.zoom = summary
        else:
            metrics.summaries[summary.log_x] = summary
            metrics.total_records = result.get("total_records")
        self._fold_progress(metrics, result)
        return {"metrics"}

    def apply_window(self, job: str, result: dict[str, Any]) -> set[str]:
        """Fold a `metrics_window` reply: the live tail (the last records) and the latest val records."""
        metrics = self.job_metrics(job)
        fresh = JobMetrics(
            loading=metrics.loading,
            seen_end=metrics.seen_end,
            summaries=metrics.summaries,
            zoom=metrics.zoom,
            progress=metrics.progress,
            total_records=metrics.total_records,
        )
        self.metrics[job] = fresh
        tail_steps = set()
        for record in result.get("records") or []:
            if isinstance(record, dict):
                fresh.add(record)
                if record.get("split") == "val":
                    tail_steps.add(record.get("step"))
        older_vals = [r for r in result.get("val") or [] if isinstance(r, dict) and r.get("step") not in tail_steps]
        for record in older_vals:
            acc, step = record.get("acc"), record.get("step")
            if isinstance(acc, list) and isinstance(step, (int, float)):
                fresh.val_acc.append((step, _acc_row(acc)))
        fresh.val_acc.sort(key=lambda row: row[0])
        if older_vals and not fresh.latest_val:
            fresh.latest_val = older_vals[-1]
        if isinstance(result.get("offset"), int):
            fresh.offset = result["offset"]
        fresh.history_loaded = True
        fresh.needs_catchup = fresh.seen_end > fresh.offset
        return {"metrics"}

    @staticmethod
    def _fold_progress(metrics: JobMetrics, result: dict[str, Any]) -> None:
        keys = ("indexed_bytes", "file_bytes", "backlog_bytes", "caught_up", "total_records", "bad_lines", "sidecar")
        metrics.progress = {k: result[k] for k in keys if k in result}

    def apply_stages_history(self, job: str, records: list[dict[str, Any]], offset: Any = None) -> set[str]:
        """Replace a chain job's stage records with the agent's full history (on (re)attach, or after a gap)."""
        if isinstance(offset, int):
            self.stages_offset[job] = max(self.stages_offset.get(job, 0), offset)
        known = self.stages.get(job, [])
        received = {_stage_key(r): r.get("_received") for r in known}
        fresh = []
        for record in records:
            if isinstance(record, dict):
                fresh.append({**record, "_received": received.get(_stage_key(record))})
        # Events can overtake this reply: records they brought that the history did not yet hold stay, after it.
        in_history = {_stage_key(r) for r in fresh}
        fresh += [r for r in known if _stage_key(r) not in in_history]
        self.stages[job] = fresh
        return {"stages"}

    def add_external(self, job: str, path: str) -> set[str]:
        """A run this tool did not start, watched read-only: listed as a job of kind "external"."""
        self.externals[job] = path
        self.jobs[job] = _external_info(job, path, self.clock())
        self.job_details[job] = f"watching {path} (read-only)"
        return {"jobs"}

    def is_external(self, job: str | None) -> bool:
        return bool(job) and (job in self.externals or str(job).startswith(EXTERNAL_PREFIX))

    def running_jobs(self) -> list[JobInfo]:
        return [j for j in self.jobs.values() if j.state == "running"]

    def owned_memory_by_gpu(self) -> dict[int, float]:
        return self._memory_by_gpu(owned=True)

    def foreign_memory_by_gpu(self) -> dict[int, float]:
        return self._memory_by_gpu(owned=False)

    def _memory_by_gpu(self, owned: bool) -> dict[int, float]:
        totals: dict[int, float] = {}
        for holder in self.holders:
            if holder.owned != owned or not holder.gpu_indices:
                continue
            share = (holder.used_memory_mib or 0.0) / len(holder.gpu_indices)
            for index in holder.gpu_indices:
                totals[index] = totals.get(index, 0.0) + share
        return totals


def _on_hello(state: ConsoleState, message: dict[str, Any]) -> set[str]:
    state.hello = from_dict(HelloInfo, message)
    return {"hello", "gpus"}


def _on_gpus(state: ConsoleState, message: dict[str, Any]) -> set[str]:
    state.gpus = [from_dict(GpuSample, g) for g in message.get("gpus") or []]
    driver = message.get("driver")
    if isinstance(driver, dict):
        state.driver = driver
    return {"gpus"}


def _on_jobs(state: ConsoleState, message: dict[str, Any]) -> set[str]:
    raw = [j for j in message.get("jobs") or [] if isinstance(j, dict)]
    jobs = [from_dict(JobInfo, j) for j in raw]
    watched = {name: state.jobs.get(name) or _external_info(name, path, state.clock()) for name, path in state.externals.items()}
    state.jobs = {j.name: j for j in sorted([*jobs, *watched.values()], key=lambda j: j.started_at)}
    state.job_details = {str(j.get("name")): str(j.get("detail") or "") for j in raw}
    state.job_details.update({name: f"watching {path} (read-only)" for name, path in state.externals.items()})
    return {"jobs"}


def _external_info(job: str, path: str, now: float) -> JobInfo:
    return JobInfo(
        name=job, kind="external", state="watching", pid=0, pgid=0, start_time_ticks=0, argv=[], job_dir=path, stdout_path="", stderr_path="", started_at=now
    )


def _stage_key(record: dict[str, Any]) -> tuple:
    return (record.get("stage"), record.get("status"), record.get("time"))


def _on_metrics(state: ConsoleState, message: dict[str, Any]) -> set[str]:
    """Append new records; once a job's history is loaded, byte offsets keep it exact (no duplicate, no hole)."""
    job = message.get("job")
    if not isinstance(job, str):
        return set()
    metrics = state.job_metrics(job)
    start, end = message.get("start_offset"), message.get("offset")
    if metrics.loading and isinstance(end, int):
        # The reply in flight covers part of this; whatever lies beyond it is re-read right after.
        metrics.seen_end = max(metrics.seen_end, end)
        return set()
    if metrics.history_loaded and isinstance(end, int):
        if end <= metrics.offset:
            return set()  # already folded in through metrics_history
        if isinstance(start, int) and start != metrics.offset:
            metrics.needs_catchup = True  # a hole or an overlap: re-read from our offset instead
            return {"metrics_gap"}
    elif metrics.offset and isinstance(start, int) and start != metrics.offset:
        # Records from live events only (no history loaded yet), and this event does not follow them: e.g. a new agent
        # after a reconnect streams from the file's end. Appending would show a hole as if it were the curve; load instead.
        metrics.needs_catchup = True
        return {"metrics_gap"}
    for record in message.get("records") or []:
        if isinstance(record, dict):
            metrics.add(record)
    if isinstance(end, int):
        metrics.offset = end
    return {"metrics"}


def _acc_row(acc: list[Any]) -> list[float]:
    """A val record's per-step accuracies, numbers only (the accuracy table's row)."""
    return [a for a in acc if isinstance(a, (int, float))]


def _on_index_progress(state: ConsoleState, message: dict[str, Any]) -> set[str]:
    job = message.get("job")
    if not isinstance(job, str):
        return set()
    state._fold_progress(state.job_metrics(job), message)
    return {"metrics_progress"}


def _on_stages(state: ConsoleState, message: dict[str, Any]) -> set[str]:
    job = message.get("job")
    if not isinstance(job, str):
        return set()
    known = state.stages.setdefault(job, [])
    seen = {_stage_key(r) for r in known}
    now = state.clock()
    for record in message.get("records") or []:
        if isinstance(record, dict) and _stage_key(record) not in seen:  # also delivered by stages_history
            known.append({**record, "_received": now})
            seen.add(_stage_key(record))
    start, end = message.get("start_offset"), message.get("offset")
    if isinstance(end, int):
        state.stages_seen_end[job] = max(state.stages_seen_end.get(job, 0), end)
    if isinstance(start, int) and start > state.stages_offset.get(job, 0):
        # Lines before this event's were never received (a new agent after a reconnect follows the file from its end,
        # or this console attached late): the offset stays put, so every event says so until stages_history fills it.
        return {"stages", "stages_gap"}
    if isinstance(end, int):
        state.stages_offset[job] = max(state.stages_offset.get(job, 0), end)
    return {"stages"}


def _on_disk(state: ConsoleState, message: dict[str, Any]) -> set[str]:
    state.disks = [from_dict(DiskUsage, d) for d in message.get("disks") or []]
    return {"disks"}


def _on_log(state: ConsoleState, message: dict[str, Any]) -> set[str]:
    job, stream = message.get("job"), message.get("stream")
    if not isinstance(job, str) or stream not in ("stdout", "stderr"):
        return set()
    state.log(job, stream).extend([str(line) for line in message.get("lines") or []])
    return {"logs"}


_HANDLERS: dict[str, Callable[[ConsoleState, dict[str, Any]], set[str]]] = {
    Event.HELLO: _on_hello,
    Event.GPUS: _on_gpus,
    Event.JOBS: _on_jobs,
    Event.METRICS: _on_metrics,
    Event.STAGES: _on_stages,
    Event.INDEX_PROGRESS: _on_index_progress,
    Event.DISK: _on_disk,
    Event.LOG: _on_log,
}
