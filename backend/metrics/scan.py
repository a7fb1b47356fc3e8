"""Which series a metrics record feeds, and a fast exact scan of metrics.jsonl bytes into those series' columns.

Standard library only. The scan learns the shape of the trainer's train lines (key order, list and module
names) and reads a chunk either by splitting it into tokens (every line of one shape: TokenShape) or with one
regular expression per learned shape, converting only the values the index keeps; every line that fits no
shape (val records, other writers, odd values) goes through json.loads and backend.metrics.records.normalize_record,
the one decoder of the file's encoding. Both paths give
the same points, which tests/backend/metrics/test_series_index.py checks against a plain pass.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from backend.metrics.records import NONNEGATIVE_KEYS, normalize_record, record_loss

# Train records: the scalars the screens plot, acc[0] for the train/val accuracy gap, per-module weight norms, and the
# wall time (epoch seconds) that maps a step to when it ran (the plots' wall-time axis).
TRAIN_SCALARS = {
    "loss": "train.loss",
    "lr": "lr",
    "grad_norm": "grad_norm",
    "weight_norm": "weight_norm",
    "step_time": "step_time",
    "tokens": "tokens",
    "time": "time",
}
TRAIN_FIRST_OF_LIST = {"acc": "train.acc.0"}
MODULE_PREFIX = "weight_norm."
MAX_SHAPES = 4

_NONFINITE_STRINGS = (
    (b'"NaN"', b"NaN"),
    (b'"-Infinity"', b"-Infinity"),
    (b'"Infinity"', b"Infinity"),
    (b'"+Infinity"', b"Infinity"),
    (b'"inf"', b"Infinity"),
    (b'"-inf"', b"-Infinity"),
    (b'"nan"', b"NaN"),
)
# Captures are permissive (up to the next delimiter): float()/int() then reject anything that is not a number.
_SCALAR = rb"([^,{}\[\]\"\n]+)"
_SKIP_BY_TYPE = {
    str: rb'"(?:[^"\\\n]|\\.)*"',
    list: rb"\[[^\[\]{}\n]*\]",
    dict: rb"\{[^\[\]{}\n]*\}",
}
_SKIP_SCALAR = rb"[^,{}\[\]\"\n]+"


def record_points(record: dict[str, Any]) -> list[tuple[str, float]]:
    """(series key, value) pairs of one cleaned record (backend.metrics.records.normalize_record's output)."""
    split = record.get("split")
    out: list[tuple[str, float]] = []
    loss = record_loss(record)
    if loss is not None:
        out.append((f"{split}.loss", loss))
    lr = record.get("lr")
    if lr is not None:
        out.append(("lr", float(lr)))
    if split == "train":
        for key, series_key in TRAIN_SCALARS.items():
            if key not in ("loss", "lr") and record.get(key) is not None:
                out.append((series_key, float(record[key])))
        acc = record.get("acc")
        if acc:
            out.append(("train.acc.0", float(acc[0])))
        modules = record.get("weight_norm_modules")
        if isinstance(modules, dict):
            out.extend((MODULE_PREFIX + name, float(value)) for name, value in modules.items())
    else:
        for key in ("acc", "ploss", "acceptance_rate"):
            for k, value in enumerate(record.get(key) or []):
                out.append((f"val.{key}.{k}", float(value)))
    return out


def decode_line(line: bytes) -> tuple[dict[str, Any] | None, str | None]:
    """One metrics.jsonl line through the one decoder: (cleaned record, None), (None, why it is bad), or
    (None, None) for a blank line."""
    if not line.strip():
        return None, None
    try:
        raw = json.loads(line)
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        return None, f"not JSON: {str(exc)[:80]}"
    clean, problems = normalize_record(raw)
    if clean is None:
        return None, f"step {raw.get('step') if isinstance(raw, dict) else None!r}: " + "; ".join(problems)
    return clean, None


@dataclass
class ScanResult:
    """Points of a chunk by series key (steps ascending within each shape part), and the records of slow lines."""

    columns: dict[str, tuple[list[int], list[float]]] = field(default_factory=dict)
    slow_records: list[dict[str, Any]] = field(default_factory=list)  # cleaned records, file order
    records: int = 0
    fast_records: int = 0
    bad_lines: int = 0
    problems: list[str] = field(default_factory=list)

    def add_column(self, key: str, steps: list[int], values: list[float]) -> None:
        if key in self.columns:
            old_steps, old_values = self.columns[key]
            if steps and old_steps and steps[0] < old_steps[-1]:  # another shape's lines: keep steps ascending (stable)
                pairs = sorted(zip(old_steps + steps, old_values + values), key=lambda p: p[0])
                self.columns[key] = ([s for s, _ in pairs], [v for _, v in pairs])
            else:
                self.columns[key] = (old_steps + steps, old_values + values)
        else:
            self.columns[key] = (steps, values)


@dataclass
class Shape:
    """One learned line shape: a compiled regex and, per capture group, the series it feeds."""

    regex: re.Pattern
    targets: list[str]  # group i+2 (after the whole-line group) -> "step", a series key, or "acc0:<key>"
    nonnegative: set[str]


def normalize_nonfinite(chunk: bytes) -> bytes:
    """The writer's quoted non-finite strings as bare tokens float() reads; cheap when there are none."""
    if b"NaN" not in chunk and b"Inf" not in chunk and b'nan"' not in chunk and b'inf"' not in chunk:
        return chunk  # every quoted non-finite string contains one of these
    for quoted, bare in _NONFINITE_STRINGS:
        chunk = chunk.replace(b":" + quoted, b":" + bare).replace(b"," + quoted, b"," + bare).replace(b"[" + quoted, b"[" + bare)
    return chunk


def learn_shape(line: bytes) -> Shape | None:
    """A Shape for a compact train line of the trainer's writer, or None when the line is not one."""
    try:
        record = json.loads(line)
    except (ValueError, UnicodeDecodeError):
        return None
    if not isinstance(record, dict) or record.get("split") != "train" or not isinstance(record.get("step"), int):
        return None
    if "loss" not in record and "ploss" in record:
        return None  # the loss would be derived from ploss: the slow path does that
    parts: list[bytes] = []
    targets: list[str] = []
    for key, value in record.items():
        name = re.escape(json.dumps(key).encode()) + b":"
        part, keys = _part_for(key, value)
        if part is None:
            return None
        parts.append(name + part)
        targets.extend(keys)
    regex = re.compile(rb"^(?:(\{" + b",".join(parts) + rb"\})|(.*))$", re.M)
    nonnegative = {TRAIN_SCALARS[k] for k in NONNEGATIVE_KEYS if k in TRAIN_SCALARS}
    nonnegative |= {t for t in targets if t.startswith(MODULE_PREFIX)}
    return Shape(regex, targets, nonnegative)


def _part_for(key: str, value: Any) -> tuple[bytes | None, list[str]]:
    if key == "step":
        return rb"(\d+)", ["step"]
    if key == "split":
        return rb'"train"', []
    if key in TRAIN_SCALARS:
        return _SCALAR, [TRAIN_SCALARS[key]]  # tokens too: _fold_columns reads them with int()
    if key in TRAIN_FIRST_OF_LIST and isinstance(value, list) and value:
        return rb"\[" + _SCALAR + rb"[^\[\]{}\"\n]*\]", [TRAIN_FIRST_OF_LIST[key]]
    if key == "weight_norm_modules" and isinstance(value, dict) and value:
        inner = b",".join(re.escape(json.dumps(name).encode()) + b":" + _SCALAR for name in value)
        return rb"\{" + inner + rb"\}", [MODULE_PREFIX + str(name) for name in value]
    if isinstance(value, (str, list, dict)):
        return _SKIP_BY_TYPE[type(value)], []
    if value is None or isinstance(value, (int, float)):
        return _SKIP_SCALAR, []
    return None, []


class ChunkScanner:
    """Scans chunks of complete lines. Each chunk learns its own shapes from its own first lines, so a chunk's
    result depends on its bytes alone, never on the chunks scanned before it: a worker process that starts at
    any chunk reads it exactly as one process reading the file from its start does (backend.metrics.parallel).
    `tokens` and `shapes` are what the last chunk used."""

    def __init__(self) -> None:
        self.shapes: list[Shape] = []
        self.tokens: TokenShape | None = None

    def scan(self, chunk: bytes) -> ScanResult:
        result = ScanResult()
        chunk = normalize_nonfinite(chunk)
        self.shapes = []
        self.tokens = next((t for t in map(TokenShape.learn, _first_lines([chunk], 5)) if t is not None), None)
        if self.tokens is not None:
            handled = self.tokens.scan(chunk, result, self._fold_columns)
            if handled is not None:
                for line in handled:
                    self._slow_line(line, result)
                return result
        rest = [chunk]
        for shape in list(self.shapes):
            rest = self._apply(shape, rest, result)
        while rest and len(self.shapes) < MAX_SHAPES:
            learned = next((s for s in map(learn_shape, _first_lines(rest, 20)) if s is not None), None)
            if learned is None:
                break
            self.shapes.append(learned)
            rest = self._apply(learned, rest, result)
        for part in rest:
            for line in part.split(b"\n"):
                self._slow_line(line, result)
        return result

    def _apply(self, shape: Shape, rest: list[bytes], result: ScanResult) -> list[bytes]:
        """Read every line that fits `shape`; returns the lines that did not."""
        text = rest[0] if len(rest) == 1 else b"\n".join(rest)
        matches = shape.regex.findall(text.rstrip(b"\n"))
        columns = list(zip(*matches))
        if not columns:
            return rest
        whole, other = columns[0], columns[-1]
        leftovers = [line for line in other if line.strip()] if any(other) else []
        values: list[list[bytes]] = [list(col) for col in columns[1:-1]]
        if b"" in whole:  # rows of lines that did not fit: few, so delete them in place
            misfits = [i for i, line in enumerate(whole) if not line]
            for col in values:
                for i in reversed(misfits):
                    del col[i]
        if values and values[0] and not self._fold_columns(shape, values, result):
            leftovers.extend(line for line in whole if line)
        return leftovers

    def _fold_columns(self, shape: Shape, columns: list, result: ScanResult) -> bool:
        """Convert and keep the shape's columns; False (nothing kept) when a value needs the slow path."""
        try:
            converted = {target: _floats(col) for target, col in zip(shape.targets, columns) if target not in ("step", "tokens")}
            steps = list(map(int, columns[shape.targets.index("step")]))
            if "tokens" in shape.targets:
                converted["tokens"] = [float(t) for t in map(int, columns[shape.targets.index("tokens")])]
        except ValueError:
            return False
        if any(_has_negative(converted[target]) for target in shape.nonnegative & converted.keys()):
            return False
        order = None if steps == sorted(steps) else sorted(range(len(steps)), key=steps.__getitem__)
        if order is not None:
            steps = [steps[i] for i in order]
        for target, column in converted.items():
            result.add_column(target, steps, column if order is None else [column[i] for i in order])
        result.records += len(steps)
        result.fast_records += len(steps)
        return True

    @staticmethod
    def _slow_line(line: bytes, result: ScanResult) -> None:
        clean, problem = decode_line(line)
        if problem is not None:
            result.bad_lines += 1
            result.problems = (result.problems + [problem])[-5:]
        elif clean is not None:
            result.records += 1
            result.slow_records.append(clean)


_TOKEN_DELETE = b"[]{}"
_TOKEN_TABLE = bytes.maketrans(b":", b",")  # keys keep both quotes: '"loss"'


class TokenShape:
    """The fastest path, for chunks whose train lines all have one shape (the trainer's own writer).

    With brackets and braces deleted and `":` turned into `,`, a line of that shape splits on `,` into the
    same n tokens every time (keys and values at fixed places), and a chunk of L such lines into L*(n-1)+1
    tokens (each line's last token runs into the next line's first). Every key is checked at its place in
    every line (list.count) before any value is used; val lines are cut out first and go to the decoder. A value
    that ends the line (the writer puts `time` last) runs into the next line's first key: it is read up to the newline.
    """

    def __init__(self, roles: list[tuple[str, Any]], shape: Shape):
        self.width = len(roles)
        self.last_is_value = roles[-1][0] == "value"
        self.checks = [(j, value) for j, (role, value) in enumerate(roles) if role == "key" and j > 0]
        self.values = [(j, value) for j, (role, value) in enumerate(roles) if role == "value"]
        self.shape = shape  # its targets and non-negative set; columns are fed in the same order

    @classmethod
    def learn(cls, line: bytes) -> "TokenShape | None":
        shape = learn_shape(line)
        if shape is None:
            return None
        record = json.loads(line)
        roles: list[tuple[str, Any]] = []
        for key, value in record.items():
            roles.append(("key", json.dumps(key).encode()))
            if key == "step" or key in TRAIN_SCALARS:
                roles.append(("value", TRAIN_SCALARS.get(key, "step")))
            elif key in TRAIN_FIRST_OF_LIST and isinstance(value, list) and value:
                roles += [("value", TRAIN_FIRST_OF_LIST[key])] + [("skip", None)] * (len(value) - 1)
            elif key == "weight_norm_modules" and isinstance(value, dict) and value:
                for name in value:
                    roles += [("key", json.dumps(str(name)).encode()), ("value", MODULE_PREFIX + str(name))]
            elif isinstance(value, list) and value and all(isinstance(v, (int, float)) for v in value):
                roles += [("skip", None)] * len(value)
            elif key == "split":
                roles.append(("key", b'"train"'))
            elif isinstance(value, (int, float)) and not isinstance(value, bool):
                roles.append(("skip", None))
            else:
                return None  # strings, nulls, empty or nested containers: the regex path handles those
        tokens = line.rstrip(b"\n").translate(_TOKEN_TABLE, _TOKEN_DELETE).split(b",")
        if len(tokens) != len(roles) or any(role == "key" and tokens[j] != value for j, (role, value) in enumerate(roles)):
            return None
        targets = [target for role, target in roles if role == "value"]
        return cls(roles, Shape(shape.regex, targets, shape.nonnegative))

    def scan(self, chunk: bytes, result: ScanResult, fold) -> list[bytes] | None:
        """Fold the chunk's train lines and return its other lines; None when the chunk does not fit (nothing folded)."""
        others: list[bytes] = []
        if b'"split":"train"' not in chunk:
            return None
        chunk, others = _cut_lines(chunk, b'"split":"val"')
        lines = chunk.count(b"\n")
        if not lines:
            return others if not chunk.strip() else None
        tokens = chunk.translate(_TOKEN_TABLE, _TOKEN_DELETE).split(b",")
        period = self.width - 1
        if len(tokens) != lines * period + 1:
            return None
        for j, key in self.checks:
            if tokens[j::period].count(key) != lines:
                return None
        columns = [tokens[j::period] for j, _ in self.values]
        if self.last_is_value:  # 'value\n"step"': the next line's first key follows the newline
            columns[-1] = [token.partition(b"\n")[0] for token in columns[-1]]
        if not tokens[0].endswith(b'"step"') or not fold(self.shape, columns, result):
            return None
        return others


def _cut_lines(chunk: bytes, marker: bytes) -> tuple[bytes, list[bytes]]:
    """(chunk without the lines holding marker, those lines)."""
    if marker not in chunk:
        return chunk, []
    kept: list[bytes] = []
    cut: list[bytes] = []
    start = 0
    at = chunk.find(marker)
    while at >= 0:
        line_start = chunk.rfind(b"\n", 0, at) + 1
        line_end = chunk.find(b"\n", at)
        line_end = len(chunk) if line_end < 0 else line_end + 1
        kept.append(chunk[start:line_start])
        cut.append(chunk[line_start:line_end].rstrip(b"\n"))
        start = line_end
        at = chunk.find(marker, start)
    kept.append(chunk[start:])
    return b"".join(kept), cut


def _first_lines(parts: list[bytes], count: int) -> list[bytes]:
    lines: list[bytes] = []
    for part in parts:
        lines.extend(part.split(b"\n", count)[:count])
        if len(lines) >= count:
            break
    return lines[:count]


def _has_negative(column: list[float]) -> bool:
    if not column:
        return False
    total = sum(column)
    return min(column) < 0 if total - total == 0.0 else any(v < 0 for v in column)


def _floats(column) -> list[float]:
    try:
        if len(column) > 64 and column[0] == column[-1] == column[len(column) // 2]:
            distinct = {text: float(text) for text in set(column)}  # a constant LR: one conversion per value
            return list(map(distinct.__getitem__, column))
        return list(map(float, column))
    except ValueError:
        out = []
        for text in column:
            if text == b"null":
                out.append(float("nan"))
            else:
                out.append(float(text))  # raises: the caller falls back to the slow path
        return out


def points_of_records(records: list[dict[str, Any]]) -> dict[str, tuple[list[int], list[float]]]:
    """Series columns of cleaned records, each sorted by step (stable, so ties keep file order)."""
    by_key: dict[str, list[tuple[int, float]]] = {}
    for record in records:
        step = record["step"]
        for key, value in record_points(record):
            by_key.setdefault(key, []).append((step, value))
    out = {}
    for key, pairs in by_key.items():
        pairs.sort(key=lambda p: p[0])
        out[key] = ([s for s, _ in pairs], [v for _, v in pairs])
    return out
