"""The connection banner at the top of every screen: connected, connecting, or disconnected with stale data."""

from __future__ import annotations

from rich.text import Text
from textual.widgets import Static

from backend.protocol import DiskUsage
from backend.safetext import visible
from console.format import GIB, clock_time, duration, figure, inert_text
from console.state import CONNECTED, CONNECTING, FAILED, RECONNECTING, ConnectionStatus, ConsoleState, disk_low, used_share

DISABLED_NOTE = "stop, stop & bench, resume, grok, adopt and start are disabled until the connection is back"
RETRY_NOTE = "r retries now"
GAVE_UP_NOTE = "stop, stop & bench, resume, grok, adopt and start are disabled: this console will not retry; fix the cause and start it again"


READONLY_NOTE = "start, stop, stop & bench, resume, grok and adopt are off"


@inert_text
def banner_text(state: ConsoleState, readonly: bool = False) -> Text:
    text = Text()
    if readonly:
        text.append(" READ-ONLY ", style="bold black on cyan")
        text.append(f" {READONLY_NOTE} · ", style="italic")
    text.append_text(_connection_text(state, readonly))
    warning = disk_warning(state)
    if warning:
        text.append("\n")
        text.append(" DISK ", style="bold white on red")
        text.append(f" {visible(warning)}", style="bold red")
    return text


def disk_warning(state: ConsoleState) -> str | None:
    """The first low disk (console/state.py disk_low) in words: red before a checkpoint fails."""
    disk = next((d for d in state.disks if disk_low(d)), None)
    return _low_disk_text(disk) if disk is not None else None


def _low_disk_text(disk: DiskUsage) -> str:
    free = f"disk nearly full: {figure(disk.free_bytes, GIB)} GiB free on {disk.path}"
    if disk.checkpoint_bytes:
        return f"{free}, a checkpoint needs ~{figure(disk.checkpoint_bytes, GIB)} GiB: the next save may fail (the previous checkpoint stays); free space now"
    return f"{free} ({used_share(disk):.0%} used); free space now"


def _connection_text(state: ConsoleState, readonly: bool) -> Text:
    status = state.connection
    now = state.clock()
    text = Text()
    if status.state == CONNECTED:
        text.append(" ● connected ", style="bold black on green")
        text.append(f" {state.target}")
        hello = state.hello
        if hello:
            text.append(visible(f" · host {hello.host} · agent pid {hello.agent_pid} · python {hello.python} · run dir {hello.run_dir}"))
            if hello.backend_hash:
                text.append(f" · backend {visible(hello.backend_hash)}")
        return text
    if status.state == CONNECTING:
        text.append(" … connecting ", style="bold black on yellow")
        text.append(f" {state.target} {visible(status.detail)}")
        return text
    label = " ▲ DISCONNECTED " if status.state == RECONNECTING else " ✖ NOT CONNECTED "
    text.append(label, style="bold white on red")
    if state.last_data_at is not None:
        text.append(f" STALE: data from {clock_time(state.last_data_at)} ({duration(now - state.last_data_at)} ago)", style="bold")
    else:
        text.append(" no data received yet", style="bold")
    if status.state == RECONNECTING:
        text.append(f" · reconnecting to {state.target} (attempt {status.attempt}, {_next_try(status, now)})")
        text.append(f" · {RETRY_NOTE}", style="bold")
    elif status.state == FAILED:
        text.append(f" · {state.target}: gave up")
    if status.detail:
        text.append(f" · {visible(status.detail)}")
    if not readonly:
        note = DISABLED_NOTE if status.state != FAILED else GAVE_UP_NOTE
        text.append(f" · {note}", style="italic")
    return text


def _next_try(status: ConnectionStatus, now: float) -> str:
    """'next try at 14:02:31, in 12s', or 'trying now' while a try is under way (an SSH connect can take a while)."""
    at = status.next_try_at
    if at is None or at <= now:
        return "trying now"
    return f"next try at {clock_time(at)}, in {duration(at - now)}"


class ConnectionBanner(Static):
    """One line (wrapping when long) saying whether what the screen shows is live or stale."""

    DEFAULT_CSS = """
    ConnectionBanner { height: auto; max-height: 6; padding: 0 1; }
    ConnectionBanner.-stale { background: $error 20%; }
    """

    def show_state(self, state: ConsoleState) -> None:
        self.set_class(state.stale, "-stale")
        text = banner_text(state, bool(getattr(self.app, "readonly", False)))
        sessions = getattr(self.app, "sessions", [])
        if len(sessions) > 1:
            text.append("\n")
            text.append_text(hosts_text([s.state for s in sessions], state))
        self.update(text)


@inert_text
def hosts_text(states: list[ConsoleState], active: ConsoleState) -> Text:
    """Every host's link in one line, the one shown underlined: 'hosts  a ●  b ▲ STALE 12s  c ✖'."""
    text = Text("hosts ", style="bold")
    for state in states:
        if state.connection.state == CONNECTED:
            mark, style = "●", "green"
        elif state.last_data_at is not None:
            mark, style = f"▲ STALE {duration(state.clock() - state.last_data_at)}", "bold red"
        else:
            mark, style = "✖", "bold red"
        text.append(f" {state.target}", style="bold underline" if state is active else "")
        text.append(f" {mark} ", style=style)
    text.append(" (6: Hosts)", style="dim")
    return text
