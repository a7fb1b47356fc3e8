"""Tracker tag names -> record keys: "eval/per_position_acc/3" -> ("val", "acc", 3), and the split of tags with no key."""

from __future__ import annotations

import functools
import re

_SPLIT_PREFIXES = {"train": "train", "eval": "val", "val": "val", "valid": "val", "validation": "val", "test": "val"}
# "acc_3", older "epochacc_3" / "step_ploss_1", and "per_position_acc_3"
_INDEXED_NAME = re.compile(r"^(?:step_|epoch_?|per_position_)?(ploss|acc|acceptance_rate)_(\d+)$")
# list metrics a tracker expands to "<name>/<i>" (SpecForge: eval/per_position_acc/<i>)
_LIST_NAMES = {
    "acc": "acc",
    "acces": "acc",
    "per_position_acc": "acc",
    "ploss": "ploss",
    "plosses": "ploss",
    "per_position_ploss": "ploss",
    "acceptance_rate": "acceptance_rate",
    "acceptance_rates": "acceptance_rate",
    "per_position_acceptance_rate": "acceptance_rate",
}
_SCALAR_NAMES = {
    "lr": "lr",
    "learning_rate": "lr",
    "grad_norm": "grad_norm",
    "loss": "loss",
    "ploss": "loss",
    "avg_loss": "loss",
    "weight_norm": "weight_norm",
    "epoch": "epoch",
    "tokens": "tokens",
    "step_time": "step_time",
    "perf/optimizer_step_time_s": "step_time",
}


@functools.lru_cache(maxsize=4096)
def map_tag(tag: str) -> tuple[str, str, int | None] | None:
    """SpecForge tag -> (split, key, index): "eval/per_position_acc/3" -> ("val", "acc", 3), "train/lr" -> lr.

    Tags without a mode prefix count as train; old names (eval/acc_i, epochacc_i, step_ploss_i) map like the
    new ones. Tags with no home in the record schema (train/acc and train/acceptance_rate, which are means over
    positions; eval/avg_acc, eval/simulated_acc_len, most perf/*) and unknown tags -> None.
    """
    parts = tag.strip().lower().split("/")
    index = int(parts.pop()) if len(parts) > 1 and parts[-1].isdigit() else None
    split, name = _split_and_name(parts)
    if index is not None:
        key = _LIST_NAMES.get(name)
        return (split, key, index) if key else None
    match = _INDEXED_NAME.match(name)
    if match:
        return split, match.group(1), int(match.group(2))
    key = _SCALAR_NAMES.get(name)
    return (split, key, None) if key else None


EXTRAS_MAX = 64  # tags with no home in the schema kept per record, under "extras" as the tracker named them


def extra_split(tag: str) -> str:
    """The split of a tag the schema has no key for (eval/simulated_acc_len -> val): kept under the record's "extras"."""
    return _split_and_name(tag.strip().lower().split("/"))[0]


def _split_and_name(parts: list[str]) -> tuple[str, str]:
    """The first mode component ("train", "eval", ...) gives the split; what follows it is the metric name."""
    for i, part in enumerate(parts[:-1]):
        split = _SPLIT_PREFIXES.get(part)
        if split:
            return split, "/".join(parts[i + 1 :])
    return "train", "/".join(parts)
