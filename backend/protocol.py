"""The agent's JSON-lines wire protocol: message types shared by backend/agent/server.py and console/.

Standard library only: the console uploads this file with the agent to any host Python >= 3.10.

Framing: one JSON object per line, UTF-8, "\n"-terminated. Every message has a "type". Non-finite
floats travel as the bare tokens NaN / Infinity / -Infinity (Python's json on both ends); metrics records
are already decoded from the file's encoding by backend.metrics.records.normalize_record before they are sent.
- console -> agent: requests, {"type": <Request kind>, "id": <int>, ...params}
- agent -> console: events (no id, pushed on their own schedule) and replies
  ({"type": "reply", "id": <request id>, "ok": true, "result": {...}} or
   {"type": "reply", "id": <request id>, "ok": false, "error": {"code": ..., "message": ...}}).
stderr of the agent is a separate diagnostic stream and is never parsed as data.
"""

from __future__ import annotations

import json
import math
import types
import typing
from dataclasses import MISSING, asdict, dataclass, field, fields, is_dataclass
from typing import Any, Mapping

PROTOCOL_VERSION = 2


class Event:
    """Types of messages the agent pushes unasked."""

    HELLO = "hello"  # once at start: HelloInfo
    GPUS = "gpus"  # every tick: {"gpus": [GpuSample...], "driver": {...}}
    JOBS = "jobs"  # when the job table changes, and every few ticks: {"jobs": [JobInfo...]}
    METRICS = "metrics"  # new metrics.jsonl records (cleaned): {"job", "records": [...], "start_offset": int, "offset": int}
    INDEX_PROGRESS = "index_progress"  # a backlog being indexed: {"job", "indexed_bytes", "file_bytes", "caught_up", ...}
    STAGES = "stages"  # new stages.jsonl lines of a chain job: {"job": name, "records": [...], "start_offset": b, "offset": e}
    DISK = "disk"  # every few ticks: {"disks": [DiskUsage...]}
    LOG = "log"  # lines of a followed log: {"job": name, "stream": "stdout"|"stderr", "lines": [...]}
    REPLY = "reply"


class Request:
    """Types of requests the console sends. Params are listed beside each."""

    PING = "ping"  # {} -> {"pong": true, "time": float}
    SNAPSHOT = "snapshot"  # {"stall_after_s"?} -> {"hello", "gpus", "jobs", "metrics": {job: latest record}, "disks"}
    # node: one host's part of a multi-node torchrun job (backend/commands.py torchrun_train_argv, check_node)
    START_JOB = "start_job"  # {"name", "kind", "argv": [...], "cwd"?, "env"?, "node"?: {"run_id", "node_rank", "nnodes", "rdzv_endpoint"}} -> {"job": JobInfo}
    STOP_PLAN = "stop_plan"  # {"name"? | "all": bool} -> StopPlan
    STOP_JOB = "stop_job"  # {"name"? | "all": bool, "grace": float} -> {"verdicts": [ProcessVerdict...]}
    ADOPT_JOB = "adopt_job"  # {"pid", "name", "confirm_pid": same pid typed by the operator} -> {"job": JobInfo}
    LIST_JOBS = "list_jobs"  # {"stall_after_s"?: seconds (default: the agent's --stall-after)} -> {"jobs": [JobInfo...]}
    HOLDERS = "holders"  # {} -> {"holders": [GpuHolder...], "fuser_stderr_lines": int}
    TAIL_LOG = "tail_log"  # {"name", "stream": "stdout"|"stderr", "lines": int} -> {"lines": [...]}
    METRICS_HISTORY = "metrics_history"  # {"name", "offset"?: int} -> {"records": [...], "offset": int, "more": bool} (bounded pages)
    METRICS_SERIES = "metrics_series"  # {"name", "keys": [... "weight_norm.*"], "from"?, "to"?, "points", "log_x"?} -> buckets per key
    METRICS_WINDOW = "metrics_window"  # {"name", "last": N, "val": K} -> {"records": last N, "val": last K val records, "offset"}
    STAGES_HISTORY = "stages_history"  # {"name"} -> {"records": [...], "offset": bytes read}
    FOLLOW_LOG = "follow_log"  # {"name"?, "stream"} -> {} ; then LOG events; name null stops following
    LIST_CHECKPOINTS = "list_checkpoints"  # {"name"} -> {"checkpoints": [{"path","epoch","step","latest"}]}
    SIGNALS = "signals"  # {"name"} -> grokking/health signals computed from the job's metrics (backend/metrics/signals.py)
    WATCH_EXTERNAL = "watch_external"  # {"name", "path", "line_format"?} -> {"job", "format", "warning"}; follow a run read-only as "ext:<name>"
    UNWATCH_EXTERNAL = "unwatch_external"  # {"name": "ext:<name>"} -> {"job", "path"}; stop reading that run (nothing on the host is touched)
    DATA_SCALING = "data_scaling"  # {"data_dir", "shape"?: {aux_width, teacher_width, dtype_bytes, seq_len}} -> backend/host/datascale.py
    RESULTS = "results"  # {"name"} -> {"results": [saved stop-and-bench results of that training job, oldest first]}
    SHUTDOWN = "shutdown"  # {} -> {} then the agent exits (jobs keep running)


JOB_KINDS = ("train", "serve", "bench", "chain", "other", "adopted", "external")  # external: a watched run (console side)
JOB_STATES = ("running", "exited", "stopped", "stale", "unknown", "watching")
GPU_SOURCES = ("nvml", "nvidia-smi", "none")


class ErrorCode:
    MALFORMED = "malformed"  # not JSON, not an object, no type
    UNKNOWN_REQUEST = "unknown_request"
    BAD_PARAMS = "bad_params"
    NOT_FOUND = "not_found"
    CONFLICT = "conflict"  # e.g. a running job with that name already exists
    REFUSED = "refused"  # e.g. adopt without matching confirmation, stop of a stale record
    INTERNAL = "internal"


@dataclass
class GpuProcess:
    pid: int
    used_memory_mib: float | None = None


@dataclass
class GpuSample:
    index: int
    name: str = ""
    uuid: str = ""
    memory_used_mib: float | None = None
    memory_total_mib: float | None = None
    utilization_pct: float | None = None
    temperature_c: float | None = None
    power_w: float | None = None
    processes: list[GpuProcess] = field(default_factory=list)


@dataclass
class GpuHolder:
    """A process holding a GPU, from NVML/nvidia-smi compute processes and/or fuser on /dev/nvidia*."""

    pid: int
    owned: bool  # a registered job or a descendant of one
    job: str | None = None  # the owning job's name when owned
    user: str = ""
    cmdline: str = ""
    gpu_indices: list[int] = field(default_factory=list)
    used_memory_mib: float | None = None
    sources: list[str] = field(default_factory=list)  # "nvml", "nvidia-smi", "fuser"


@dataclass
class JobInfo:
    name: str
    kind: str  # train | serve | bench | chain | adopted | other
    state: str  # running | exited | stopped | stale | unknown
    pid: int
    pgid: int
    start_time_ticks: int  # field 22 of /proc/PID/stat: identity of the process
    argv: list[str]
    job_dir: str
    stdout_path: str
    stderr_path: str
    started_at: float  # wall clock, epoch seconds
    ended_at: float | None = None
    exit_code: int | None = None
    adopted: bool = False
    # One host's part of a multi-node job (None for an ordinary job): the same run_id on every host.
    run_id: str | None = None
    node_rank: int | None = None
    nnodes: int | None = None
    rdzv_endpoint: str | None = None
    # This host's training ranks from their heartbeat files (backend/layout.py rank_heartbeats), ages from the
    # agent's clock: [{"rank", "local_rank", "node_rank", "step", "age_s", "step_age_s", "pid", "phase"}]
    ranks: list[dict[str, Any]] = field(default_factory=list)
    stalled_ranks: list[int] = field(default_factory=list)  # running, heartbeat older than the agent's threshold
    # A running job's processes (leader, group, descendants, recorded ones) as the agent measured them last (every few
    # seconds; None before the first two looks): CPU % over the interval between looks (100 = one core) and resident memory.
    cpu_pct: float | None = None
    rss_bytes: int | None = None


@dataclass
class ProcessVerdict:
    pid: int
    role: str  # leader | group | descendant
    outcome: str  # exited_on_term | killed | already_gone | stale_not_signalled | survived (incl. "not signalled: the stopper or its parents")
    detail: str = ""


@dataclass
class StopPlan:
    """What a stop would do, computed without signalling anything (shown in the console's modal)."""

    jobs: list[str]
    will_signal: list[dict[str, Any]]  # [{"pid", "job", "cmdline", "role", "state"?}]: "state" when it will not handle SIGTERM at once
    stale: list[dict[str, Any]]  # records not signalled: [{"job", "pid", "reason"}]
    foreign_gpu_holders: list[dict[str, Any]]  # left alone: [{"pid", "user", "cmdline", "used_memory_mib"}]
    checkpoint_first: bool  # True when a training job will write a checkpoint on SIGTERM
    checkpoint_note: str = ""  # why a training job in this stop will write none (its leader is held by a debugger)


@dataclass
class DiskUsage:
    path: str
    label: str  # run_dir | data_dir | ...
    total_bytes: int
    used_bytes: int
    free_bytes: int
    dir_bytes: int | None = None  # bytes under path itself, when measured
    checkpoint_bytes: int | None = None  # run_dir: the largest latest checkpoint of a running training job (what a save needs)


@dataclass
class HelloInfo:
    protocol: int
    host: str
    python: str
    agent_pid: int
    run_dir: str
    driver: str | None  # NVIDIA driver version or None
    nvml: str  # "ok" | "no NVIDIA driver (...)" | "NVML error: ..."
    gpu_source: str  # "nvml" | "nvidia-smi" | "none"
    sglang: str | None  # version when importable on the host
    backend_hash: str | None = None  # content hash of the uploaded backend package


@dataclass
class SeriesBucket:
    """One bucket of a `metrics_series` reply (backend/metrics/series.to_bucket): None where nothing finite was seen."""

    step_lo: int
    step_hi: int
    count: int
    nonfinite: int = 0
    min: float | None = None
    max: float | None = None
    first: float | None = None
    last: float | None = None
    mean: float | None = None


def to_dict(obj: Any) -> Any:
    """Dataclass (or list/dict of them) -> plain JSON-able structure."""
    if hasattr(obj, "__dataclass_fields__"):
        return asdict(obj)
    if isinstance(obj, list):
        return [to_dict(x) for x in obj]
    if isinstance(obj, dict):
        return {k: to_dict(v) for k, v in obj.items()}
    return obj


class InvalidMessage(ValueError):
    """A message (or part of one) that does not have the contract's shape; the text says where and what."""


@dataclass(frozen=True)
class Limits:
    """How much of one message a reader keeps: longer strings are cut and marked, longer lists cut, deeper nesting dropped."""

    string: int = 4096
    items: int = 10_000
    depth: int = 8


ENUMS: dict[tuple[str, str], tuple[str, ...]] = {
    ("JobInfo", "kind"): JOB_KINDS,
    ("JobInfo", "state"): JOB_STATES,
    ("HelloInfo", "gpu_source"): GPU_SOURCES,
}
_HINTS: dict[type, dict[str, Any]] = {}


def cut_text(text: str, limit: int) -> str:
    """At most `limit` characters; a cut string says how much was cut."""
    if len(text) <= limit:
        return text
    return f"{text[:limit]}…[{len(text) - limit} more chars cut]"


def bounded(value: Any, limits: Limits = Limits(), depth: int = 0) -> Any:
    """Any decoded JSON value with strings cut, lists and objects shortened and nesting below limits.depth dropped."""
    if isinstance(value, str):
        return cut_text(value, limits.string)
    if isinstance(value, (list, dict)) and depth >= limits.depth:
        return None
    if isinstance(value, list):
        return [bounded(v, limits, depth + 1) for v in value[: limits.items]]
    if isinstance(value, dict):
        keys = list(value)[: limits.items]
        return {cut_text(str(k), limits.string): bounded(value[k], limits, depth + 1) for k in keys}
    return value


def type_name(value: Any) -> str:
    return "null" if value is None else {dict: "object", list: "array", str: "string", bool: "boolean"}.get(type(value), type(value).__name__)


def parse(cls: type, data: Any, limits: Limits = Limits(), where: str = "") -> Any:
    """A contract dataclass from a decoded object, checking every field's type (ints are accepted as floats; bools are
    not numbers) and the known enums; unknown keys are ignored. Raises InvalidMessage naming the first bad field."""
    where = where or cls.__name__
    if not isinstance(data, dict):
        raise InvalidMessage(f"{where}: expected an object, got {type_name(data)}")
    hints = _HINTS.get(cls)
    if hints is None:
        hints = _HINTS[cls] = typing.get_type_hints(cls)
    kwargs: dict[str, Any] = {}
    for f in fields(cls):
        if f.name not in data:
            if f.default is MISSING and f.default_factory is MISSING:
                raise InvalidMessage(f"{where}.{f.name}: missing")
            continue
        value = check_type(hints[f.name], data[f.name], limits, f"{where}.{f.name}")
        allowed = ENUMS.get((cls.__name__, f.name))
        if allowed and value not in allowed:
            raise InvalidMessage(f"{where}.{f.name}: {cut_text(str(value), 40)!r} is not one of {', '.join(allowed)}")
        kwargs[f.name] = value
    return cls(**kwargs)


def check_type(hint: Any, value: Any, limits: Limits, where: str) -> Any:
    """`value` checked against a type hint of the contract (str, int, float, bool, X | None, list[X], dict, Any,
    a dataclass), strings cut and lists shortened by `limits`."""
    origin = typing.get_origin(hint)
    if hint is Any:
        return bounded(value, limits)
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(hint)
        if value is None and type(None) in options:
            return None
        errors = []
        for option in options:
            if option is not type(None):
                try:
                    return check_type(option, value, limits, where)
                except InvalidMessage as exc:
                    errors.append(str(exc))
        raise InvalidMessage(errors[0] if len(errors) == 1 else f"{where}: unexpected {type_name(value)}")
    if origin is list or hint is list:
        if not isinstance(value, list):
            raise InvalidMessage(f"{where}: expected an array, got {type_name(value)}")
        (item,) = typing.get_args(hint) or (Any,)
        return [check_type(item, v, limits, f"{where}[{i}]") for i, v in enumerate(value[: limits.items])]
    if origin is dict or hint is dict:
        if not isinstance(value, dict):
            raise InvalidMessage(f"{where}: expected an object, got {type_name(value)}")
        return bounded(value, limits)
    if hint is bool:
        if not isinstance(value, bool):
            raise InvalidMessage(f"{where}: expected a boolean, got {type_name(value)}")
        return value
    if hint is int or hint is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or (hint is int and not isinstance(value, int)):
            raise InvalidMessage(f"{where}: expected {'an integer' if hint is int else 'a number'}, got {type_name(value)}")
        if hint is float and not math.isfinite(value):
            raise InvalidMessage(f"{where}: expected a finite number, got {value!r}")
        return float(value) if hint is float else value
    if hint is str:
        if not isinstance(value, str):
            raise InvalidMessage(f"{where}: expected a string, got {type_name(value)}")
        return cut_text(value, limits.string)
    if isinstance(hint, type) and is_dataclass(hint):
        return parse(hint, value, limits, where)
    raise InvalidMessage(f"{where}: no check for {hint!r}")  # a contract type this function does not know yet


NUMBER = (int, float)  # check_fields: a JSON number (never a boolean)
OPTIONAL = type(None)


def check_fields(entry: Any, spec: Mapping[str, tuple[type, ...]], where: str, limits: Limits = Limits()) -> dict[str, Any]:
    """A plain object whose listed keys, when present, hold one of the listed types (OPTIONAL allows null); the
    object comes back bounded. Raises InvalidMessage naming the first bad key."""
    if not isinstance(entry, dict):
        raise InvalidMessage(f"{where}: expected an object, got {type_name(entry)}")
    for key, allowed in spec.items():
        if key in entry:
            value = entry[key]
            if (isinstance(value, bool) and bool not in allowed) or not isinstance(value, allowed):
                names = " or ".join(type_name(t()) if t is not OPTIONAL else "null" for t in allowed)
                raise InvalidMessage(f"{where}.{key}: expected {names}, got {type_name(value)}")
            if isinstance(value, float) and not math.isfinite(value):
                raise InvalidMessage(f"{where}.{key}: expected a finite number, got {value!r}")
    return bounded(entry, limits)


def encode(message: dict[str, Any]) -> bytes:
    """One message -> one line of bytes."""
    return (json.dumps(to_dict(message), separators=(",", ":")) + "\n").encode()


class MalformedMessage(ValueError):
    pass


MAX_LINE_BYTES = 4 << 20  # requests are small; replies may be larger (the console raises its own limit)


def decode(line: bytes | str, max_bytes: int | None = None) -> dict[str, Any]:
    """One line -> one message; raises MalformedMessage saying what was wrong (never anything else)."""
    if max_bytes is not None and len(line) > max_bytes:
        raise MalformedMessage(f"line of {len(line)} bytes is longer than the {max_bytes}-byte limit")
    if isinstance(line, bytes):
        try:
            line = line.decode()
        except UnicodeDecodeError as exc:
            raise MalformedMessage(f"not UTF-8: {exc}") from None
    if "\x00" in line:
        raise MalformedMessage("line holds a NUL byte")
    try:
        message = json.loads(line)
    except json.JSONDecodeError as exc:
        raise MalformedMessage(f"not JSON ({exc.msg} at column {exc.colno}): {line[:80]!r}") from None
    except RecursionError:
        raise MalformedMessage("JSON nested too deeply") from None
    except ValueError as exc:  # e.g. an integer over Python's digit limit
        raise MalformedMessage(f"not JSON: {str(exc)[:120]}") from None
    if not isinstance(message, dict):
        raise MalformedMessage(f"expected a JSON object, got {type(message).__name__}")
    if not isinstance(message.get("type"), str):
        raise MalformedMessage("message has no string 'type'")
    return message


def reply_ok(request_id: Any, result: Any) -> dict[str, Any]:
    return {"type": Event.REPLY, "id": request_id, "ok": True, "result": to_dict(result)}


def reply_error(request_id: Any, code: str, message: str) -> dict[str, Any]:
    return {"type": Event.REPLY, "id": request_id, "ok": False, "error": {"code": code, "message": message}}
