"""Small read-only panels of the Dashboard: latest metrics of the selected job, disks, recent actions."""
from __future__ import annotations

from rich.text import Text
from textual.widgets import Static

from console.state import ConsoleState
from console.widgets.format import clock_time, count, number, percent, segmented_bar, size_bytes


def latest_metrics_text(state: ConsoleState, job: str | None) -> Text:
    if not job:
        return Text("no job selected", style="dim")
    info = state.jobs.get(job)
    metrics = state.metrics.get(job)
    text = Text()
    text.append(job, style="bold")
    if info:
        text.append(f" ({info.state})")
    if not metrics or not metrics.latest:
        text.append("\nno metrics yet", style="dim")
        return text
    train, val, latest = metrics.latest_train, metrics.latest_val, metrics.latest
    text.append(f"\nstep {latest.get('step', '-')}  epoch {latest.get('epoch', '-')}")
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
    speed = [f"{count(train['tokens_per_s'])} tok/s" if train.get("tokens_per_s") is not None else "",
             f"MFU {percent(train['mfu'])}" if train.get("mfu") is not None else "",
             f"peak {number(train['peak_mem_gib'], 3)} GiB" if train.get("peak_mem_gib") is not None else ""]
    if any(speed):
        text.append("\n" + "   ".join(part for part in speed if part))
    hidden = metrics.nonfinite_count("train.loss", metrics.train_loss) + metrics.nonfinite_count("val.loss", metrics.val_loss)
    if hidden:
        text.append(f"\n{hidden} NaN/inf loss values in the run (red x on Training)", style="bold red")
    return text


def _gap(train: object, val: object) -> float | None:
    if isinstance(train, (int, float)) and isinstance(val, (int, float)):
        return float(val) - float(train)
    return None


def disks_text(state: ConsoleState) -> Text:
    if not state.disks:
        return Text("no disk report yet", style="dim")
    text = Text()
    for i, disk in enumerate(state.disks):
        if i:
            text.append("\n")
        share = disk.used_bytes / disk.total_bytes if disk.total_bytes else 0.0
        style = "red" if share > 0.9 else "yellow" if share > 0.75 else "green"
        text.append(f"{disk.label:<9} ", style="bold")
        text.append_text(segmented_bar([(disk.used_bytes, style)], disk.total_bytes, 14))
        text.append(f" {size_bytes(disk.free_bytes)} free / {size_bytes(disk.total_bytes)}")
        text.append(f"\n          {disk.path}", style="dim")
        if disk.dir_bytes is not None:
            text.append(f" holds {size_bytes(disk.dir_bytes)}", style="dim")
    return text


def actions_text(state: ConsoleState, limit: int = 8) -> Text:
    if not state.actions:
        return Text("no actions yet", style="dim")
    text = Text()
    for i, (when, line) in enumerate(list(state.actions)[-limit:]):
        if i:
            text.append("\n")
        text.append(f"{clock_time(when)} ", style="dim")
        text.append(line)
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
