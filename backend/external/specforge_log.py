"""SpecForge console logs -> records: `step S: {...}` dict lines and the older per-position `Eval - Step` lines."""

from __future__ import annotations

import functools
import json
import math
import re
from pathlib import Path
from typing import Any, NamedTuple, overload

from backend.external.sources import NUMBER, LineLogSource, finished_record
from backend.external.tags import EXTRAS_MAX, extra_split, map_tag

# SpecForge's trainer prints every tracker dict as `step {S}: {dict repr}`: Python repr (single quotes, bare
# nan/inf), values floats or lists of floats; keys "train/..."/"eval/..." (a tracker is set) or bare (none is).
_STEP_DICT_LINE = re.compile(r"(?<![\w/.-])step (\d+): (\{.*\})")
_DICT_ITEM = re.compile(r"""(?:'((?:[^'\\]|\\.)*)'|"((?:[^"\\]|\\.)*)")\s*:\s*(\[[^\[\]{}]*\]|[^,\[\]{}]+)""")
# scripts/train_eagle3.py (2025-2026): "Eval - Step {s} [{s+1}/{epochs}], position {i},  Acc: {a:.2f}"
# (printed for both modes: train first, then eval at the same step), "... pLoss: {p}", "... Acceptance Rate: {r}".
_STEP_LINE = re.compile(r"\bEval - Step (\d+)(\s*\[[^\]]*\])?\s*,\s*position (\d+)\s*,\s*(Acc|pLoss|Acceptance Rate)\s*:\s*" + NUMBER)
# train_eagle3_online.py (2025): "Eval Step [{s}], position {i}, Acc: {a}" (eval only)
_STEP_BRACKET_LINE = re.compile(r"\bEval Step \[(\d+)\]\s*,\s*position (\d+)\s*,\s*(Acc|pLoss|Acceptance Rate)\s*:\s*" + NUMBER)
# older scripts: "Train Epoch [{e+1}/{epochs}], position {i},  Acc: {a:.2f}", also Eval/Test Epoch
_EPOCH_LINE = re.compile(r"\b(Train|Eval|Test) Epoch \[(\d+)/\d+\]\s*,\s*position (\d+)\s*,\s*(Acc|pLoss|Acceptance Rate)\s*:\s*" + NUMBER)
_TQDM_LINE = re.compile(r"\b(Training|Evaluating) Epoch (\d+)\s*:\s*(?:\s*\d+%\|[^|]*\|\s*(\d+)/(\d+))?")
_LR = re.compile(r"\b(?:lr|learning[_ ]rate)\s*[=:]\s*" + NUMBER, re.IGNORECASE)
_KEYS = {"acc": "acc", "ploss": "ploss", "acceptance rate": "acceptance_rate"}


def parse_step_dict(text: str) -> dict[str, Any]:
    """`{'train/acc_0': 0.5, 'eval/per_position_acc': [0.7, nan]}` -> {key: value as read}.

    Reads Python reprs and JSON alike without evaluating anything. Fast path: a repr of str keys and finite
    numbers is JSON once its quotes are swapped (values then are whatever JSON holds; callers keep the
    numbers). Otherwise a regex scan takes quoted keys, numbers (bare nan/inf too) and flat lists of numbers
    (an item that is not a number is NaN), and skips the rest.
    """
    try:
        parsed = json.loads(text.replace("'", '"'))
    except (ValueError, RecursionError):  # RecursionError: absurdly nested brackets
        parsed = None
    return parsed if isinstance(parsed, dict) else _scan_step_dict(text)


def _scan_step_dict(text: str) -> dict[str, Any]:
    items: dict[str, Any] = {}
    for single, double, raw in _DICT_ITEM.findall(text):
        if raw.startswith("["):
            value: float | list[float] | None = [_number(item, math.nan) for item in raw[1:-1].split(",") if item.strip()]
        else:
            value = _number(raw, None)
        if value is not None:
            items[single or double] = value
    return items


@overload
def _number(text: str, default: float) -> float: ...


@overload
def _number(text: str, default: None) -> float | None: ...


def _number(text: str, default: float | None) -> float | None:
    try:
        return float(text)
    except ValueError:
        return default


class SpecForgeLogSource(LineLogSource):
    """A SpecForge training console log -> records.

    Current SpecForge prints `step S: {...}` for each train log interval and each evaluation; the keys say
    the split, and each line becomes its records at once. Older logs: mode of the "Eval - Step S [..]" lines
    (SpecForge printed that prefix for train and eval alike): eval when a tqdm "Evaluating Epoch" line came
    since the previous block, or when a train block of step S was already seen; train otherwise.
    Epoch-summary lines ("Train Epoch [E/N]") get step = E * steps per epoch when a tqdm "Training Epoch e:
    ... n/M" line told M, else step = E. An "lr=<x>" on any other line (e.g. "Restored optimizer/scheduler
    state: ... lr=...") goes into the next train block.
    """

    def __init__(self, path: Path):
        super().__init__(path)
        self.block: tuple[str, int] | None = None  # (split, step) of the block being read
        self.block_keys: set[tuple[str, int]] = set()  # (key, position) values already in the block
        self.last_train_step: int | None = None
        self.eval_marker = False
        self.epoch: int | None = None
        self.steps_per_epoch: int | None = None
        self.pending_lr: float | None = None

    def _line(self, line: str) -> list[dict[str, Any]]:
        if ": {" in line:
            match = _STEP_DICT_LINE.search(line)
            if match:
                return self._step_dict(int(match.group(1)), match.group(2), self._asctime(line))
        if "position" in line:
            return self._position_line(line)
        if line.strip():
            self._side_info(line)
        return []

    @staticmethod
    def _step_dict(step: int, text: str, when: float | None) -> list[dict[str, Any]]:
        """One `step S: {...}` line is whole (split, step) records: handed out at once, not grouped."""
        parsed = parse_step_dict(text)
        values = list(parsed.values())
        records = []
        for split, scalars, lists, extras in _layout_of(tuple(parsed), values).fields:
            record: dict[str, Any] = {"split": split, "step": step}
            for name, pos in scalars:
                value = values[pos]
                if type(value) is float or (type(value) is int and abs(value) < 1 << 53):  # not bool, str, None...
                    record[name] = value
            for name, slots in lists:
                record[name] = [_as_float(values[pos] if i < 0 else values[pos][i]) if pos >= 0 else math.nan for pos, i in slots]
            kept = {tag: float(values[pos]) for tag, pos in extras if type(values[pos]) is float or type(values[pos]) is int}
            if kept:
                record["extras"] = kept
            if when is not None:
                record["time"] = when
            if len(record) > 2:
                records.append(finished_record(record))
        return records

    def _position_line(self, line: str) -> list[dict[str, Any]]:
        when = self._asctime(line)
        match = _STEP_LINE.search(line)
        if match:
            step, bracket, index, name, value = match.groups()
            return self._value(None if bracket else "val", int(step), name, int(index), value, when)
        match = _STEP_BRACKET_LINE.search(line)
        if match:
            step, index, name, value = match.groups()
            return self._value("val", int(step), name, int(index), value, when)
        match = _EPOCH_LINE.search(line)
        if match:
            mode, epoch, index, name, value = match.groups()
            epoch_done = int(epoch)
            step = epoch_done * self.steps_per_epoch if self.steps_per_epoch else epoch_done
            split = "train" if mode == "Train" else "val"
            return self._value(split, step, name, int(index), value, when, epoch=epoch_done - 1)
        self._side_info(line)
        return []

    def _side_info(self, line: str) -> None:
        tqdm = _TQDM_LINE.search(line)
        if tqdm:
            kind, epoch, _, total = tqdm.groups()
            if kind == "Evaluating":
                self.eval_marker = True
            else:
                self.epoch = int(epoch)
                if total and int(total) > 0:
                    self.steps_per_epoch = int(total)
        lr = _LR.search(line)
        if lr and not tqdm:
            self.pending_lr = float(lr.group(1))

    def _value(self, split: str | None, step: int, name: str, index: int, text: str, when: float | None, epoch: int | None = None) -> list[dict[str, Any]]:
        """One per-position value; split None means an "Eval - Step S [..]" line whose mode must be inferred."""
        key = _KEYS[name.lower()]
        block = self.block
        continues = block is not None and block[1] == step and (key, index) not in self.block_keys and split in (None, block[0])
        if block is None or not continues:
            if split is None:
                split = "val" if self.eval_marker or step == self.last_train_step else "train"
            self.eval_marker = False
            block = (split, step)
            self.block, self.block_keys = block, set()
            if split == "train":
                self.last_train_step = step
        self.block_keys.add((key, index))
        extra = {"time": when, "epoch": epoch if epoch is not None else self.epoch}
        if block[0] == "train" and self.pending_lr is not None:
            extra["lr"], self.pending_lr = self.pending_lr, None
        return self.assembler.add(block[0], step, key, index, float(text), **extra)


def is_specforge_line(line: str) -> bool:
    """Whether a line is one SpecForge prints: a `step S: {...}` dict or a per-position value."""
    if ": {" in line and _STEP_DICT_LINE.search(line):
        return True
    return "position" in line and any(p.search(line) for p in (_STEP_LINE, _STEP_BRACKET_LINE, _EPOCH_LINE))


class _Layout(NamedTuple):
    """Where each record field sits in a step dict: per split, scalar fields (name, item position) and list
    fields (name, per TTT position (item position, list index, or -1 for a scalar item; (-1, -1) when absent)).
    `shape` holds (item position, length) of the list items the layout was worked out for."""

    shape: tuple[tuple[int, int], ...]
    fields: tuple[tuple[str, tuple[tuple[str, int], ...], tuple[tuple[str, tuple[tuple[int, int], ...]], ...], tuple[tuple[str, int], ...]], ...]

    def fits(self, values: list[Any]) -> bool:
        return all(type(values[pos]) is list and len(values[pos]) == length for pos, length in self.shape)


_LAYOUTS: dict[tuple[str, ...], _Layout] = {}


def _layout_of(keys: tuple[str, ...], values: list[Any]) -> _Layout:
    """SpecForge logs the same keys every time, so a layout is worked out once per kind of line and reused."""
    layout = _LAYOUTS.get(keys)
    if layout is None or not layout.fits(values):
        if len(_LAYOUTS) >= 256:
            _LAYOUTS.clear()
        shape = tuple((pos, len(value)) for pos, value in enumerate(values) if type(value) is list)
        layout = _LAYOUTS[keys] = _layout(keys, shape)
    return layout


@functools.lru_cache(maxsize=256)
def _layout(keys: tuple[str, ...], shape: tuple[tuple[int, int], ...]) -> _Layout:
    """A list value stands for the tracker's "<key>/<i>" scalars."""
    lengths = dict(shape)
    scalars: dict[str, dict[str, int]] = {}
    lists: dict[str, dict[str, dict[int, tuple[int, int]]]] = {}
    extras: dict[str, dict[str, int]] = {}  # scalar items with no key in the schema: kept under "extras"
    for pos, key in enumerate(keys):
        tags = [(f"{key}/{i}", i) for i in range(lengths[pos])] if pos in lengths else [(key, -1)]
        for tag, item in tags:
            mapped = map_tag(tag)
            if mapped is None:
                kept = extras.setdefault(extra_split(tag), {})
                if item < 0 and len(kept) < EXTRAS_MAX:
                    kept[tag] = pos
                continue
            split, name, index = mapped
            if index is None:
                scalars.setdefault(split, {})[name] = pos
            else:
                lists.setdefault(split, {}).setdefault(name, {})[index] = (pos, item)
    fields = []
    for split in dict.fromkeys([*scalars, *lists, *extras]):
        list_fields = tuple((name, tuple(slots.get(i, (-1, -1)) for i in range(max(slots) + 1))) for name, slots in lists.get(split, {}).items())
        fields.append((split, tuple(scalars.get(split, {}).items()), list_fields, tuple(extras.get(split, {}).items())))
    return _Layout(shape, tuple(fields))


def _as_float(value: Any) -> float:
    if type(value) is float:
        return value
    try:
        return float(value) if type(value) is int else math.nan
    except OverflowError:
        return math.nan
