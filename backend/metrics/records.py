"""Training metrics records: schema and validator, the trainer's writer, the tailing reader, per-key series and latest values.

Standard library only (runs inside the agent on any host Python >= 3.10).

One record per line of <job_dir>/metrics.jsonl (METRICS_FILENAME in backend/layout.py):
  step (int >= 0, required), split ("train" | "val", required), epoch (number >= 0), loss (number),
  ploss (list of numbers, one per TTT position), acc (list of fractions in [0, 1], one per TTT position),
  acceptance_rate (list, SpecForge's expected acceptance per position; optional extension),
  lr, grad_norm (pre-clip), weight_norm, step_time (seconds) (numbers), weight_norm_modules
  ({module name: number}), tokens (cumulative int), time (epoch seconds). Validation lines also carry rounds
  ({draft steps: histogram of drafts accepted per chain round replayed on the val split}) and accept_sim
  ({draft steps: the accept length of those rounds}).
Keys other than these are kept and not checked, so newer writers can add fields.

Non-finite floats are written as the JSON strings "NaN", "Infinity", "-Infinity" (strict JSON, and a
NaN loss stays distinguishable from a missing one). Readers accept those strings, bare NaN/Infinity
tokens (Python's json default) and null, and turn all of them into float NaN/inf.
"""

from __future__ import annotations

import math
import numbers
import os
import sys
import time
from collections import deque
from pathlib import Path
from typing import Any, Callable, Iterable

from backend.jsonl import JsonlFollower, append_record

SPLITS = ("train", "val")
SCALAR_KEYS = ("epoch", "loss", "lr", "grad_norm", "weight_norm", "time", "step_time")
LIST_KEYS = ("ploss", "acc", "acceptance_rate")
NONNEGATIVE_KEYS = ("epoch", "lr", "grad_norm", "weight_norm", "step_time")
PLOSS_DECAY = 0.8  # SpecForge / EAGLE weight of TTT position i: 0.8**i

_NONFINITE_TEXT = {"nan": math.nan, "inf": math.inf, "+inf": math.inf, "-inf": -math.inf, "infinity": math.inf, "+infinity": math.inf, "-infinity": -math.inf}


class MetricsRecordError(ValueError):
    """A metrics record that does not follow the schema; `problems` names each wrong key."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        super().__init__("bad metrics record (nothing written): " + "; ".join(problems))


def _as_number(value: Any) -> float | int | None:
    """A real number (or a 0-d tensor/array scalar via .item()), the non-finite strings, or None if not a number."""
    kind = type(value)
    if kind is float or kind is int:  # the common case, before the slower ABC checks below
        return value
    if isinstance(value, bool):
        return None
    if isinstance(value, numbers.Real):
        return value if isinstance(value, int) else float(value)
    if isinstance(value, str):
        return _NONFINITE_TEXT.get(value.strip().lower())
    item = getattr(value, "item", None)
    if callable(item):
        try:
            return _as_number(item())
        except (TypeError, ValueError, RuntimeError):
            return None
    return None


def _number_problem(key: str, value: Any, nonnegative: bool = False) -> tuple[float | int | None, str | None]:
    if value is None:
        return math.nan, None
    number = _as_number(value)
    if number is None:
        return None, f"'{key}' must be a number, got {type(value).__name__} {value!r:.40}"
    if nonnegative and number < 0:
        return None, f"'{key}' must be >= 0, got {number}"
    return number, None


def normalize_record(record: Any) -> tuple[dict[str, Any] | None, list[str]]:
    """Check a record and coerce its values; returns (clean record, []) or (None, problems naming each bad key)."""
    if not isinstance(record, dict):
        return None, [f"record must be a JSON object, got {type(record).__name__}"]
    problems: list[str] = []
    clean = dict(record)
    if "step" not in record:
        problems.append("'step' is missing")
    else:
        clean["step"] = _count("step", record["step"], problems)
    if record.get("split") not in SPLITS:
        problems.append(f"'split' must be one of {SPLITS}, got {record.get('split')!r:.40}")
    for key in SCALAR_KEYS:
        if key in record:
            clean[key], problem = _number_problem(key, record[key], key in NONNEGATIVE_KEYS)
            problems += [problem] if problem else []
    for key in LIST_KEYS:
        if key in record:
            clean[key] = _clean_list(key, record[key], problems)
    if "weight_norm_modules" in record:
        clean["weight_norm_modules"] = _clean_modules(record["weight_norm_modules"], problems)
    if "tokens" in record:
        clean["tokens"] = _count("tokens", record["tokens"], problems)
    return (None, problems) if problems else (clean, [])


def _count(key: str, value: Any, problems: list[str]) -> int | None:
    number = _as_number(value)
    if number is None or not math.isfinite(number) or number < 0 or not float(number).is_integer():
        problems.append(f"'{key}' must be an integer >= 0, got {value!r:.40}")
        return None
    return int(number)


def _clean_list(key: str, value: Any, problems: list[str]) -> list[float] | None:
    if not isinstance(value, (list, tuple)):
        problems.append(f"'{key}' must be a list of numbers (one per TTT position), got {type(value).__name__}")
        return None
    out = []
    for i, item in enumerate(value):
        number, problem = _number_problem(f"{key}[{i}]", item)
        if problem:
            problems.append(problem)
            return None
        out.append(float(number))  # type: ignore[arg-type]  # a number whenever there is no problem
    return out


def _clean_modules(value: Any, problems: list[str]) -> dict[str, float] | None:
    if not isinstance(value, dict):
        problems.append(f"'weight_norm_modules' must be an object {{module: norm}}, got {type(value).__name__}")
        return None
    out = {}
    for name, item in value.items():
        number, problem = _number_problem(f"weight_norm_modules[{name!r}]", item, nonnegative=True)
        if problem:
            problems.append(problem)
            return None
        out[str(name)] = float(number)  # type: ignore[arg-type]  # a number whenever there is no problem
    return out


def check_record(record: Any) -> list[str]:
    """Problems with a record (empty when it follows the schema), each naming the key that is wrong."""
    return normalize_record(record)[1]


def validate_record(record: Any) -> dict[str, Any]:
    """The cleaned record, or MetricsRecordError naming every wrong key."""
    clean, problems = normalize_record(record)
    if clean is None:
        raise MetricsRecordError(problems)
    return clean


def encode_nonfinite(value: Any) -> Any:
    """Replace non-finite floats (also inside lists/dicts) by "NaN"/"Infinity"/"-Infinity" for strict JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")
    if isinstance(value, dict):
        return {k: encode_nonfinite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [encode_nonfinite(v) for v in value]
    return value


class MetricsWriter:
    """Appends validated records to a metrics.jsonl; one write() per line, never glued onto a torn line.

    Keys whose value is None are left out (optional keys may be absent). `time` is filled with the
    current epoch seconds when absent. A bad record raises MetricsRecordError and nothing is written.

    A write the disk refuses (full, quota, I/O error) never raises: the record is held in memory, in
    order, and written before the next one (or by `flush()`), so a full disk costs a training run no
    metrics once room comes back. At most `max_pending` records are held; older ones beyond that are
    dropped and counted in `lost_records`. `on_error` (default: a line on stderr) hears once when writes
    start failing, once when one is dropped, and once when the held records reach the file again.
    Counters: `written` (records in the file), `pending` (held), `lost_records`, `failed_writes`,
    `last_error` (the AppendError while writes are failing, else None).
    """

    MAX_PENDING = 100_000

    def __init__(self, path: str | os.PathLike, on_error: Callable[[str], Any] | None = None, max_pending: int = MAX_PENDING):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.on_error = on_error or _warn
        self.max_pending = max(1, int(max_pending))
        self.held: deque[dict[str, Any]] = deque()
        self.written = 0
        self.lost_records = 0
        self.failed_writes = 0
        self.last_error: OSError | None = None

    @property
    def pending(self) -> int:
        return len(self.held)

    def write(self, record: dict[str, Any] | None = None, /, **fields: Any) -> dict[str, Any]:
        merged = {k: v for k, v in {**(record or {}), **fields}.items() if v is not None}
        merged.setdefault("time", time.time())
        clean = validate_record(merged)
        self.held.append(encode_nonfinite(clean))
        if len(self.held) > self.max_pending:
            self.held.popleft()
            self.lost_records += 1
            if self.lost_records == 1:
                self._tell(
                    f"metrics: more than {self.max_pending} records held in memory while {self.path} "
                    "is not writable; dropping the oldest (counted in lost_records)"
                )
        self.flush()
        return clean

    def flush(self) -> bool:
        """Write the held records, oldest first; True when none is left held."""
        while self.held:
            try:
                append_record(self.path, self.held[0])
            except OSError as exc:
                self.failed_writes += 1
                if self.last_error is None:
                    self._tell(
                        f"metrics: {exc}. Keeping the record in memory ({len(self.held)} held) and "
                        "retrying before the next one; free space to let them through."
                    )
                self.last_error = exc
                return False
            self.held.popleft()
            self.written += 1
        if self.last_error is not None:
            self.last_error = None
            lost = f"; {self.lost_records} record(s) were dropped while it was not" if self.lost_records else ""
            self._tell(f"metrics: {self.path} is writable again; the held records are written{lost}")
        return True

    def _tell(self, message: str) -> None:
        try:
            self.on_error(message)
        except OSError:  # the log itself may sit on the full disk
            pass


def _warn(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


class MetricsReader:
    """Follows a metrics.jsonl from a byte offset; returns cleaned records, skips (and describes) bad ones."""

    MAX_PROBLEMS = 20

    def __init__(self, path: str | os.PathLike, offset: int = 0):
        self.follower = JsonlFollower(path, offset=offset)
        self.bad_records = 0
        self.problems: list[str] = []  # the most recent few, for the operator

    @property
    def offset(self) -> int:
        return self.follower.offset

    def poll(self) -> list[dict[str, Any]]:
        """Everything complete since the last poll (a partial last line waits for the next one)."""
        records = []
        while True:
            before = self.follower.offset
            batch = self.follower.poll()
            for raw in batch:
                clean, problems = normalize_record(raw)
                if clean is None:
                    self._skip(raw, problems)
                else:
                    records.append(clean)
            if self.follower.offset == before:
                return records

    def _skip(self, raw: Any, problems: list[str]) -> None:
        self.bad_records += 1
        step = raw.get("step") if isinstance(raw, dict) else None
        self.problems = (self.problems + [f"record at step {step!r}: " + "; ".join(problems)])[-self.MAX_PROBLEMS :]


def read_metrics(path: str | os.PathLike, offset: int = 0) -> tuple[list[dict[str, Any]], int]:
    """Cleaned records from byte `offset` to the last complete line, and the offset to resume from."""
    reader = MetricsReader(path, offset)
    records = reader.poll()
    return records, reader.offset


def record_loss(record: dict[str, Any]) -> float | None:
    """The record's loss, or SpecForge's weighted total sum(0.8**i * ploss[i]) when only ploss was logged."""
    loss = record.get("loss")
    if loss is not None:
        return float(loss)
    plosses = record.get("ploss")
    if plosses:
        return sum(PLOSS_DECAY**i * float(p) for i, p in enumerate(plosses))
    return None


def _pick(record: dict[str, Any], key: str, index: int | str | None) -> float | None:
    value = record_loss(record) if key == "loss" else record.get(key)
    if value is None:
        return None
    if isinstance(value, dict):
        if index is None:
            raise ValueError(f"'{key}' holds one value per module; pass index=<module name>")
        value = value.get(index)
    elif isinstance(value, list):
        if index is None:
            raise ValueError(f"'{key}' holds one value per TTT position; pass index=<position>")
        value = value[index] if isinstance(index, int) and -len(value) <= index < len(value) else None
    if type(value) is float or type(value) is int:  # the common case; _as_number's ABC checks are slow
        return float(value)
    number = _as_number(value) if value is not None else None
    return None if number is None else float(number)


def series(records: Iterable[dict[str, Any]], key: str, split: str = "train", index: int | str | None = None) -> tuple[list[int], list[float]]:
    """(steps, values) of one key for one split, sorted by step; a repeated step keeps its latest record.

    `index` picks acc[i] / ploss[i] / acceptance_rate[i], or a module of weight_norm_modules.
    "loss" falls back to the weighted ploss sum. Non-finite values are kept (as NaN/inf).
    """
    by_step: dict[int, float] = {}
    for record in records:
        if record.get("split") != split or not isinstance(record.get("step"), int):
            continue
        value = _pick(record, key, index)
        if value is not None:
            by_step[record["step"]] = value
    steps = sorted(by_step)
    return steps, [by_step[s] for s in steps]


def latest(records: Iterable[dict[str, Any]], split: str, key: str) -> dict[str, Any] | None:
    """The last record (file order) of a split that has `key`."""
    found = None
    for record in records:
        if record.get("split") == split and record.get(key) is not None:
            found = record
    return found
