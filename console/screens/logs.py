"""Logs: the tail of the selected job's stdout and stderr, following as the agent pushes new lines."""

from __future__ import annotations

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.reactive import reactive
from textual.widgets import Header, Log, Static

from backend.safetext import visible
from console.screens.base import ConsoleScreen, no_job_text, touches
from console.widgets.banner import ConnectionBanner
from console.widgets.panels import ConsoleFooter
from console.session import LOG_TAIL_LINES, STREAMS
from console.state import Section

AGENT_LINES = 4
TAIL_LINES = LOG_TAIL_LINES  # what the session asks the agent for: a tail this long may be cut


def lines_label(stream: str, buffer) -> str:
    """How many lines of the stream are shown: the buffer's own lines, not `total` (every poll's re-read adds to that)."""
    shown = len(buffer.lines) if buffer else 0
    if shown >= TAIL_LINES:
        return f"{stream} last {shown} lines"
    return f"{stream} {shown} line" + ("" if shown == 1 else "s")


class LogsScreen(ConsoleScreen):
    MODE = "logs"
    TITLE = "eagle3-console · Logs (3)"  # the header names the screen

    BINDINGS = [
        Binding("f", "toggle_follow", "Follow"),
        Binding("o", "switch_stream", "Live stream"),
    ]

    follow: reactive[bool] = reactive(True, init=False)

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self._shown: dict[str, tuple[str | None, int, int]] = {}  # stream -> (job, buffer generation, lines shown)

    def compose(self) -> ComposeResult:
        yield Header()
        yield ConnectionBanner(id="banner")
        yield Static(id="logs-title")
        yield Static("stdout", classes="section-title", id="title-stdout")
        yield Log(id="log-stdout", max_lines=2000)
        yield Static("stderr", classes="section-title", id="title-stderr")
        yield Log(id="log-stderr", max_lines=2000)
        yield Static("agent diagnostics (the agent's own stderr)", classes="section-title")
        yield Static(id="agent-stderr")
        yield ConsoleFooter()

    def on_mount(self) -> None:
        self.show_state(None)

    def on_screen_resume(self) -> None:
        super().on_screen_resume()
        if self.follow:  # lines written while the screen was hidden left the view at the head of the log
            self.call_after_refresh(self._to_tail)

    def _to_tail(self) -> None:
        for stream in STREAMS:
            self.query_one(f"#log-{stream}", Log).scroll_end(animate=False)

    def action_toggle_follow(self) -> None:
        self.follow = not self.follow

    def action_switch_stream(self) -> None:
        self.console.set_log_stream("stderr" if self.console.log_stream == "stdout" else "stdout")
        self.show_state({Section.OPTIONS})

    def watch_follow(self, follow: bool) -> None:
        for stream in STREAMS:
            log = self.query_one(f"#log-{stream}", Log)
            log.auto_scroll = follow
            if follow:
                log.scroll_end(animate=False)
        self.show_state({Section.OPTIONS})

    def draw(self, changed: set[str] | None) -> None:
        if touches(changed, Section.AGENT_STDERR):
            lines = list(self.console.state.agent_stderr)[-AGENT_LINES:]
            shown = "\n".join(visible(line) for line in lines)
            self.query_one("#agent-stderr", Static).update(Text(shown if lines else "(nothing)", style="dim"))
        if not touches(changed, Section.LOGS, Section.SELECTION, Section.OPTIONS, Section.JOBS):
            return
        job = self.console.selected_job
        state = self.console.state
        info = state.jobs.get(job) if job else None
        counts = []
        for stream in STREAMS:
            buffer = state.logs.get((job, stream)) if job else None
            counts.append(lines_label(stream, buffer))
            self._draw_stream(stream, job, buffer)
        live = self.console.log_stream
        for stream in STREAMS:  # the followed stream gets two thirds of the height
            self.query_one(f"#log-{stream}", Log).styles.height = "2fr" if stream == live else "1fr"
            self.query_one(f"#title-{stream}", Static).update(f"{stream} (followed live)" if stream == live else stream)
        if job:
            where = f" · {info.stderr_path if live == 'stderr' else info.stdout_path}" if info else ""
            title = f"{job} · {'scrolling' if self.follow else 'paused'} (f) · live: {live}, the other re-read every poll (o) · {' · '.join(counts)}{where}"
        else:
            title = no_job_text(self.console)
        self.query_one("#logs-title", Static).update(Text(visible(title)))

    def _draw_stream(self, stream: str, job: str | None, buffer) -> None:
        log = self.query_one(f"#log-{stream}", Log)
        shown_job, shown_generation, shown_total = self._shown.get(stream, (None, -1, 0))
        total = buffer.total if buffer else 0
        generation = buffer.generation if buffer else -1
        new = total - shown_total
        if (shown_job, shown_generation) != (job, generation) or new < 0 or (buffer is not None and new > len(buffer.lines)):
            log.clear()
            lines = list(buffer.lines) if buffer else []
        else:
            lines = list(buffer.lines)[-new:] if new and buffer else []
        if lines:  # a host's log line may carry any bytes: its escapes are shown, never sent to the terminal
            log.write_lines([visible(line, keep="\t") for line in lines])
            if self.follow:
                log.scroll_end(animate=False)
        self._shown[stream] = (job, generation, total)
