"""Start a grokking run: pick a checkpoint of the job, a constant LR, weight decay and an optional Grokfast alpha; shows the argv."""

from __future__ import annotations

import math
from pathlib import PurePosixPath
from typing import Any, Collection

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.widgets import Button, Input, OptionList, Static
from textual.widgets.option_list import Option

from backend.commands import grok_argv, grok_job_name
from backend.safetext import visible
from console.screens.modals import FormModal


class GrokParamError(ValueError):
    """A field of the grok modal holds something unusable; the message names it."""


def parse_grok_params(lr: str, weight_decay: str, alpha: str) -> tuple[float, float, float | None]:
    """(lr, weight_decay, alpha or None) from the modal's fields, or GrokParamError saying which one is wrong."""

    def number(field: str, raw: str) -> float:
        try:
            value = float(raw)
        except ValueError:
            raise GrokParamError(f"{field}: {raw!r} is not a number") from None
        if not math.isfinite(value):
            raise GrokParamError(f"{field}: {raw!r} is not finite")
        return value

    lr_value = number("learning rate", lr.strip())
    if lr_value <= 0:
        raise GrokParamError(f"learning rate: {lr_value!r} must be > 0 (a grokking run needs a constant, non-zero LR)")
    wd_value = number("weight decay", weight_decay.strip())
    if wd_value < 0:
        raise GrokParamError(f"weight decay: {wd_value!r} must be >= 0")
    alpha_value = None
    if alpha.strip():
        alpha_value = number("Grokfast alpha", alpha.strip())
        if not 0.0 < alpha_value < 1.0:
            raise GrokParamError(f"Grokfast alpha: {alpha_value!r} must be between 0 and 1 (e.g. 0.98), or empty for off")
    return lr_value, wd_value, alpha_value


def free_job_name(base: str, taken: Collection[str]) -> str:
    """`base`, or base-2, base-3... when a job of that name exists: starting a job under a taken name archives it."""
    name, number = base, 2
    while name in taken:
        name, number = f"{base}-{number}", number + 1
    return name


class GrokModal(FormModal):
    """Returns {"name", "argv", "checkpoint"} for start_job (kind train), or None when cancelled."""

    BINDINGS = [Binding("escape", "cancel", "Cancel")]

    def __init__(self, job: str, profile: str, checkpoints: list[dict[str, Any]], *, lr: float | None, weight_decay: float, taken: Collection[str] = ()):
        super().__init__()
        self.taken = frozenset(taken)  # job names in use on the host
        self.job = job
        self.profile = profile
        self.checkpoints = checkpoints
        self.default_lr = lr
        self.default_wd = weight_decay

    def compose(self) -> ComposeResult:
        with Vertical(id="dialog", classes="modal-dialog"):
            yield Static(Text(f"Grokking run from a checkpoint of {visible(self.job)}"), classes="modal-title")
            yield Static(
                "Resumes the checkpoint as a new training job with a constant LR (no decay), so weight decay keeps "
                "acting; watch it on the Grokking screen (4).",
                id="grok-help",
            )
            yield Static("checkpoint:", classes="field-label")
            options = [Option(self._label(c), id=str(i)) for i, c in enumerate(self.checkpoints)]
            yield OptionList(*options, id="grok-checkpoints")
            yield Static("constant learning rate / weight decay / Grokfast alpha (empty = off):", classes="field-label")
            with Horizontal(id="grok-fields"):
                yield Input(value=repr(self.default_lr) if self.default_lr else "", placeholder="lr, e.g. 1e-4", id="grok-lr")
                yield Input(value=repr(self.default_wd), placeholder="weight decay, e.g. 0.1", id="grok-wd")
                yield Input(placeholder="alpha, e.g. 0.98", id="grok-alpha")
            yield Static("", id="grok-argv")
            yield Static("", id="grok-error")
            with Horizontal(classes="modal-buttons"):
                yield Button("Start (enter)", id="confirm", variant="warning", disabled=not self.checkpoints)
                yield Button("Cancel (esc)", id="cancel", variant="primary")

    @staticmethod
    def _label(checkpoint: dict[str, Any]) -> Text:
        """The checkpoint's name as the host wrote it, shown inert and never read as markup."""
        name = PurePosixPath(str(checkpoint.get("path", "?"))).name
        return Text(visible(f"{name}  (step {checkpoint.get('step', '?')})" + ("  latest" if checkpoint.get("latest") else "")))

    def on_mount(self) -> None:
        options = self.query_one("#grok-checkpoints", OptionList)
        if self.checkpoints:
            latest = next((i for i, c in enumerate(self.checkpoints) if c.get("latest")), len(self.checkpoints) - 1)
            options.highlighted = latest
        else:
            self.query_one("#grok-error", Static).update(Text(f"{visible(self.job)} has no checkpoint yet: nothing to resume from.", style="bold red"))
        self.query_one("#grok-lr", Input).focus()
        self._preview()

    @property
    def checkpoint(self) -> str | None:
        index = self.query_one("#grok-checkpoints", OptionList).highlighted
        return str(self.checkpoints[index]["path"]) if index is not None and self.checkpoints else None

    def build(self) -> dict[str, Any]:
        """The start_job params; raises GrokParamError naming the bad field."""
        checkpoint = self.checkpoint
        if checkpoint is None:
            raise GrokParamError("checkpoint: pick one (this job has none yet)")
        lr, wd, alpha = parse_grok_params(
            self.query_one("#grok-lr", Input).value, self.query_one("#grok-wd", Input).value, self.query_one("#grok-alpha", Input).value
        )
        return {
            "name": free_job_name(grok_job_name(checkpoint), self.taken),
            "argv": grok_argv(self.profile, checkpoint, lr, wd, alpha),
            "checkpoint": checkpoint,
        }

    def _preview(self) -> None:
        try:
            params = self.build()
        except GrokParamError as exc:
            self.query_one("#grok-argv", Static).update(Text(visible(f"(not ready: {exc})"), style="dim"))
            return
        self.query_one("#grok-argv", Static).update(Text(visible(f"job {params['name']}: " + " ".join(params["argv"])), style="cyan"))

    def on_input_changed(self, event: Input.Changed) -> None:
        self._preview()

    def on_option_list_option_highlighted(self, event: OptionList.OptionHighlighted) -> None:
        self._preview()

    def submit(self) -> None:
        try:
            params = self.build()
        except GrokParamError as exc:
            self.query_one("#grok-error", Static).update(Text(visible(f"{exc}. Nothing was started."), style="bold red"))
            return
        self.dismiss(params)
