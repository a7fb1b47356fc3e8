"""Logs: the tail of the selected job's stdout and stderr, following as the agent pushes new lines, and searching them
(/ to type, n / N next and previous match, esc clears: less's keys)."""

from __future__ import annotations

from dataclasses import dataclass

from rich.highlighter import Highlighter
from rich.segment import Segment
from rich.style import Style
from rich.text import Text
from textual import events
from textual.app import ComposeResult
from textual.binding import Binding
from textual.reactive import reactive
from textual.strip import Strip
from textual.widgets import Header, Input, Log, Static

from backend.safetext import visible
from console.screens.base import ConsoleScreen, no_job_text, touches
from console.widgets.banner import ConnectionBanner
from console.widgets.panels import ConsoleFooter
from console.session import LOG_TAIL_LINES, STREAMS
from console.state import Section

AGENT_LINES = 4
TAIL_LINES = LOG_TAIL_LINES  # what the session asks the agent for: a tail this long may be cut
MATCH_STYLE = Style(color="black", bgcolor="yellow")
CURRENT_LINE_STYLE = Style(bgcolor="grey23", bold=True)


class MatchHighlighter(Highlighter):
    """Marks every occurrence of the search term in a line; any case unless the term has a capital (smart case)."""

    term = ""

    def highlight(self, text: Text) -> None:
        if self.term:
            text.highlight_words([self.term], MATCH_STYLE, case_sensitive=matches_case(self.term))


def matches_case(term: str) -> bool:
    return term != term.lower()


def line_matches(line: str, term: str) -> bool:
    return bool(term) and (term in line if matches_case(term) else term.lower() in line.lower())


class SearchableLog(Log):
    """A Log whose lines show the search term's matches, and the current match's line marked.

    Its lines are the host's text already made inert (backend/safetext.py's visible): matches are styled on Rich Text,
    never parsed as markup."""

    def __init__(self, **kwargs):
        super().__init__(highlight=True, **kwargs)
        self.matcher = self.highlighter = MatchHighlighter()
        self.current: int | None = None  # the line of the current match

    def set_term(self, term: str) -> None:
        if term != self.matcher.term:
            self.matcher.term = term
            self.refresh_lines(0, self.line_count)

    def set_current(self, line: int | None) -> None:
        if line != self.current:
            for old in (self.current, line):
                if old is not None:
                    self.refresh_lines(old)
            self.current = line

    def render_line(self, y: int) -> Strip:
        strip = super().render_line(y)
        if self.current is None or self.scroll_offset.y + y != self.current:
            return strip
        return Strip(Segment.apply_style(list(strip), post_style=CURRENT_LINE_STYLE), strip.cell_length)


@dataclass(frozen=True)
class Match:
    """A line holding the search term: its stream, its index in that Log, and its text (to find it again after a re-read)."""

    stream: str
    line: int
    text: str


def find_matches(lines_by_stream: dict[str, list[str]], term: str) -> list[Match]:
    """Every line holding `term`, stream by stream in the order shown (stdout above stderr), top to bottom."""
    return [Match(stream, i, line) for stream in STREAMS for i, line in enumerate(lines_by_stream.get(stream, [])) if line_matches(line, term)]


def step_match(matches: list[Match], current: Match | None, forward: bool) -> Match | None:
    """The next (or previous) match after `current`, wrapping around; the first (last) when there is none yet."""
    if not matches:
        return None
    if current is None:
        return matches[0] if forward else matches[-1]
    order = [(STREAMS.index(m.stream), m.line) for m in matches]
    here = (STREAMS.index(current.stream), current.line)
    if forward:
        return next((m for m, at in zip(matches, order) if at > here), matches[0])
    return next((m for m, at in reversed(list(zip(matches, order))) if at < here), matches[-1])


def lines_label(stream: str, buffer) -> str:
    """How many lines of the stream are shown: the buffer's own lines, not `total` (every poll's re-read adds to that)."""
    shown = len(buffer.lines) if buffer else 0
    if shown >= TAIL_LINES:
        return f"{stream} last {shown} lines"
    return f"{stream} {shown} line" + ("" if shown == 1 else "s")


class LogsScreen(ConsoleScreen):
    MODE = "logs"
    TITLE = "eagle3-console · Logs (3)"  # the header names the screen
    AUTO_FOCUS = "#log-stdout"  # not the hidden search box
    DEFAULT_CSS = """
    #logs-search {
        height: 1;
        border: none;
        padding: 0 1;
    }
    """

    BINDINGS = [
        Binding("f", "toggle_follow", "Follow"),
        Binding("o", "switch_stream", "Live stream"),
        Binding("slash", "search_logs", "Search"),
        Binding("n", "next_match", "Next match", tooltip="the next line holding the search term (while a search is on)"),
        Binding("N", "previous_match", "Prev match", tooltip="the previous line holding the search term (while a search is on)"),
    ]

    follow: reactive[bool] = reactive(True, init=False)

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self._shown: dict[str, tuple[str | None, int, int]] = {}  # stream -> (job, buffer generation, lines shown)
        self.search = ""  # the term the shown lines are searched for ("" while no search is on)
        self.match: Match | None = None  # the current match (n / N move it)

    def compose(self) -> ComposeResult:
        yield Header()
        yield ConnectionBanner(id="banner")
        yield Static(id="logs-title")
        search = Input(placeholder="search the shown lines (enter keeps it, n / N next / previous, esc clears)", id="logs-search")
        search.display = False  # shown by / (and never focused before that)
        yield search
        yield Static("stdout", classes="section-title", id="title-stdout")
        yield SearchableLog(id="log-stdout", max_lines=2000)
        yield Static("stderr", classes="section-title", id="title-stderr")
        yield SearchableLog(id="log-stderr", max_lines=2000)
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

    # -- search ------------------------------------------------------------------------------------

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        """n and N are the search's only while one is on; otherwise the keys are the app's (n starts a run)."""
        if action in ("next_match", "previous_match"):
            return bool(self.search)
        return True

    def action_search_logs(self) -> None:
        box = self.query_one("#logs-search", Input)
        box.display = True
        box.focus()

    def action_next_match(self) -> None:
        self._step(forward=True)

    def action_previous_match(self) -> None:
        self._step(forward=False)

    def on_input_changed(self, event: Input.Changed) -> None:
        if event.input.id == "logs-search":  # every key: the matches light up as the term is typed
            self._set_search(event.value)

    def on_input_submitted(self, event: Input.Submitted) -> None:
        if event.input.id == "logs-search":
            event.input.display = bool(self.search)
            self.query_one("#log-stdout", SearchableLog).focus()
            if self.search:
                self._step(forward=True)

    def on_key(self, event: events.Key) -> None:
        if event.key == "escape" and (self.search or self.query_one("#logs-search", Input).display):
            self.clear_search()
            event.stop()

    def clear_search(self) -> None:
        box = self.query_one("#logs-search", Input)
        box.value = ""
        box.display = False
        self.query_one("#log-stdout", SearchableLog).focus()
        self._set_search("")

    def _set_search(self, term: str) -> None:
        self.search = term
        self.match = None
        for stream in STREAMS:
            log = self.query_one(f"#log-{stream}", SearchableLog)
            log.set_term(term)
            log.set_current(None)
        self.refresh_bindings()  # n / N show in the footer only while a search is on
        self.show_state({Section.OPTIONS})

    def _lines(self) -> dict[str, list[str]]:
        return {stream: list(self.query_one(f"#log-{stream}", SearchableLog).lines) for stream in STREAMS}

    def _step(self, *, forward: bool) -> None:
        """Go to the next or previous match: mark its line and scroll it to the middle (scrolling pauses, as in less)."""
        self.match = step_match(find_matches(self._lines(), self.search), self._relocated(), forward)
        for stream in STREAMS:
            log = self.query_one(f"#log-{stream}", SearchableLog)
            log.set_current(self.match.line if self.match and self.match.stream == stream else None)
        if self.match is not None:
            self.follow = False
            log = self.query_one(f"#log-{self.match.stream}", SearchableLog)
            log.scroll_to(y=max(0, self.match.line - log.size.height // 2), animate=False)
        self.show_state({Section.OPTIONS})

    def _relocated(self) -> Match | None:
        """The current match after its stream was re-read (lines shift): its text nearest its old place, else None."""
        match = self.match
        if match is None:
            return None
        lines = self._lines()[match.stream]
        if match.line < len(lines) and lines[match.line] == match.text:
            return match
        places = [i for i, line in enumerate(lines) if line == match.text]
        return Match(match.stream, min(places, key=lambda i: abs(i - match.line)), match.text) if places else None

    def _search_text(self) -> str:
        if not self.search:
            return "search (/)"
        matches = find_matches(self._lines(), self.search)
        current = self._relocated()
        where = f"{matches.index(current) + 1}/{len(matches)} ({current.stream} line {current.line + 1})" if current in matches else f"{len(matches)} lines"
        return f"search '{self.search}': {where} (n N, esc clears)"

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
            title = (
                f"{job} · {self._search_text()} · {'scrolling' if self.follow else 'paused'} (f) · live: {live}, the other re-read every poll (o) · "
                f"{' · '.join(counts)}{where}"
            )
        else:
            title = no_job_text(self.console)
        self.query_one("#logs-title", Static).update(Text(visible(title)))

    def _draw_stream(self, stream: str, job: str | None, buffer) -> None:
        log = self.query_one(f"#log-{stream}", SearchableLog)
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
        if self.match is not None and self.match.stream == stream:  # a re-read shifts lines: keep the mark on its line
            self.match = self._relocated()
            log.set_current(self.match.line if self.match else None)
