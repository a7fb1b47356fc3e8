"""Confirmation modals for guarded actions: stop and stop-and-bench (show the plan), adopt (PID typed), watch a run."""
from __future__ import annotations

import re

from typing import Any

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Button, Input, Static

from backend.protocol import GpuHolder
from console.widgets.format import mib


class FormModal(ModalScreen[dict | None]):
    """A modal with input fields: enter or the #confirm button calls the subclass's submit(); any other button or esc dismisses None."""

    def on_input_submitted(self, event: Input.Submitted) -> None:
        self.submit()

    def on_button_pressed(self, event: Button.Pressed) -> None:
        if event.button.id == "confirm":
            self.submit()
        else:
            self.dismiss(None)

    def action_cancel(self) -> None:
        self.dismiss(None)


def stop_plan_text(plan: dict[str, Any], grace: float) -> Text:
    """The stop plan as the operator reads it: who gets signalled, who is left alone, checkpoint or not."""
    text = Text()
    will = plan.get("will_signal") or []
    text.append(f"These {len(will)} PIDs get SIGTERM, then SIGKILL if still alive after {grace:g}s:\n", style="bold")
    if not will:
        text.append("  (none: nothing of this job is running)\n", style="dim")
    for entry in will:
        text.append(f"  {entry.get('pid', '?'):>7}", style="bold red")
        text.append(f"  {entry.get('role', ''):<10} {entry.get('job', '') or ''}  {str(entry.get('cmdline', ''))[:60]}\n")
    stale = plan.get("stale") or []
    if stale:
        text.append("Stale records, NOT signalled (the PID is gone or belongs to another process now):\n", style="bold")
        for entry in stale:
            text.append(f"  {entry.get('pid', '?'):>7}  {entry.get('job', '')}  {entry.get('reason', '')}\n", style="dim")
    foreign = plan.get("foreign_gpu_holders") or []
    text.append("Foreign GPU holders, left alone:\n", style="bold")
    if not foreign:
        text.append("  (none)\n", style="dim")
    for entry in foreign:
        text.append(f"  {entry.get('pid', '?'):>7}", style="yellow")
        text.append(f"  {entry.get('user', '')}  {str(entry.get('cmdline', ''))[:50]}  {mib(entry.get('used_memory_mib'))}\n")
    if plan.get("checkpoint_first"):
        text.append("Checkpoint first: YES, the trainer writes a checkpoint on SIGTERM before it exits.", style="bold green")
    else:
        text.append("Checkpoint first: no (no training job in this stop).", style="bold")
    return text


class StopModal(ModalScreen[bool]):
    """Shows exactly what stop_job will do; returns True only when the operator confirms."""

    BINDINGS = [
        Binding("escape", "cancel", "Cancel"),
        Binding("y", "confirm", "Stop these PIDs"),
    ]

    def __init__(self, job: str, plan: dict[str, Any], grace: float):
        super().__init__()
        self.job = job
        self.plan = plan
        self.grace = grace

    @property
    def pids(self) -> list[int]:
        return [entry.get("pid") for entry in self.plan.get("will_signal") or []]

    def compose(self) -> ComposeResult:
        with Vertical(id="dialog", classes="modal-dialog"):
            yield Static(f"Stop job {self.job}?", classes="modal-title")
            with VerticalScroll(id="stop-plan-scroll"):
                yield Static(stop_plan_text(self.plan, self.grace), id="stop-plan")
            with Horizontal(classes="modal-buttons"):
                yield Button(f"Stop {len(self.pids)} PIDs (y)", id="confirm", variant="error", disabled=not self.pids)
                yield Button("Cancel (esc)", id="cancel", variant="primary")

    def on_mount(self) -> None:
        self.query_one("#cancel", Button).focus()

    def on_button_pressed(self, event: Button.Pressed) -> None:
        self.dismiss(event.button.id == "confirm")

    def action_cancel(self) -> None:
        self.dismiss(False)

    def action_confirm(self) -> None:
        if self.pids:
            self.dismiss(True)


class AdoptModal(FormModal):
    """Adopt a foreign process as a job: the PID must be typed twice; returns adopt_job params or None."""

    BINDINGS = [Binding("escape", "cancel", "Cancel")]

    def __init__(self, candidates: list[GpuHolder], preset_pid: int | None = None):
        super().__init__()
        self.candidates = candidates
        self.preset_pid = preset_pid

    def compose(self) -> ComposeResult:
        with Vertical(id="dialog", classes="modal-dialog"):
            yield Static("Adopt a process as a job (the console may then stop it)", classes="modal-title")
            yield Static(self._candidates_text(), id="adopt-candidates")
            yield Input(value=str(self.preset_pid) if self.preset_pid else "", placeholder="PID to adopt", id="adopt-pid")
            yield Input(placeholder="job name (default adopted-<pid>)", id="adopt-name")
            yield Input(placeholder="type the PID again to confirm", id="adopt-confirm")
            yield Static("", id="adopt-error")
            with Horizontal(classes="modal-buttons"):
                yield Button("Adopt (enter)", id="confirm", variant="warning")
                yield Button("Cancel (esc)", id="cancel", variant="primary")

    def on_mount(self) -> None:
        self.query_one("#adopt-confirm" if self.preset_pid else "#adopt-pid", Input).focus()

    def _candidates_text(self) -> Text:
        text = Text("Foreign GPU holders:\n", style="bold")
        if not self.candidates:
            text.append("  (none listed; any PID on the host can be typed)", style="dim")
        for holder in self.candidates:
            text.append(f"  {holder.pid:>7}  {holder.user or '?'}  {holder.cmdline[:50]}  {mib(holder.used_memory_mib)}\n")
        return text

    def submit(self) -> None:
        raw_pid = self.query_one("#adopt-pid", Input).value.strip()
        confirm = self.query_one("#adopt-confirm", Input).value.strip()
        name = self.query_one("#adopt-name", Input).value.strip()
        error = self.query_one("#adopt-error", Static)
        if not raw_pid.isdigit() or int(raw_pid) <= 0:
            error.update(Text(f"'{raw_pid}' is not a PID; nothing adopted.", style="bold red"))
            return
        if confirm != raw_pid:
            shown = confirm or "(nothing)"
            error.update(Text(f"Typed {shown}, but the PID is {raw_pid}: they must match. Nothing adopted.", style="bold red"))
            return
        pid = int(raw_pid)
        self.dismiss({"pid": pid, "name": name or f"adopted-{pid}", "confirm_pid": int(confirm)})


def bench_plan_text(job: str, plan: dict[str, Any], checkpoints: list[dict[str, Any]], job_running: bool,
                    engine: str, engine_source: str, grace: float, levels: str, prompts: int, argv: list[str]) -> Text:
    """The stop-and-bench plan, stage by stage: what gets signalled, which checkpoint, which engine, what is measured."""
    text = Text()
    text.append("1. Stop ", style="bold")
    if job_running:
        text.append(f"{job}: graceful and checkpoint-aware.\n")
        text.append_text(stop_plan_text(plan, grace))
        text.append("\n")
    else:
        text.append(f"{job} is not running: nothing is signalled; its last checkpoint is used.\n")
    text.append("2. Release: ", style="bold")
    text.append("wait until no process of our jobs holds GPU memory (foreign holders are left untouched).\n")
    latest = next((c for c in reversed(checkpoints) if c.get("latest")), checkpoints[-1] if checkpoints else None)
    text.append("3. Checkpoint to preflight: ", style="bold")
    if job_running and plan.get("checkpoint_first"):
        text.append("the one the trainer writes at the stop (the new `latest`)")
        text.append(f"; latest now: {latest['path']}\n" if latest else "; none written yet\n")
    elif latest:
        text.append(f"{latest['path']}\n")
    else:
        text.append("NONE: this job has no complete checkpoint, so the chain would stop here.\n", style="bold red")
    text.append("4. Preflight: ", style="bold")
    text.append("check the checkpoint against the target config (the failures SGLang does not report)\n")
    text.append("5. Launch ", style="bold")
    text.append(f"engine {engine}", style="bold cyan")
    text.append(f" ({engine_source}), wait until ready\n")
    text.append("6. Canary: ", style="bold")
    text.append("greedy requests; accept length vs τ̂ from validation accuracy → green / red with likely causes\n")
    text.append("7. Benchmark: ", style="bold")
    text.append(f"concurrency {levels}, {prompts} prompts; the result is saved with the training run\n")
    text.append("runs on the host as: ", style="dim")
    text.append(" ".join(argv), style="dim")
    return text


class StopAndBenchModal(ModalScreen[bool]):
    """Shows the whole stop-and-bench plan; returns True only when the operator confirms."""

    BINDINGS = [
        Binding("escape", "cancel", "Cancel"),
        Binding("y", "confirm", "Start the chain"),
    ]

    def __init__(self, job: str, plan_text: Text, can_start: bool):
        super().__init__()
        self.job = job
        self.plan_text = plan_text
        self.can_start = can_start

    def compose(self) -> ComposeResult:
        with Vertical(id="dialog", classes="modal-dialog"):
            yield Static(f"Stop & bench {self.job}?", classes="modal-title")
            with VerticalScroll(id="bench-plan-scroll"):
                yield Static(self.plan_text, id="bench-plan")
            with Horizontal(classes="modal-buttons"):
                yield Button("Stop & bench (y)", id="confirm", variant="error", disabled=not self.can_start)
                yield Button("Cancel (esc)", id="cancel", variant="primary")

    def on_mount(self) -> None:
        self.query_one("#cancel", Button).focus()

    def on_button_pressed(self, event: Button.Pressed) -> None:
        self.dismiss(event.button.id == "confirm" and self.can_start)

    def action_cancel(self) -> None:
        self.dismiss(False)

    def action_confirm(self) -> None:
        if self.can_start:
            self.dismiss(True)


class WatchModal(FormModal):
    """Watch a run this tool did not start (TensorBoard dir/event file or SpecForge console log), read-only."""

    BINDINGS = [Binding("escape", "cancel", "Cancel")]

    def compose(self) -> ComposeResult:
        with Vertical(id="dialog", classes="modal-dialog"):
            yield Static("Watch an external run (read-only: nothing is started, stopped or written there)", classes="modal-title")
            yield Static("A TensorBoard directory or event file, or a SpecForge console log (stdout+stderr saved to a file), "
                         "as a path on the host.", id="watch-help")
            yield Input(placeholder="path on the host", id="watch-path")
            yield Input(placeholder="name (shown as ext:<name>)", id="watch-name")
            yield Static("", id="watch-error")
            with Horizontal(classes="modal-buttons"):
                yield Button("Watch (enter)", id="confirm", variant="primary")
                yield Button("Cancel (esc)", id="cancel")

    def on_mount(self) -> None:
        self.query_one("#watch-path", Input).focus()

    def submit(self) -> None:
        path = self.query_one("#watch-path", Input).value.strip()
        name = self.query_one("#watch-name", Input).value.strip() or _default_watch_name(path)
        error = self.query_one("#watch-error", Static)
        if not path:
            error.update(Text("Give the path to watch; nothing is watched yet.", style="bold red"))
            return
        if not WATCH_NAME.match(name):
            error.update(Text(f"'{name}' is not a usable name (letters, digits, '.', '_', '-'); nothing is watched yet.", style="bold red"))
            return
        self.dismiss({"name": name, "path": path})


WATCH_NAME = re.compile(r"^[A-Za-z0-9._-]{1,56}$")


def _default_watch_name(path: str) -> str:
    parts = [p for p in path.replace("\\", "/").split("/") if p and p not in (".", "..", "runs", "tensorboard")]
    name = re.sub(r"[^A-Za-z0-9._-]", "-", parts[-1] if parts else "run")
    return name[:56] or "run"
