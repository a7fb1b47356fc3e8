"""What the console knows about the host: the latest agent events folded into plain objects the screens read.

No Textual here: the state is built from protocol messages and tested on its own. Nothing a host sends is trusted: every
event and reply is checked against the contract before it touches the state (a bad one becomes one of the host's
`notes`, the rest goes on) and everything kept is bounded by the caps below (docs/console.md lists them).
"""

from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass, field
from functools import wraps
from typing import Any, Callable, TypeVar

from backend.protocol import (
    NUMBER,
    OPTIONAL,
    DiskUsage,
    Event,
    GpuHolder,
    GpuSample,
    HelloInfo,
    InvalidMessage,
    JobInfo,
    Limits,
    bounded,
    check_fields,
    cut_text,
    parse,
    type_name,
)

STRING_CAP = 4096  # characters kept of one string field (a log line, a cmdline, a name); longer ones are cut and marked
LIMITS = Limits(string=STRING_CAP, items=128, depth=6)  # one item of a message (a job, a GPU): lists inside it keep 128 entries
RECORD_LIMITS = Limits(string=256, items=256, depth=4)  # one metrics record (or bucket, rank) as kept
STAGE_LIMITS = Limits(string=STRING_CAP, items=256, depth=6)  # one stage record: its result carries the server's flags
LOG_LINES_KEPT = 2000
LOG_BUFFERS_MAX = 8  # (job, stream) log tails kept (the operator reads one job's two); the oldest goes first
GPUS_MAX = 64
JOBS_MAX = 256
HOLDERS_MAX = 256
DISKS_MAX = 32
METRICS_JOBS_MAX = 32  # jobs with metrics (and chains with stages) kept per host
MODULES_MAX = 16  # weight_norm modules per job (the trainer logs ~5)
STAGES_KEPT = 500  # stage records per chain (a chain writes ~20)
EVENT_RECORDS_MAX = 20_000  # records in one metrics event or history page (the agent's page size)
SERIES_KEYS_MAX = 64
BUCKETS_MAX = 4096  # buckets per series in one metrics_series reply (the agent sends <= 1024)
NOTES_KEPT = 200
TAIL_POINTS_MAX = 20_000  # raw points kept per series; the rest of the history is the host's index (buckets)
NONFINITE_STEPS_KEPT = 1000
VAL_ACC_ROWS_KEPT = 64
# What the screens plot (metrics_series keys; "x.*" is every series under x): val accuracy at every draft position, and
# each train step's wall time for the wall-time axis.
SUMMARY_KEYS = ["train.loss", "val.loss", "val.acc.*", "lr", "grad_norm", "weight_norm", "weight_norm.*", "time"]
EXTERNAL_PREFIX = "ext:"
DISK_LOW_SHARE = 0.9  # a disk more than this full is low, when no checkpoint size says better (disk_low)
CHECKPOINTS_OF_ROOM = 2  # a disk with room for fewer of the running jobs' checkpoints is low
CONNECTED = "connected"
CONNECTING = "connecting"
RECONNECTING = "reconnecting"
FAILED = "failed"
CLOSED = "closed"


class Section:
    """The parts of the state a change touches: `ConsoleState.apply` and the app return and pass these, and each screen
    redraws what `touches` them (a name that is not here fails at once instead of never redrawing)."""

    CONNECTION = "connection"
    HELLO = "hello"
    GPUS = "gpus"
    HOLDERS = "holders"
    JOBS = "jobs"
    DISKS = "disks"
    METRICS = "metrics"
    METRICS_GAP = "metrics_gap"  # a metrics event that does not follow what is held: re-read from the held offset
    METRICS_PROGRESS = "metrics_progress"  # the host's indexing of a backlog moved
    STAGES = "stages"
    STAGES_GAP = "stages_gap"  # a stages event after lines never received: re-read the chain's history
    LOGS = "logs"
    AGENT_STDERR = "agent_stderr"
    NOTES = "notes"  # something a host sent was refused
    ACTIONS = "actions"  # the operator's actions and their outcomes
    SIGNALS = "signals"
    DATA_SCALING = "data_scaling"
    RESULTS = "results"  # saved stop-and-bench results
    CHAIN = "chain"  # a stop-and-bench chain was started
    HOSTS = "hosts"  # another host's row changed (the Hosts view, the jobs table)
    SELECTION = "selection"  # the selected job or host
    OPTIONS = "options"  # a screen's own view options (log axes, zoom, overlay, followed stream)
    TICK = "tick"  # time passed: "N s ago" and running stages


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

    @property
    def next_try_at(self) -> float | None:
        """When the next reconnect try starts (wall clock); None while one is under way or none is planned."""
        return self.since + self.retry_in if self.state == RECONNECTING and self.retry_in is not None else None


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
        if not isinstance(value, (int, float)) or not isinstance(step, (int, float)) or isinstance(value, bool) or isinstance(step, bool):
            return
        if not math.isfinite(step):
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


BUCKET_FIELDS = {"step_lo": NUMBER, "step_hi": NUMBER, "count": (int,), "nonfinite": (int, OPTIONAL)} | {
    key: NUMBER + (OPTIONAL,) for key in ("min", "max", "first", "last", "mean")
}


def checked_bucket(bucket: Any, where: str) -> dict[str, Any]:
    """One metrics_series bucket as the plots read it: numeric edges and counts, min/max/last wherever count > 0."""
    checked = check_fields(bucket, BUCKET_FIELDS, where, RECORD_LIMITS)
    missing = [k for k in ("step_lo", "step_hi", "count") if k not in checked]
    if missing:
        raise InvalidMessage(f"{where}: missing {', '.join(missing)}")
    if checked["count"] > 0 and any(checked.get(k) is None for k in ("min", "max", "last")):
        raise InvalidMessage(f"{where}: count {checked['count']} but no min/max/last")
    return checked


@dataclass
class JobMetrics:
    """Metrics of one job, from metrics.jsonl records (see backend/protocol.py for the keys)."""

    train_loss: Series = field(default_factory=Series)
    val_loss: Series = field(default_factory=Series)
    lr: Series = field(default_factory=Series)
    wall_time: Series = field(default_factory=Series)  # train records' `time` (epoch seconds): the wall-time axis
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
        if not isinstance(step, (int, float)) or isinstance(step, bool):
            return
        record = bounded(record, RECORD_LIMITS)
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
            if "time" in record:
                self.wall_time.append(step, record.get("time"))
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
                if module in self.weight_norm_modules or len(self.weight_norm_modules) < MODULES_MAX:
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
        for line in new_lines[-LOG_LINES_KEPT:]:  # only these can stay: a huge batch costs no more than a full tail
            self.lines.append(cut_text(str(line).rstrip("\n"), STRING_CAP))
        self.total += len(new_lines)

    def replace(self, new_lines: list[str]) -> None:
        self.generation += 1
        self.lines.clear()
        self.extend(new_lines)


def _refusing(what: str) -> Callable[[Callable[..., set[str]]], Callable[..., set[str]]]:
    """A reply folder that refuses a reply not fitting the contract (one of the host's notes) and changes nothing."""

    def wrap(fold: Callable[..., set[str]]) -> Callable[..., set[str]]:
        @wraps(fold)
        def checked(state: "ConsoleState", *args: Any, **kwargs: Any) -> set[str]:
            try:
                return fold(state, *args, **kwargs)
            except InvalidMessage as exc:
                state.refuse(f"refused a {what}: {exc}; nothing of it was applied")
                return set()

        return checked

    return wrap


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
    exit_reasons: dict[str, str] = field(default_factory=dict)  # job -> the last stderr line of a job that exited non-zero
    external_formats: dict[str, str] = field(default_factory=dict)  # "ext:<name>" -> the line regex it was watched with
    external_read_as: dict[str, str] = field(default_factory=dict)  # "ext:<name>" -> the format the host reads it as
    unwatched: set[str] = field(default_factory=set)  # "ext:<name>" runs unwatched here: a late event of theirs is dropped
    disks: list[DiskUsage] = field(default_factory=list)
    logs: dict[tuple[str, str], LogBuffer] = field(default_factory=dict)
    updated_at: dict[str, float] = field(default_factory=dict)
    agent_stderr: deque = field(default_factory=lambda: deque(maxlen=200))
    actions: deque = field(default_factory=lambda: deque(maxlen=50))
    notes: deque = field(default_factory=lambda: deque(maxlen=NOTES_KEPT))  # (time, text): what this host sent that was refused
    notes_added: int = 0  # every refusal, repeats included (the session tells the operator about new ones)
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

    def job_metrics(self, name: str) -> JobMetrics:
        if name not in self.metrics:
            self.metrics[name] = JobMetrics()
        return self.metrics[name]

    def event_metrics(self, name: Any, where: str) -> JobMetrics:
        """The metrics of the job an event names (a string); a host naming more than METRICS_JOBS_MAX jobs is refused."""
        if not isinstance(name, str):
            raise InvalidMessage(f"{where}: expected a string, got {type_name(name)}")
        if name not in self.metrics and len(self.metrics) >= METRICS_JOBS_MAX:
            raise InvalidMessage(f"metrics of more than {METRICS_JOBS_MAX} jobs; {cut_text(name, 80)!r} is not kept")
        return self.job_metrics(name)

    def log(self, job: str, stream: str) -> LogBuffer:
        key = (job, stream)
        if key not in self.logs:
            while len(self.logs) >= LOG_BUFFERS_MAX:
                self.logs.pop(next(iter(self.logs)))
            self.logs[key] = LogBuffer()
        return self.logs[key]

    def refuse(self, text: str) -> None:
        """Something the host sent did not fit the contract or the caps: one of this host's notes (repeats kept once)."""
        text = cut_text(text, 600)
        self.notes_added += 1
        if not self.notes or self.notes[-1][1] != text:
            self.notes.append((self.clock(), text))

    def note_action(self, text: str) -> None:
        self.actions.append((self.clock(), text))

    def set_connection(self, status: ConnectionStatus) -> set[str]:
        self.connection = status
        return {Section.CONNECTION}

    # -- folding agent messages -------------------------------------------------------------

    def apply(self, message: dict[str, Any]) -> set[str]:
        """Fold one event into the state; returns the names of the sections that changed."""
        kind = message.get("type")
        handler = _HANDLERS.get(kind) if isinstance(kind, str) else None
        if handler is None:
            return set()
        try:
            changed = handler(self, message)
        except InvalidMessage as exc:
            self.refuse(f"refused a '{kind}' event: {exc}; nothing of it was applied")
            return set()
        now = self.clock()
        self.last_data_at = now
        for section in changed:
            self.updated_at[section] = now
        return changed

    @_refusing("snapshot reply")
    def apply_snapshot(self, result: dict[str, Any]) -> set[str]:
        """Fold a `snapshot` reply (hello, gpus, jobs, latest metrics per job, disks); each part on its own."""
        _expect(result, dict, "snapshot")
        changed: set[str] = set()
        hello = result.get("hello")
        if hello:
            changed |= self.apply({**_expect(hello, dict, "snapshot.hello"), "type": Event.HELLO})
        gpus = result.get("gpus")
        if isinstance(gpus, dict):
            changed |= self.apply({**gpus, "type": Event.GPUS})
        elif isinstance(gpus, list):
            changed |= self.apply({"type": Event.GPUS, "gpus": gpus, "driver": result.get("driver")})
        if "jobs" in result:
            changed |= self.apply({"type": Event.JOBS, "jobs": result["jobs"]})
        if result.get("disks"):  # empty until the agent's first disk tick: keep what the DISK event said
            changed |= self.apply({"type": Event.DISK, "disks": result["disks"]})
        latest = _expect(result.get("metrics") or {}, dict, "snapshot.metrics")
        for job, record in list(latest.items())[:METRICS_JOBS_MAX]:
            if isinstance(record, dict) and (job in self.metrics or len(self.metrics) < METRICS_JOBS_MAX):
                metrics = self.job_metrics(cut_text(job, STRING_CAP))
                if not metrics.latest:
                    record = bounded(record, RECORD_LIMITS)
                    metrics.latest = record
                    bucket = "latest_val" if record.get("split") == "val" else "latest_train"
                    setattr(metrics, bucket, record)
                changed.add(Section.METRICS)
        if "holders" in result:
            changed |= self.apply_holders(result["holders"])
        return changed

    @_refusing("holders reply")
    def apply_holders(self, holders: list[dict[str, Any]]) -> set[str]:
        self.holders = _parse_items(self, GpuHolder, holders, "holders", HOLDERS_MAX)
        self.updated_at[Section.HOLDERS] = self.clock()
        return {Section.HOLDERS}

    @_refusing("metrics_history reply")
    def apply_metrics_history(self, job: str, result: dict[str, Any], *, reset: bool) -> set[str]:
        records, offset = _records_and_offset(result, "metrics_history")
        metrics = self.job_metrics(job)
        if reset:
            fresh = JobMetrics(loading=metrics.loading, seen_end=metrics.seen_end)
            self.metrics[job] = metrics = fresh
        for record in records:
            if isinstance(record, dict):
                metrics.add(record)
        if offset is not None:
            metrics.offset = offset
        metrics.history_loaded = True
        metrics.needs_catchup = metrics.seen_end > metrics.offset
        return {Section.METRICS}

    @_refusing("metrics_series reply")
    def apply_series(self, job: str, result: dict[str, Any], *, zoom: bool = False) -> set[str]:
        """Fold a `metrics_series` reply: the whole history (per log_x) or a zoomed range."""
        _expect(result, dict, "metrics_series")
        series = _expect(result.get("series") or {}, dict, "metrics_series.series")
        buckets = {}
        for key, rows in list(series.items())[:SERIES_KEYS_MAX]:
            if isinstance(rows, list):
                buckets[cut_text(str(key), 200)] = [checked_bucket(b, f"metrics_series.series[{key!r}][{i}]") for i, b in enumerate(rows[:BUCKETS_MAX])]
        span = result.get("step_range")
        if span is not None and not (isinstance(span, list) and len(span) == 2 and all(_is_number(x) for x in span)):
            raise InvalidMessage(f"metrics_series.step_range: expected [first, last] steps, got {type_name(span)}")
        for key in ("from", "to", "total_records"):
            if result.get(key) is not None and not isinstance(result.get(key), int):
                raise InvalidMessage(f"metrics_series.{key}: expected an integer, got {type_name(result.get(key))}")
        progress = _progress(result, "metrics_series")
        metrics = self.job_metrics(job)
        summary = Summary(
            buckets=buckets,
            step_range=(int(span[0]), int(span[1])) if span else None,
            step_from=result.get("from"),
            step_to=result.get("to"),
            log_x=bool(result.get("log_x")),
        )
        if zoom:
            metrics.zoom = summary
        else:
            metrics.summaries[summary.log_x] = summary
            metrics.total_records = result.get("total_records")
        metrics.progress = progress
        return {Section.METRICS}

    @_refusing("metrics_window reply")
    def apply_window(self, job: str, result: dict[str, Any]) -> set[str]:
        """Fold a `metrics_window` reply: the live tail (the last records) and the latest val records."""
        records, offset = _records_and_offset(result, "metrics_window")
        vals = _expect(result.get("val") or [], list, "metrics_window.val")[:EVENT_RECORDS_MAX]
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
        for record in records:
            if isinstance(record, dict):
                fresh.add(record)
                if record.get("split") == "val" and _is_number(record.get("step")):
                    tail_steps.add(record.get("step"))
        older_vals = [r for r in vals if isinstance(r, dict) and _is_number(r.get("step")) and r.get("step") not in tail_steps]
        for record in older_vals:
            acc = record.get("acc")
            if isinstance(acc, list):
                fresh.val_acc.append((float(record["step"]), _acc_row(acc)))
        fresh.val_acc.sort(key=lambda row: row[0])
        del fresh.val_acc[:-VAL_ACC_ROWS_KEPT]
        if older_vals and not fresh.latest_val:
            fresh.latest_val = bounded(older_vals[-1], RECORD_LIMITS)
        if offset is not None:
            fresh.offset = offset
        fresh.history_loaded = True
        fresh.needs_catchup = fresh.seen_end > fresh.offset
        return {Section.METRICS}

    @staticmethod
    def _fold_progress(metrics: JobMetrics, result: dict[str, Any]) -> None:
        metrics.progress = _progress(result, "progress")

    @_refusing("stages_history reply")
    def apply_stages_history(self, job: str, records: list[dict[str, Any]], offset: Any = None) -> set[str]:
        """Replace a chain job's stage records with the agent's full history (on (re)attach, or after a gap)."""
        checked = _stage_records(records, "stages_history")
        if isinstance(offset, int) and not isinstance(offset, bool):
            self.stages_offset[job] = max(self.stages_offset.get(job, 0), offset)
        known = self.stages.get(job, [])
        received = {_stage_key(r): r.get("_received") for r in known}
        fresh = [{**record, "_received": received.get(_stage_key(record))} for record in checked]
        # Events can overtake this reply: records they brought that the history did not yet hold stay, after it.
        in_history = {_stage_key(r) for r in fresh}
        fresh += [r for r in known if _stage_key(r) not in in_history]
        self.stages[job] = fresh[-STAGES_KEPT:]
        return {Section.STAGES}

    def add_external(self, job: str, path: str, *, line_format: str | None = None, fmt: str | None = None) -> set[str]:
        """A run this tool did not start, watched read-only: listed as a job of kind "external"."""
        self.externals[job] = path
        self.unwatched.discard(job)
        if line_format:
            self.external_formats[job] = line_format
        if fmt:
            self.external_read_as[job] = fmt
        self.jobs[job] = _external_info(job, path, self.clock())
        self.job_details[job] = _external_detail(self, job)
        return {Section.JOBS}

    def remove_external(self, job: str) -> set[str]:
        """A watched run no longer watched: it leaves the jobs table with everything held of it; its late events are dropped."""
        for table in (self.externals, self.external_formats, self.external_read_as, self.jobs, self.job_details, self.metrics, self.signals, self.signals_at):
            table.pop(job, None)
        self.unwatched.add(job)
        return {Section.JOBS, Section.METRICS}

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


def used_share(disk: DiskUsage) -> float:
    return disk.used_bytes / disk.total_bytes if disk.total_bytes else 0.0


def disk_low(disk: DiskUsage) -> bool:
    """The one rule of "the disk is low" (the banner, the alert, the Dashboard's disk bar): room for fewer than two of the
    running jobs' checkpoints when their size is known (the next save may fail), else more than 90% used."""
    if disk.checkpoint_bytes:
        return disk.free_bytes < CHECKPOINTS_OF_ROOM * disk.checkpoint_bytes
    return used_share(disk) > DISK_LOW_SHARE


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


T = TypeVar("T")


def _expect(value: Any, kind: type[T], where: str) -> T:
    if not isinstance(value, kind):
        raise InvalidMessage(f"{where}: expected {'an object' if kind is dict else 'an array'}, got {type_name(value)}")
    return value


def _parse_items(state: "ConsoleState", cls: type, items: Any, what: str, cap: int) -> list:
    """Contract objects from an array: bad items are left out (one note says how many and the first reason), at most cap kept."""
    if items is None:
        return []
    _expect(items, list, what)
    parsed, bad, first = [], 0, ""
    for i, item in enumerate(items[:cap]):
        try:
            parsed.append(parse(cls, item, LIMITS, f"{what}[{i}]"))
        except InvalidMessage as exc:
            bad, first = bad + 1, first or str(exc)
    if bad:
        state.refuse(f"left out {bad} of {min(len(items), cap)} {what}: {first}")
    if len(items) > cap:
        state.refuse(f"the host sent {len(items)} {what}; the console keeps the first {cap}")
    return parsed


def _records_and_offset(result: Any, what: str) -> tuple[list, int | None]:
    _expect(result, dict, what)
    records = _expect(result.get("records") or [], list, f"{what}.records")
    if len(records) > EVENT_RECORDS_MAX:
        raise InvalidMessage(f"{what}: {len(records)} records, more than the {EVENT_RECORDS_MAX} one message may carry")
    offset = result.get("offset")
    if offset is not None and (not isinstance(offset, int) or isinstance(offset, bool) or offset < 0):
        raise InvalidMessage(f"{what}.offset: expected a byte offset, got {type_name(offset)}")
    return records, offset


PROGRESS_FIELDS = {k: (int, OPTIONAL) for k in ("indexed_bytes", "file_bytes", "backlog_bytes", "total_records", "bad_lines")} | {"caught_up": (bool, OPTIONAL)}


def _progress(result: dict[str, Any], what: str) -> dict[str, Any]:
    checked = check_fields({k: result[k] for k in (*PROGRESS_FIELDS, "sidecar") if k in result}, PROGRESS_FIELDS, what, RECORD_LIMITS)
    return checked


STAGE_FIELDS = {"stage": (str, OPTIONAL), "status": (str, OPTIONAL), "time": NUMBER + (OPTIONAL,), "detail": (str, OPTIONAL)}


def _stage_records(records: Any, what: str) -> list[dict[str, Any]]:
    records = _expect(records or [], list, f"{what}.records")
    if len(records) > EVENT_RECORDS_MAX:
        raise InvalidMessage(f"{what}: {len(records)} records, more than the {EVENT_RECORDS_MAX} one message may carry")
    return [check_fields(r, STAGE_FIELDS, f"{what}.records[{i}]", STAGE_LIMITS) for i, r in enumerate(records) if isinstance(r, dict)]


def _offsets(message: dict[str, Any], what: str) -> tuple[int | None, int | None]:
    found = []
    for key in ("start_offset", "offset"):
        value = message.get(key)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
            raise InvalidMessage(f"{what}.{key}: expected a byte offset, got {type_name(value)}")
        found.append(value)
    return found[0], found[1]


def _on_hello(state: ConsoleState, message: dict[str, Any]) -> set[str]:
    state.hello = parse(HelloInfo, message, LIMITS, "hello")
    return {Section.HELLO, Section.GPUS}


def _on_gpus(state: ConsoleState, message: dict[str, Any]) -> set[str]:
    driver = message.get("driver")
    if driver is not None and not isinstance(driver, dict):
        raise InvalidMessage(f"gpus.driver: expected an object, got {type_name(driver)}")
    state.gpus = _parse_items(state, GpuSample, message.get("gpus"), "gpus", GPUS_MAX)
    if isinstance(driver, dict):
        state.driver = check_fields(driver, {"available": (bool, OPTIONAL), "message": (str, OPTIONAL)}, "gpus.driver", LIMITS)
    return {Section.GPUS}


RANK_FIELDS = {k: (int, OPTIONAL) for k in ("rank", "local_rank", "node_rank", "step", "pid")} | {
    "age_s": NUMBER + (OPTIONAL,),
    "step_age_s": NUMBER + (OPTIONAL,),
    "phase": (str, OPTIONAL),
}


def _on_jobs(state: ConsoleState, message: dict[str, Any]) -> set[str]:
    raw = _expect(message.get("jobs") or [], list, "jobs")
    jobs: list[JobInfo] = []
    details: dict[str, str] = {}
    bad, first = 0, ""
    for i, entry in enumerate(raw[:JOBS_MAX]):
        try:
            job = parse(JobInfo, entry, LIMITS, f"jobs[{i}]")
            job.ranks = [check_fields(r, RANK_FIELDS, f"jobs[{i}].ranks[{k}]", RECORD_LIMITS) for k, r in enumerate(job.ranks)]
            detail = entry.get("detail")
        except InvalidMessage as exc:
            bad, first = bad + 1, first or str(exc)
            continue
        jobs.append(job)
        details[job.name] = cut_text(detail, STRING_CAP) if isinstance(detail, str) else ""
    if bad:
        state.refuse(f"left out {bad} of {min(len(raw), JOBS_MAX)} jobs: {first}")
    if len(raw) > JOBS_MAX:
        state.refuse(f"the host sent {len(raw)} jobs; the console keeps the first {JOBS_MAX}")
    watched = {name: state.jobs.get(name) or _external_info(name, path, state.clock()) for name, path in state.externals.items()}
    state.jobs = {j.name: j for j in sorted([*jobs, *watched.values()], key=lambda j: j.started_at)}
    state.job_details = details
    state.job_details.update({name: _external_detail(state, name) for name in state.externals})
    return {Section.JOBS}


def _external_detail(state: ConsoleState, job: str) -> str:
    read_as = state.external_read_as.get(job)
    if not read_as and job in state.metrics:
        read_as = "records arriving"
    return f"watching {state.externals[job]} (read-only, {read_as or 'format not recognised yet'})"


def _external_info(job: str, path: str, now: float) -> JobInfo:
    return JobInfo(
        name=job, kind="external", state="watching", pid=0, pgid=0, start_time_ticks=0, argv=[], job_dir=path, stdout_path="", stderr_path="", started_at=now
    )


def _stage_key(record: dict[str, Any]) -> tuple:
    return (record.get("stage"), record.get("status"), record.get("time"))


def _on_metrics(state: ConsoleState, message: dict[str, Any]) -> set[str]:
    """Append new records; once a job's history is loaded, byte offsets keep it exact (no duplicate, no hole)."""
    records, _ = _records_and_offset(message, "metrics")
    start, end = _offsets(message, "metrics")
    if _unwatched(state, message):
        return set()  # sent just before the agent dropped the watch
    metrics = state.event_metrics(message.get("job"), "metrics.job")
    if metrics.loading and isinstance(end, int):
        # The reply in flight covers part of this; whatever lies beyond it is re-read right after.
        metrics.seen_end = max(metrics.seen_end, end)
        return set()
    if metrics.history_loaded and isinstance(end, int):
        if end <= metrics.offset:
            return set()  # already folded in through metrics_history
        if isinstance(start, int) and start != metrics.offset:
            metrics.needs_catchup = True  # a hole or an overlap: re-read from our offset instead
            return {Section.METRICS_GAP}
    elif metrics.offset and isinstance(start, int) and start != metrics.offset:
        # Records from live events only (no history loaded yet), and this event does not follow them: e.g. a new agent
        # after a reconnect streams from the file's end. Appending would show a hole as if it were the curve; load instead.
        metrics.needs_catchup = True
        return {Section.METRICS_GAP}
    for record in records:
        if isinstance(record, dict):
            metrics.add(record)
    if isinstance(end, int):
        metrics.offset = end
    return {Section.METRICS}


def _unwatched(state: ConsoleState, message: dict[str, Any]) -> bool:
    job = message.get("job")
    return isinstance(job, str) and job in state.unwatched


def _acc_row(acc: list[Any]) -> list[float]:
    """A val record's per-step accuracies, numbers only (the accuracy table's row)."""
    return [a for a in acc[:VAL_ACC_ROWS_KEPT] if _is_number(a)]


def _on_index_progress(state: ConsoleState, message: dict[str, Any]) -> set[str]:
    progress = _progress(message, "index_progress")
    if _unwatched(state, message):
        return set()
    state.event_metrics(message.get("job"), "index_progress.job").progress = progress
    return {Section.METRICS_PROGRESS}


def _on_stages(state: ConsoleState, message: dict[str, Any]) -> set[str]:
    job = message.get("job")
    if not isinstance(job, str):
        raise InvalidMessage(f"stages.job: expected a string, got {type_name(job)}")
    records = _stage_records(message.get("records"), "stages")
    start, end = _offsets(message, "stages")
    if job not in state.stages and len(state.stages) >= METRICS_JOBS_MAX:
        raise InvalidMessage(f"stages of more than {METRICS_JOBS_MAX} chains; {cut_text(job, 80)!r} is not kept")
    known = state.stages.setdefault(job, [])
    seen = {_stage_key(r) for r in known}
    now = state.clock()
    for record in records:
        if _stage_key(record) not in seen:  # also delivered by stages_history
            known.append({**record, "_received": now})
            seen.add(_stage_key(record))
    del known[:-STAGES_KEPT]
    if isinstance(end, int):
        state.stages_seen_end[job] = max(state.stages_seen_end.get(job, 0), end)
    if isinstance(start, int) and start > state.stages_offset.get(job, 0):
        # Lines before this event's were never received (a new agent after a reconnect follows the file from its end,
        # or this console attached late): the offset stays put, so every event says so until stages_history fills it.
        return {Section.STAGES, Section.STAGES_GAP}
    if isinstance(end, int):
        state.stages_offset[job] = max(state.stages_offset.get(job, 0), end)
    return {Section.STAGES}


def _on_disk(state: ConsoleState, message: dict[str, Any]) -> set[str]:
    state.disks = _parse_items(state, DiskUsage, message.get("disks"), "disks", DISKS_MAX)
    return {Section.DISKS}


def _on_log(state: ConsoleState, message: dict[str, Any]) -> set[str]:
    job, stream = message.get("job"), message.get("stream")
    if not isinstance(job, str):
        raise InvalidMessage(f"log.job: expected a string, got {type_name(job)}")
    if stream not in ("stdout", "stderr"):
        raise InvalidMessage(f"log.stream: {cut_text(str(stream), 40)!r} is not one of stdout, stderr")
    lines = _expect(message.get("lines") or [], list, "log.lines")
    state.log(cut_text(job, STRING_CAP), stream).extend(lines)
    return {Section.LOGS}


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
