"""The console's action table: every operator action with its key and labels, why one is off now, and the command palette."""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any, Callable, Protocol, cast

from textual.binding import Binding, BindingType
from textual.command import DiscoveryHit, Hit, Hits, Provider

from backend.smoothing import TRAIN_EMA_BETA
from console.client import AgentClient
from console.session import HostSession
from console.state import RECONNECTING, ConsoleState


@dataclass(frozen=True)
class ConsoleAction:
    """One operator action: its key, footer label, palette title and what it needs."""

    name: str
    key: str
    label: str
    help: str
    needs_connection: bool = False
    needs_job: bool = False
    screen: str | None = None  # only on the screen of this mode (its own binding)
    owned_job: bool = False  # refused on external (watched, read-only) runs
    external_job: bool = False  # only on an external (watched) run
    job_kinds: tuple[str, ...] = ()  # the selected job must be one of these kinds
    destructive: bool = False  # starts, stops or takes over a process: disabled and hidden under --readonly
    short: str = ""  # footer label on a narrow terminal


ACTIONS = [
    ConsoleAction("show_dashboard", "1", "Dashboard", "GPUs, jobs, latest metrics, disks"),
    ConsoleAction("show_training", "2", "Training", "loss / LR curves and validation accuracy"),
    ConsoleAction("show_logs", "3", "Logs", "stdout and stderr of the selected job"),
    ConsoleAction("show_grokking", "4", "Grokking", "log-step loss, gap, val slope, norms, tau, LR floor, data scaling"),
    ConsoleAction("show_chain", "5", "Bench result", "stages and result of the latest stop-and-bench run"),
    ConsoleAction("show_hosts", "6", "Hosts", "every host at a glance; pick the one the other screens show; nodes of a multi-node job"),
    ConsoleAction("prev_job", "[", "Prev job", "select the previous job"),
    ConsoleAction("next_job", "]", "Next job", "select the next job"),
    ConsoleAction(
        "start_training", "n", "New tiny run", "start a training job with the console's profile", needs_connection=True, destructive=True, short="New"
    ),
    ConsoleAction(
        "start_multinode",
        "m",
        "Multi-node run",
        "start one training job across every connected host (torchrun; shows each node's command first)",
        needs_connection=True,
        destructive=True,
        short="Nodes",
    ),
    ConsoleAction(
        "stop_job",
        "s",
        "Stop job",
        "stop the selected job (shows the PIDs first)",
        needs_connection=True,
        needs_job=True,
        owned_job=True,
        destructive=True,
        short="Stop",
    ),
    ConsoleAction(
        "stop_and_bench",
        "b",
        "Stop & bench",
        "stop training with a checkpoint, serve it, canary, benchmark (shows the plan first)",
        needs_connection=True,
        needs_job=True,
        owned_job=True,
        job_kinds=("train",),
        destructive=True,
        short="Bench",
    ),
    ConsoleAction(
        "resume",
        "c",
        "Resume ckpt",
        "resume training from the checkpoint the last stop wrote, as a new job (shows the command first)",
        needs_connection=True,
        destructive=True,
        short="Resume",
    ),
    ConsoleAction(
        "grok",
        "g",
        "Grok run",
        "resume a checkpoint with a constant LR, weight decay, optional Grokfast",
        needs_connection=True,
        needs_job=True,
        owned_job=True,
        job_kinds=("train",),
        destructive=True,
        short="Grok",
    ),
    ConsoleAction("watch_external", "w", "Watch run", "watch a TensorBoard dir or SpecForge log read-only as ext:<name>", needs_connection=True, short="Watch"),
    ConsoleAction("adopt", "a", "Adopt PID", "adopt a foreign process as a job (PID typed to confirm)", needs_connection=True, destructive=True, short="Adopt"),
    ConsoleAction("resync", "r", "Resync", "re-read everything from the agent; while disconnected: reconnect now", needs_connection=True, short="Sync"),
    ConsoleAction("quit", "q", "Quit", "leave the console (jobs keep running on the host)"),
    ConsoleAction("help", "?", "Help", "every key on one screen", short="Help"),
    ConsoleAction(
        "filter_jobs",
        "/",
        "Filter",
        "Dashboard: show only the jobs and GPU holders whose row holds the typed text, both at once (esc clears)",
        screen="dashboard",
    ),
    ConsoleAction("toggle_workers", "h", "Workers", "Dashboard: show / hide each job's helper processes under its GPU holder row", screen="dashboard"),
    ConsoleAction("sort_jobs", ">", "Sort", "Dashboard: sort the jobs by the next of name, state, started, CPU %, RSS, step", screen="dashboard"),
    ConsoleAction("reverse_sort", "<", "Reverse", "Dashboard: reverse the jobs table's sort", screen="dashboard", short="Rev"),
    ConsoleAction(
        "unwatch_external",
        "u",
        "Unwatch",
        "Dashboard: stop watching the selected ext: run (asks first; nothing on the host is touched)",
        needs_connection=True,
        needs_job=True,
        external_job=True,
        screen="dashboard",
    ),
    ConsoleAction("toggle_log_step", "x", "Log step", "Training: step axis log10 on/off", screen="training"),
    ConsoleAction("toggle_log_y", "y", "Log y", "Training: loss and LR on a log10 axis on/off", screen="training"),
    ConsoleAction("toggle_ema", "e", "EMA", f"Training: EMA smoothing ({TRAIN_EMA_BETA}) on/off", screen="training"),
    ConsoleAction("next_overlay", "o", "Overlay", "Training: draw another training job or watched run on the same axes (cycles, then off)", screen="training"),
    ConsoleAction("toggle_follow", "f", "Follow", "Logs: scroll to new lines on/off", screen="logs"),
    ConsoleAction("switch_stream", "o", "Live stream", "Logs: follow stdout or stderr live", screen="logs"),
    ConsoleAction("search_logs", "/", "Search", "Logs: find text in the shown lines of both streams; n / N next / previous match, esc clears", screen="logs"),
    ConsoleAction("toggle_wall_time", "t", "Wall time", "Training: x is each step's wall time since the run's first step, or the step", screen="training"),
    ConsoleAction("toggle_wall_time", "t", "Wall time", "Grokking: x is each step's wall time since the run's first step, or the log step", screen="grokking"),
]
ACTIONS_BY_NAME = {a.name: a for a in ACTIONS}
MULTI_HOST_ACTIONS = ("show_hosts", "start_multinode")  # offered only when the console holds several hosts
SCREEN_NAMES = {"dashboard": "Dashboard (1)", "training": "Training (2)", "logs": "Logs (3)", "grokking": "Grokking (4)", "chain": "Stop & bench (5)"}
_SCREENS = Binding.Group("Screens", compact=True)  # the footer shows "12345 Screens": room for every action key
_JOBS = Binding.Group("Prev/next job", compact=True)
FOOTER_GROUPS = {
    "show_dashboard": _SCREENS,
    "show_training": _SCREENS,
    "show_logs": _SCREENS,
    "show_grokking": _SCREENS,
    "show_chain": _SCREENS,
    "show_hosts": _SCREENS,
    "prev_job": _JOBS,
    "next_job": _JOBS,
}


def app_bindings() -> list[BindingType]:
    """The app-wide keys (a screen's own actions are that screen's bindings)."""
    return [Binding(a.key, a.name, a.label, group=FOOTER_GROUPS.get(a.name)) for a in ACTIONS if a.screen is None]


class ActionGuard(Protocol):
    """What the guards read of the console."""

    readonly: bool
    selected_job: str | None
    sessions: list[HostSession]
    resume_target: dict[str, Any] | None

    @property
    def multi_host(self) -> bool: ...

    @property
    def client(self) -> AgentClient | None: ...

    @property
    def state(self) -> ConsoleState: ...


def offered(action: ConsoleAction, console: ActionGuard) -> bool:
    """Whether `action` exists in this console at all: not under --readonly when destructive, not with one host when multi-host."""
    return not (action.destructive and console.readonly) and (action.name not in MULTI_HOST_ACTIONS or console.multi_host)


def disabled_reason(console: ActionGuard, name: str) -> str | None:
    """Why the action `name` cannot run now, in words; None when it can."""
    spec = ACTIONS_BY_NAME.get(name)
    if spec is None:
        return None
    if spec.destructive and console.readonly:
        return "read-only console (--readonly)"
    if spec.name in MULTI_HOST_ACTIONS and not console.multi_host:
        return "this console holds one host (give --host once per host)"
    if spec.name == "resync" and console.client is not None and console.state.connection.state == RECONNECTING:
        return None  # r while disconnected tries at once
    if spec.needs_connection and (console.client is None or not console.state.connection.connected):
        return "disconnected from the host" if console.client is not None else "no host connection"
    if spec.needs_job and not console.selected_job:
        return "no job selected"
    if spec.name == "start_multinode" and sum(s.connected for s in console.sessions) < 2:
        return "needs two or more connected hosts (give --host once per host)"
    if spec.name == "resume" and console.resume_target is None:
        return "no stop has written a checkpoint yet"
    return _job_reason(spec, console)


def _job_reason(spec: ConsoleAction, console: ActionGuard) -> str | None:
    """Why the selected job is the wrong one for `spec`: a watched run for an owned-job action, or the wrong kind."""
    job = console.selected_job
    if spec.owned_job and console.state.is_external(job):
        return f"{job} is an external run, watched read-only"
    if spec.external_job and not console.state.is_external(job):
        return f"{job} is not a watched run (w watches one)"
    if spec.job_kinds and job:
        info = console.state.jobs.get(job)
        kind = info.kind if info else "unknown"
        if kind not in spec.job_kinds:
            return f"{job} is a {kind} job; select a training job"
    return None


class PaletteHost(ActionGuard, Protocol):
    """The console as the palette drives it."""

    def disabled_reason(self, action: str) -> str | None: ...

    async def run_console_action(self, name: str, screen: Any = None) -> None: ...


class ConsoleCommands(Provider):
    """Every console action in the command palette; disabled ones say why."""

    def _entries(self) -> list[tuple[str, str, Callable[[], Any]]]:
        app = cast(PaletteHost, self.app)
        entries: list[tuple[str, str, Callable[[], Any]]] = []
        for action in ACTIONS:
            if action.screen is not None and getattr(self.screen, "MODE", None) != action.screen:
                continue
            if not offered(action, app):
                continue  # --readonly, or one host: not offered at all
            reason = app.disabled_reason(action.name)
            # The palette parses help as markup: "[n]" would vanish as a tag, so every "[" is escaped, and the key is
            # shown bare ("key [ · ...") because a bracketed "[[]" reads as noise.
            help_text = (f"key {action.key} · {action.help}" + (f" (disabled: {reason})" if reason else "")).replace("[", r"\[")
            entries.append((action.label, help_text, partial(app.run_console_action, action.name, self.screen)))
        return entries

    async def discover(self) -> Hits:
        for title, help_text, callback in self._entries():
            yield DiscoveryHit(title, callback, help=help_text)

    async def search(self, query: str) -> Hits:
        matcher = self.matcher(query)
        for title, help_text, callback in self._entries():
            score = max(matcher.match(title), matcher.match(help_text) * 0.5)
            if score > 0:
                yield Hit(score, matcher.highlight(title), callback, text=title, help=help_text)
