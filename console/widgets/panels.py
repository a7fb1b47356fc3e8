"""Small read-only panels of the Dashboard (latest metrics of the selected job, disks, recent actions) and the footer
every screen shows (it wraps onto a second row, then abbreviates, so no key is lost on a narrow terminal)."""

from __future__ import annotations

from collections import defaultdict
from itertools import groupby
from typing import Any, Iterator

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import HorizontalGroup
from textual.widgets import Footer, Static
from textual.widgets._footer import FooterKey, FooterLabel, KeyGroup

from console.state import ConsoleState, disk_low, used_share
from backend.safetext import visible
from console.format import clock_time, count, epoch_text, inert_text, number, percent, segmented_bar, size_bytes


@inert_text
def latest_metrics_text(state: ConsoleState, job: str | None) -> Text:
    if not job:
        return Text("no jobs yet: n starts a training run" if not state.jobs else "no job selected (] or [ picks one)", style="dim")
    info = state.jobs.get(job)
    metrics = state.metrics.get(job)
    text = Text()
    text.append(visible(job), style="bold")
    if info:
        text.append(f" ({visible(info.state)})")
        reason = state.exit_reasons.get(job) if info.exit_code not in (None, 0) else None
        if reason:
            text.append(f"\nexit {info.exit_code}: {visible(reason)}", style="bold red")
    if not metrics or not metrics.latest:
        text.append("\nno metrics yet", style="dim")
        return text
    train, val, latest = metrics.latest_train, metrics.latest_val, metrics.latest
    text.append(f"\nstep {visible(latest.get('step', '-'))}  epoch {epoch_text(latest.get('epoch'))}")
    text.append(f"\ntrain loss {number(train.get('loss'))}   val loss {number(val.get('loss'))}")
    gap = _gap(train.get("loss"), val.get("loss"))
    if gap is not None:
        text.append(f"   gap {gap:+.3g}", style="yellow" if gap > 0.5 else "")
    acc = val.get("acc") or train.get("acc")
    if isinstance(acc, list) and acc:
        shown = "  ".join(f"@{i} {percent(a)}" for i, a in enumerate(acc[:4]))
        text.append(f"\nacc {shown}")
    lr = train.get("lr", latest.get("lr"))
    text.append(f"\nlr {number(lr, 3)}   grad norm {number(train.get('grad_norm'), 3)}   weight norm {number(train.get('weight_norm'), 4)}")
    tokens = train.get("tokens")
    step_time = train.get("step_time")
    if tokens is not None or step_time is not None:
        text.append(f"\ntokens {count(tokens)}   step time {number(step_time, 3)}s")
    speed = [
        f"{count(train['tokens_per_s'])} tok/s" if train.get("tokens_per_s") is not None else "",
        f"MFU {percent(train['mfu'])}" if train.get("mfu") is not None else "",
        f"peak {number(train['peak_mem_gib'], 3)} GiB" if train.get("peak_mem_gib") is not None else "",
    ]
    if any(speed):
        text.append("\n" + "   ".join(part for part in speed if part))
    hidden = metrics.nonfinite_count("train.loss", metrics.train_loss) + metrics.nonfinite_count("val.loss", metrics.val_loss)
    if hidden:
        text.append(f"\n{hidden} NaN/inf loss values in the run (red x on Training)", style="bold red")
    extras = extras_text(train, val)
    if extras:
        text.append("\n" + extras)
    return text


EXTRAS_FIRST = ("simulated_acc_len", "acceptance_rate", "acc")  # SpecForge's own accept-length estimate and means first
EXTRAS_SHOWN = 4


def extras_text(train: dict[str, Any], val: dict[str, Any]) -> str:
    """A watched run's values with no key in the record schema (kept as its tracker named them), the telling ones first."""
    values: dict[str, Any] = {}
    for record in (val, train):
        extras = record.get("extras")
        if isinstance(extras, dict):
            values.update({str(k): v for k, v in extras.items() if isinstance(v, (int, float)) and not isinstance(v, bool)})
    if not values:
        return ""
    rank = lambda tag: next((i for i, name in enumerate(EXTRAS_FIRST) if tag.rsplit("/", 1)[-1] == name), len(EXTRAS_FIRST))
    ordered = sorted(values, key=lambda tag: (rank(tag), tag))
    shown = "   ".join(f"{visible(tag)} {number(values[tag], 4)}" for tag in ordered[:EXTRAS_SHOWN])
    more = len(ordered) - EXTRAS_SHOWN
    return f"also logged: {shown}" + (f"   (+{more} more)" if more > 0 else "")


def _gap(train: object, val: object) -> float | None:
    if isinstance(train, (int, float)) and isinstance(val, (int, float)):
        return float(val) - float(train)
    return None


@inert_text
def disks_text(state: ConsoleState) -> Text:
    if not state.disks:
        return Text("no disk report yet", style="dim")
    text = Text()
    for i, disk in enumerate(state.disks):
        if i:
            text.append("\n")
        style = "red" if disk_low(disk) else "yellow" if used_share(disk) > 0.75 else "green"
        text.append(f"{visible(disk.label):<9} ", style="bold")
        text.append_text(segmented_bar([(disk.used_bytes, style)], disk.total_bytes, 14))
        text.append(f" {size_bytes(disk.free_bytes)} free / {size_bytes(disk.total_bytes)}")
        text.append(f"\n          {visible(disk.path)}", style="dim")
        if disk.dir_bytes is not None:
            text.append(f" holds {size_bytes(disk.dir_bytes)}", style="dim")
    return text


@inert_text
def actions_text(state: ConsoleState, limit: int = 8) -> Text:
    if not state.actions:
        return Text("no actions yet", style="dim")
    text = Text()
    for i, (when, line) in enumerate(list(state.actions)[-limit:]):
        if i:
            text.append("\n")
        text.append(f"{clock_time(when)} ", style="dim")
        text.append(visible(line))
    return text


class LatestMetrics(Static):
    def show_state(self, state: ConsoleState, job: str | None) -> None:
        self.update(latest_metrics_text(state, job))


class DiskPanel(Static):
    def show_state(self, state: ConsoleState) -> None:
        self.update(disks_text(state))


class ActionLog(Static):
    def show_state(self, state: ConsoleState) -> None:
        self.update(actions_text(state))


FOOTER_ROWS_MAX = 2
PALETTE_WIDTH = 15  # " ^p palette " and its border, docked right
SHORT_LABELS = {
    "Log step": "log x",
    "Log y": "log y",
    "Live stream": "Stream",
    "Prev/next job": "Job",
    "Zoom/pan": "Zoom",
    "Screens": "Scr",
    "Workers": "Wkrs",
    "Follow": "Follow",
}


class ConsoleFooter(Footer):
    """The stock footer's keys, packed into rows as wide as the terminal (at most FOOTER_ROWS_MAX); when they do not fit,
    the labels get shorter (the app's `short` labels, SHORT_LABELS): every key stays on screen at 100 columns. The full
    description of each key is its tooltip and its command palette entry."""

    DEFAULT_CSS = """
    ConsoleFooter {
        layout: vertical;
        height: auto;
        max-height: 2;
        .footer-row { width: 1fr; height: 1; }
    }
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._packed_for = 0
        self._composed: tuple | None = None  # what the keys on screen were built from (see _signature)

    def _signature(self) -> tuple:
        """Everything the footer's keys are built from: the width, each shown binding's key, label, state and tooltip."""
        bindings = tuple(
            (binding.key, binding.action, binding.description, enabled, tooltip)
            for _, binding, enabled, tooltip in self.screen.active_bindings.values()
            if binding.show
        )
        return self.size.width or self.app.size.width, bindings, self.compact, self.show_command_palette

    async def recompose(self) -> None:
        """Rebuild the keys only when what they show changed.

        Textual asks on every focus move, screen switch and refresh_bindings(); rebuilding ~30 key widgets and restyling
        them each time cost more CPU than the rest of a redraw (a quarter of a Pilot test's time).
        """
        if not self.is_attached or self._pruning:
            return
        signature = self._signature()
        if signature == self._composed and self.children:
            return
        await super().recompose()
        self._composed = signature

    def _items(self) -> list[tuple[Any, list[tuple[Binding, bool, str]]]]:
        """(group or None, bindings) per footer item, in the stock footer's order and grouping."""
        by_action: defaultdict[str, list[tuple[Binding, bool, str]]] = defaultdict(list)
        for _, binding, enabled, tooltip in self.screen.active_bindings.values():
            if binding.show:
                by_action[binding.action].append((binding, enabled, tooltip))
        items: list[tuple[Any, list[tuple[Binding, bool, str]]]] = []
        for group, members in groupby(by_action.values(), lambda multi: multi[0][0].group):
            multis = list(members)
            if group is not None and len(multis) > 1:
                items.append((group, [m[0] for m in multis]))
            else:
                items.extend((None, [m[0]]) for m in multis)
        return items

    def _label(self, binding: Binding, short: bool) -> str:
        if not short:
            return binding.description
        spec = getattr(self.app, "footer_short_label", None)
        label = spec(binding.action) if spec else None
        return label or SHORT_LABELS.get(binding.description, binding.description)

    def _width(self, item: tuple[Any, list[tuple[Binding, bool, str]]], short: bool) -> int:
        group, bindings = item
        keys = sum(len(self.app.get_key_display(b)) for b, _, _ in bindings)
        if group is not None:
            label = SHORT_LABELS.get(group.description, group.description) if short else group.description
            return 1 + keys + 1 + len(label) + 1  # padding, keys, margin, label, its margin
        return 1 + keys + 1 + len(self._label(bindings[0][0], short)) + 1  # " key " then "label "

    def _rows(self, width: int) -> tuple[list[list[Any]], bool]:
        items = self._items()
        for short in (False, True):
            rows: list[list[Any]] = [[]]
            used = 0
            for item in items:
                room = width - PALETTE_WIDTH  # the docked palette key narrows every row
                need = self._width(item, short)
                if rows[-1] and used + need > room:
                    rows.append([])
                    used = 0
                rows[-1].append(item)
                used += need
            if len(rows) <= FOOTER_ROWS_MAX:
                return rows, short
        return rows, True

    def compose(self) -> ComposeResult:
        if not self._bindings_ready:
            return
        width = self.size.width or self.app.size.width
        self._packed_for = width
        rows, short = self._rows(width)
        for row in rows:
            with HorizontalGroup(classes="footer-row"):
                yield from self._row_widgets(row, short)
        if self.show_command_palette and self.app.ENABLE_COMMAND_PALETTE:
            found = self.screen.active_bindings.get(self.app.COMMAND_PALETTE_BINDING)
            if found is not None:
                _, binding, enabled, tooltip = found
                yield FooterKey(
                    binding.key,
                    self.app.get_key_display(binding),
                    binding.description,
                    binding.action,
                    classes="-command-palette",
                    disabled=not enabled,
                    tooltip=binding.tooltip or binding.description,
                )

    def _row_widgets(self, row: list[Any], short: bool) -> Iterator[Any]:
        for group, bindings in row:
            if group is not None:
                with KeyGroup(classes="-compact" if group.compact else ""):
                    for binding, enabled, tooltip in bindings:
                        yield FooterKey(
                            binding.key,
                            self.app.get_key_display(binding),
                            "",
                            binding.action,
                            disabled=not enabled,
                            tooltip=tooltip or binding.description,
                            classes="-grouped",
                        ).data_bind(compact=Footer.compact)
                yield FooterLabel(SHORT_LABELS.get(group.description, group.description) if short else group.description)
            else:
                binding, enabled, tooltip = bindings[0]
                yield FooterKey(
                    binding.key,
                    self.app.get_key_display(binding),
                    self._label(binding, short),
                    binding.action,
                    disabled=not enabled,
                    tooltip=tooltip or binding.description,
                ).data_bind(compact=Footer.compact)

    def on_resize(self) -> None:
        if self._bindings_ready and self.size.width != self._packed_for:
            self.call_after_refresh(self.recompose)
