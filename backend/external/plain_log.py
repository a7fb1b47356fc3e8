"""Plain-text training logs -> records: `name value` pairs with a step, or any text log through the user's line regex."""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

from backend.external.sources import NUMBER, LineLogSource, finished_record
from backend.external.tags import map_tag

_TEXT_TOKEN = re.compile(r"([A-Za-z][A-Za-z0-9_./-]*)|([-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?)(?:/\d+)?")
_STEP_NAMES = frozenset({"step", "global_step", "iter", "iteration"})
_VAL_WORDS = frozenset({"val", "valid", "validation", "eval", "evaluation", "evaluating", "test"})
_TEXT_INDEXED = re.compile(r"^(acc|ploss|acceptance_rate)_?(\d+)$")
_TEXT_ALIASES = {"grad": "grad_norm", "gnorm": "grad_norm", "time": "step_time"}
_TEXT_LISTS = {"acc": "acc", "ploss": "ploss", "plosses": "ploss", "acceptance_rate": "acceptance_rate"}
_NOT_NUMBERS = frozenset({"nan", "inf"})


class _TextRecord:
    """The values of one plain-text line being read: `name value` pairs folded into a record."""

    def __init__(self) -> None:
        self.split = "train"
        self.step: int | None = None
        self.values: dict[str, Any] = {}
        self.positions: dict[str, dict[int, float]] = {}

    def add(self, name: str, numbers: list[float]) -> None:
        name = name.lower().strip("[]:,")
        if name in _STEP_NAMES:
            if numbers[0] >= 0 and numbers[0] == int(numbers[0]):
                self.step = int(numbers[0])
            return
        indexed = _TEXT_INDEXED.match(name)
        if indexed:
            self.positions.setdefault(indexed.group(1), {})[int(indexed.group(2))] = numbers[0]
            return
        if name in _TEXT_LISTS and len(numbers) > 1:  # "acc 0.70 0.61 0.52": every position
            self.positions.setdefault(_TEXT_LISTS[name], {}).update(enumerate(numbers))
            return
        mapped = map_tag(_TEXT_ALIASES.get(name, name))
        if mapped is None:
            return
        split, key, index = mapped
        if split == "val":
            self.split = "val"
        if index is None:
            self.values.setdefault(key, numbers[0])
        else:
            self.positions.setdefault(key, {})[index] = numbers[0]

    def record(self) -> dict[str, Any] | None:
        if self.step is None or not (self.values or self.positions):
            return None
        record: dict[str, Any] = {"split": self.split, "step": self.step, **self.values}
        for key, slots in self.positions.items():
            record[key] = [slots.get(i, math.nan) for i in range(max(slots) + 1)]
        return finished_record(record)


def parse_text_line(line: str) -> dict[str, Any] | None:
    """A `name value ...` line with a step -> one record, else None: `[train] step 260/300 loss 6.47 acc0 0.78 lr 4.4e-04`.

    Names are the record's keys or their common spellings (lr, learning_rate, grad, grad_norm, acc0, acc_0, eval/loss);
    a name followed by several numbers is a per-position list ("acc 0.70 0.61"); "val"/"eval"/"validation" anywhere makes
    it a val record; "260/300" reads as 260; names not known (units, "s/step") are skipped."""
    found = _TextRecord()
    name: str | None = None
    numbers: list[float] = []
    for match in _TEXT_TOKEN.finditer(line):
        word, number = match.groups()
        if word is not None and word.lower() not in _NOT_NUMBERS:
            if name is not None and numbers:
                found.add(name, numbers)
            name, numbers = word, []
            if word.lower().strip("[]") in _VAL_WORDS:
                found.split = "val"
            continue
        numbers.append(float(number if number is not None else word))
    if name is not None and numbers:
        found.add(name, numbers)
    return found.record()


def compile_line_format(pattern: str) -> re.Pattern[str]:
    """A user's line regex, checked: it compiles and has a `step` group; ValueError says what is wrong."""
    try:
        compiled = re.compile(pattern)
    except re.error as exc:
        raise ValueError(f"line format {pattern!r} is not a regular expression: {exc}") from None
    if "step" not in compiled.groupindex:
        raise ValueError(f"line format {pattern!r} has no (?P<step>...) group; every record needs its step")
    if len(compiled.groupindex) < 2:
        raise ValueError(f"line format {pattern!r} names no value besides the step (e.g. (?P<loss>\\S+))")
    return compiled


def parse_format_line(pattern: re.Pattern[str], line: str) -> dict[str, Any] | None:
    """One line through a user's line regex: its named groups are the record's names (step, split, loss, acc0...)."""
    match = pattern.search(line)
    if match is None:
        return None
    found = _TextRecord()
    for name, text in match.groupdict().items():
        if text is None:
            continue
        if name == "split":
            found.split = "val" if text.strip("[] ").lower() in _VAL_WORDS else "train"
            continue
        numbers = [float(n) for n in re.findall(NUMBER, text, re.IGNORECASE)]
        if numbers:
            found.add(name, numbers)
    return found.record()


class TextLogSource(LineLogSource):
    """A plain-text training log -> records, a line at a time: the built-in `name value` reading, or a line regex."""

    def __init__(self, path: Path, line_format: re.Pattern[str] | None = None):
        super().__init__(path)
        self.line_format = line_format

    def _line(self, line: str) -> list[dict[str, Any]]:
        record = parse_format_line(self.line_format, line) if self.line_format is not None else parse_text_line(line)
        if record is None:
            return []
        when = self._asctime(line)
        if when is not None:
            record["time"] = when
        return [record]
