"""The agent's JSON-lines wire protocol: message types shared by backend/agent.py and console/.

Standard library only: the console uploads this file with the agent to any host Python >= 3.10.

Framing: one JSON object per line, UTF-8, "\n"-terminated. Every message has a "type". Non-finite
floats travel as the bare tokens NaN / Infinity / -Infinity (Python's json on both ends); metrics records
are already decoded from the file's encoding by backend.metrics.normalize_record before they are sent.
- console -> agent: requests, {"type": <Request kind>, "id": <int>, ...params}
- agent -> console: events (no id, pushed on their own schedule) and replies
  ({"type": "reply", "id": <request id>, "ok": true, "result": {...}} or
   {"type": "reply", "id": <request id>, "ok": false, "error": {"code": ..., "message": ...}}).
stderr of the agent is a separate diagnostic stream and is never parsed as data.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from typing import Any

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
    SIGNALS = "signals"  # {"name"} -> grokking/health signals computed from the job's metrics (backend/signals.py)
    WATCH_EXTERNAL = "watch_external"  # {"name", "path"} -> {} ; follow a SpecForge run read-only as job "ext:<name>"
    DATA_SCALING = "data_scaling"  # {"data_dir", "shape"?: {aux_width, teacher_width, dtype_bytes, seq_len}} -> backend/datascale.py
    RESULTS = "results"  # {"name"} -> {"results": [saved stop-and-bench results of that training job, oldest first]}
    SHUTDOWN = "shutdown"  # {} -> {} then the agent exits (jobs keep running)


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
    will_signal: list[dict[str, Any]]  # [{"pid", "job", "cmdline", "role"}]
    stale: list[dict[str, Any]]  # records not signalled: [{"job", "pid", "reason"}]
    foreign_gpu_holders: list[dict[str, Any]]  # left alone: [{"pid", "user", "cmdline", "used_memory_mib"}]
    checkpoint_first: bool  # True when a training job will write a checkpoint on SIGTERM


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


def to_dict(obj: Any) -> Any:
    """Dataclass (or list/dict of them) -> plain JSON-able structure."""
    if hasattr(obj, "__dataclass_fields__"):
        return asdict(obj)
    if isinstance(obj, list):
        return [to_dict(x) for x in obj]
    if isinstance(obj, dict):
        return {k: to_dict(v) for k, v in obj.items()}
    return obj


def from_dict(cls: type, data: dict[str, Any]) -> Any:
    """Build a dataclass from a dict, ignoring unknown keys (newer agents may add fields)."""
    names = {f.name for f in fields(cls)}
    kwargs = {k: v for k, v in data.items() if k in names}
    if cls is GpuSample and "processes" in kwargs:
        kwargs["processes"] = [from_dict(GpuProcess, p) for p in kwargs["processes"]]
    return cls(**kwargs)


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


# Metrics records (one JSON object per line of <job_dir>/metrics.jsonl) and chain stage records
# (<job_dir>/stages.jsonl): their file names live in backend/layout.py with the rest of the run-dir layout.
from backend.layout import INDEX_FILENAME as INDEX_FILENAME  # noqa: E402
from backend.layout import METRICS_FILENAME as METRICS_FILENAME  # noqa: E402
from backend.layout import STAGES_FILENAME as STAGES_FILENAME  # noqa: E402
