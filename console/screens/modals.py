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
from backend.safetext import visible
from console.format import cut_words, inert, inert_text, mib


class ConfirmModal(ModalScreen[bool]):
    """A yes/no modal: Cancel has the focus; y (or the confirm button) answers True, esc (or Cancel) False."""

    def on_mount(self) -> None:
        self.query_one("#cancel", Button).focus()

    def on_button_pressed(self, event: Button.Pressed) -> None:
        self.dismiss(event.button.id == "confirm")

    def action_cancel(self) -> None:
        self.dismiss(False)


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

    def submit(self) -> None:
        raise NotImplementedError


def pids_phrase(count: int) -> str:
    """'This PID gets' / 'These 3 PIDs get': the subject of the signal line, in agreement with the count."""
    if count == 0:
        return "No PID gets"
    return "This PID gets" if count == 1 else f"These {count} PIDs get"


def plural(count: int, noun: str) -> str:
    return f"{count} {noun}" + ("" if count == 1 else "s")


def training_phases(state: Any, jobs: list[str]) -> dict[str, bool | None]:
    """For each training job in `jobs`: True once it logged a metrics record (its trainer is in the step loop), False when
    its loaded metrics hold none (still in setup: building the target or data), None when the console does not know yet."""
    phases: dict[str, bool | None] = {}
    for name in jobs:
        info = state.jobs.get(name) if state is not None else None
        if info is None or info.kind != "train":
            continue
        metrics = state.metrics.get(name)
        if metrics is not None and metrics.records > 0:
            phases[name] = True
        elif metrics is not None and metrics.history_loaded and not metrics.loading:
            phases[name] = False
        else:
            phases[name] = None
    return phases


@inert_text
def checkpoint_line(plan: dict[str, Any], phases: dict[str, bool | None] | None) -> Text:
    """What a stop really does about checkpoints: the trainer writes one on SIGTERM only once it runs training steps."""
    if plan.get("checkpoint_note") and not plan.get("checkpoint_first"):
        return Text(f"Checkpoint first: NO. {visible(plan['checkpoint_note'])}.", style="bold yellow")
    if not plan.get("checkpoint_first"):
        return Text("Checkpoint first: no (no training job in this stop).", style="bold")
    in_setup = [name for name, started in (phases or {}).items() if started is False]
    if in_setup:
        return Text(
            f"Checkpoint first: NO. {visible(', '.join(in_setup))} has logged no training step yet: it is still setting up "
            "(building the target or its data), and a stop during setup ends it at once WITHOUT a checkpoint.",
            style="bold yellow",
        )
    if phases and all(phases.values()):
        return Text("Checkpoint first: YES, the trainer writes a checkpoint on SIGTERM before it exits.", style="bold green")
    return Text(
        "Checkpoint first: only if training steps have begun: the trainer then finishes the step and writes a "
        "checkpoint before it exits; a stop during setup (building the target or its data) writes none.",
        style="bold",
    )


@inert_text
def stop_plan_text(plan: dict[str, Any], grace: float, phases: dict[str, bool | None] | None = None) -> Text:
    """The stop plan as the operator reads it: who gets signalled, who is left alone, checkpoint or not.

    `phases` (training_phases) says which training jobs are past setup; without it the checkpoint line is conditional.
    """
    text = Text()
    will = plan.get("will_signal") or []
    text.append(f"{pids_phrase(len(will))} SIGTERM, then SIGKILL if still alive after {grace:g}s:\n", style="bold")
    if not will:
        text.append("  (none: nothing of this job is running)\n", style="dim")
    for entry in will:
        text.append(f"  {visible(entry.get('pid', '?')):>7}", style="bold red")
        text.append(
            f"  {visible(entry.get('role', '')):<10} {visible(entry.get('job', '') or '')}  {cut_words(visible(entry.get('cmdline', '')), CMDLINE_WIDTH)}\n"
        )
        if entry.get("state"):
            text.append(f"           this process is {visible(entry['state'])}\n", style="yellow")
    stale = plan.get("stale") or []
    if stale:
        text.append("Stale records, NOT signalled (the PID is gone or belongs to another process now):\n", style="bold")
        for entry in stale:
            text.append(f"  {visible(entry.get('pid', '?')):>7}  {visible(entry.get('job', ''))}  {visible(entry.get('reason', ''))}\n", style="dim")
    unreachable = plan.get("unreachable") or []
    if unreachable:
        text.append(
            "Nodes whose host is not connected, NOT signalled (the stop flag is reduced across every rank after each step, "
            "so their ranks stop after the same step as the others; if the host itself is gone, stop them when it is back):\n",
            style="bold yellow",
        )
        for entry in unreachable:
            text.append(
                f"  {visible(entry.get('pid', '?')):>7}  node {visible(entry.get('node'))} on {visible(entry.get('host'))}  {visible(entry.get('job', ''))}\n"
            )
    foreign = plan.get("foreign_gpu_holders") or []
    text.append("Foreign GPU holders, left alone:\n", style="bold")
    if not foreign:
        text.append("  (none)\n", style="dim")
    for entry in foreign:
        text.append(f"  {visible(entry.get('pid', '?')):>7}", style="yellow")
        text.append(
            f"  {visible(entry.get('user', ''))}  {cut_words(visible(entry.get('cmdline', '')), CMDLINE_WIDTH - 20)}  {mib(entry.get('used_memory_mib'))}\n"
        )
    text.append_text(checkpoint_line(plan, phases))
    return text


class StopModal(ConfirmModal):
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
            yield Static(Text(f"Stop job {visible(self.job)}?"), classes="modal-title")
            with VerticalScroll(id="stop-plan-scroll"):
                phases = training_phases(getattr(self.app, "state", None), self.plan.get("jobs") or [self.job])
                yield Static(stop_plan_text(self.plan, self.grace, phases), id="stop-plan")
            with Horizontal(classes="modal-buttons"):
                yield Button(f"Stop {plural(len(self.pids), 'PID')} (y)", id="confirm", variant="error", disabled=not self.pids)
                yield Button("Cancel (esc)", id="cancel", variant="primary")

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
            text.append(
                f"  {holder.pid:>7}  {visible(holder.user or '?')}  {cut_words(visible(holder.cmdline), CMDLINE_WIDTH - 20)}  {mib(holder.used_memory_mib)}\n"
            )
        return inert(text)

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


@inert_text
def bench_plan_text(
    job: str,
    plan: dict[str, Any],
    checkpoints: list[dict[str, Any]],
    job_running: bool,
    engine: str,
    engine_source: str,
    grace: float,
    levels: str,
    prompts: int,
    argv: list[str],
    phases: dict[str, bool | None] | None = None,
) -> Text:
    """The stop-and-bench plan, stage by stage: what gets signalled, which checkpoint, which engine, what is measured."""
    text = Text()
    text.append("1. Stop ", style="bold")
    if job_running:
        text.append(f"{job}: graceful and checkpoint-aware.\n")
        text.append_text(stop_plan_text(plan, grace, phases))
        text.append("\n")
    else:
        text.append(f"{job} is not running: nothing is signalled; its last checkpoint is used.\n")
    text.append("2. Release: ", style="bold")
    text.append("wait until no process of our jobs holds GPU memory (foreign holders are left untouched).\n")
    latest = next((c for c in reversed(checkpoints) if c.get("latest")), checkpoints[-1] if checkpoints else None)
    text.append("3. Checkpoint to preflight: ", style="bold")
    started = (phases or {}).get(job)
    if job_running and plan.get("checkpoint_first") and started is True:
        text.append("the one the trainer writes at the stop (the new `latest`)")
        text.append(f"; latest now: {visible(latest['path'])}\n" if latest else "\n")
    elif job_running and plan.get("checkpoint_first") and started is False:
        text.append("the trainer is still setting up, so the stop writes none: ")
        if latest:
            text.append(f"the latest, {visible(latest['path'])}\n")
        else:
            text.append("none exists, so the chain would stop here\n", style="bold red")
    elif job_running and plan.get("checkpoint_first"):
        text.append("the one the trainer writes at the stop (the new `latest`), if training steps have begun")
        text.append(
            f"; latest now: {visible(latest['path'])}\n" if latest else "; none written yet, so a stop during setup leaves none and the chain would stop here\n"
        )
    elif latest:
        text.append(f"{visible(latest['path'])}\n")
    else:
        text.append("NONE: this job has no complete checkpoint, so the chain would stop here.\n", style="bold red")
    text.append("4. Preflight: ", style="bold")
    text.append("check the checkpoint against the target config (the failures SGLang does not report)\n")
    text.append("5. Launch ", style="bold")
    text.append(f"engine {engine}", style="bold cyan")
    text.append(f" ({engine_source}), wait until ready\n")
    text.append("6. Canary: ", style="bold")
    text.append("greedy requests; accept length vs τ̂ from validation accuracy → green / amber (τ̂ too low to tell) / red with likely causes\n")
    text.append("7. Benchmark: ", style="bold")
    text.append(f"concurrency {levels}, {prompts} prompts; the result is saved with the training run\n")
    text.append("runs on the host as: ", style="dim")
    text.append(visible(" ".join(argv)), style="dim")
    return text


class StopAndBenchModal(ConfirmModal):
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
            yield Static(Text(f"Stop & bench {visible(self.job)}?"), classes="modal-title")
            with VerticalScroll(id="bench-plan-scroll"):
                yield Static(self.plan_text, id="bench-plan")
            with Horizontal(classes="modal-buttons"):
                yield Button("Stop & bench (y)", id="confirm", variant="error", disabled=not self.can_start)
                yield Button("Cancel (esc)", id="cancel", variant="primary")

    def on_button_pressed(self, event: Button.Pressed) -> None:
        self.dismiss(event.button.id == "confirm" and self.can_start)

    def action_confirm(self) -> None:
        if self.can_start:
            self.dismiss(True)


class WatchModal(FormModal):
    """Watch a run this tool did not start (TensorBoard dir/event file or SpecForge console log), read-only."""

    BINDINGS = [Binding("escape", "cancel", "Cancel")]

    def compose(self) -> ComposeResult:
        with Vertical(id="dialog", classes="modal-dialog"):
            yield Static("Watch an external run (read-only: nothing is started, stopped or written there)", classes="modal-title")
            yield Static(WATCH_HELP, id="watch-help")
            yield Input(placeholder="path on the host", id="watch-path")
            yield Input(placeholder="name (shown as ext:<name>)", id="watch-name")
            yield Input(placeholder="line regex for a text log (optional), e.g. it=(?P<step>\\d+) l=(?P<loss>\\S+)", id="watch-format")
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
        line_format = self.query_one("#watch-format", Input).value.strip()
        self.dismiss({"name": name, "path": path, **({"line_format": line_format} if line_format else {})})


CMDLINE_WIDTH = 100  # a process's command line in a modal: cut after a whole word beyond this (modals wrap)
WATCH_HELP = (
    "A path on the host, read as one of: a TensorBoard directory or tfevents file; a SpecForge console log "
    "(step S: {...} or Eval - Step lines); a plain-text log of name-value pairs with a step "
    "([train] step 260/300 loss 6.47 acc0 0.784 lr 4.4e-04, epoch 1 step 200 loss 8.38 acc0 0.246); or any text log "
    "through your line regex: named groups step (required), split, epoch, loss, lr, grad_norm, acc0, acc1, ploss0..."
)
WATCH_NAME = re.compile(r"^[A-Za-z0-9._-]{1,56}$")


def _default_watch_name(path: str) -> str:
    parts = [p for p in path.replace("\\", "/").split("/") if p and p not in (".", "..", "runs", "tensorboard")]
    name = re.sub(r"[^A-Za-z0-9._-]", "-", parts[-1] if parts else "run")
    return name[:56] or "run"


class ResumeModal(ConfirmModal):
    """Resume training from the checkpoint a stop just wrote: shows the exact command; True only on confirm."""

    BINDINGS = [
        Binding("escape", "cancel", "Cancel"),
        Binding("y", "confirm", "Start it"),
    ]

    def __init__(self, stopped_job: str, checkpoint: str, name: str, argv: list[str]):
        super().__init__()
        self.stopped_job = stopped_job
        self.checkpoint = checkpoint
        self.job_name = name
        self.argv = argv

    def compose(self) -> ComposeResult:
        with Vertical(id="dialog", classes="modal-dialog"):
            yield Static(Text(f"Resume {visible(self.stopped_job)} from its checkpoint?"), classes="modal-title")
            yield Static(resume_text(self.stopped_job, self.checkpoint, self.job_name, self.argv), id="resume-plan")
            with Horizontal(classes="modal-buttons"):
                yield Button("Start (y)", id="confirm", variant="warning")
                yield Button("Cancel (esc)", id="cancel", variant="primary")

    def action_confirm(self) -> None:
        self.dismiss(True)


@inert_text
def resume_text(stopped_job: str, checkpoint: str, name: str, argv: list[str]) -> Text:
    text = Text()
    text.append("checkpoint  ", style="bold")
    text.append(f"{checkpoint}\n")
    text.append("written by  ", style="bold")
    text.append(f"the stop of {stopped_job}\n")
    text.append("new job     ", style="bold")
    text.append(f"{name} (kind train, owned: s stops it)\n\n")
    text.append("runs on the host as:\n", style="bold")
    text.append(" ".join(argv), style="bold cyan")
    text.append("\n\nNothing else is started or stopped.", style="dim")
    return text


class MultiNodeModal(ConfirmModal):
    """Start one training job across several hosts: shows each node's host and exact command; True only on confirm."""

    BINDINGS = [
        Binding("escape", "cancel", "Cancel"),
        Binding("y", "confirm", "Start on every node"),
    ]

    def __init__(self, run_id: str, endpoint: str, nodes: list[tuple[str, list[str]]]):
        super().__init__()
        self.run_id = run_id
        self.endpoint = endpoint
        self.nodes = nodes  # (host, argv) in node-rank order

    def compose(self) -> ComposeResult:
        with Vertical(id="dialog", classes="modal-dialog"):
            yield Static(Text(f"Start {visible(self.run_id)} on {plural(len(self.nodes), 'node')}?"), classes="modal-title")
            with VerticalScroll(id="stop-plan-scroll"):
                yield Static(multinode_text(self.run_id, self.endpoint, self.nodes), id="multinode-plan")
            with Horizontal(classes="modal-buttons"):
                yield Button(f"Start {plural(len(self.nodes), 'node')} (y)", id="confirm", variant="warning")
                yield Button("Cancel (esc)", id="cancel", variant="primary")

    def action_confirm(self) -> None:
        self.dismiss(True)


@inert_text
def multinode_text(run_id: str, endpoint: str, nodes: list[tuple[str, list[str]]]) -> Text:
    text = Text()
    text.append("job         ", style="bold")
    text.append(f"{run_id} on every node (kind train, owned: s stops every node)\n")
    text.append("rendezvous  ", style="bold")
    text.append(f"{endpoint} (node 0 hosts it; every other node must reach it)\n")
    text.append("rank 0      ", style="bold")
    text.append("node 0 writes the metrics and the checkpoints\n")
    for rank, (host, argv) in enumerate(nodes):
        text.append(f"\nnode {rank} on {host}:\n", style="bold")
        text.append(" ".join(argv), style="bold cyan")
    text.append("\n\nNothing else is started or stopped.", style="dim")
    return text
