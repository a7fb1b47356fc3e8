"""Text for the screens and widgets: bars, sizes, durations, percentages, metric numbers, τ̂ and accept lengths, and host
strings made inert."""

from __future__ import annotations

import functools
import math
import time
from typing import Callable, ParamSpec

from rich.markup import escape
from rich.text import Span, Text

from backend.safetext import visible

BAR_FULL = "█"
BAR_EMPTY = "░"


def segmented_bar(parts: list[tuple[float, str]], total: float, width: int) -> Text:
    """A bar of `width` cells: each (amount, style) part gets its share of `total`, the rest is empty."""
    text = Text()
    if total <= 0 or width <= 0:
        return Text(BAR_EMPTY * max(width, 0), style="dim")
    used_cells = 0
    for amount, style in parts:
        cells = int(round(max(amount, 0.0) / total * width))
        cells = min(cells, width - used_cells)
        if cells > 0:
            text.append(BAR_FULL * cells, style=style)
            used_cells += cells
    text.append(BAR_EMPTY * (width - used_cells), style="dim")
    return text


MIB = 2**20
GIB = 2**30


def figure(amount: float | None, unit: int, digits: int = 1, *, amount_unit: int = 1) -> str:
    """`amount` bytes (or `amount_unit`s of them, MIB for GPU memory) as a bare number of `unit` ("12.3" for GIB), for a
    "used/total GiB" pair or a sentence that names the unit once; "?" when unknown."""
    return "?" if amount is None else f"{amount * amount_unit / unit:.{digits}f}"


def mib(value: float | None) -> str:
    """MiB (GPU memory as the host reports it) as "512 MiB", or in GiB from 1 GiB on."""
    if value is None:
        return "?"
    if value >= 1024:
        return f"{value / 1024:.1f} GiB"
    return f"{value:.0f} MiB"


def size_bytes(value: int | float | None) -> str:
    """Bytes in the largest unit that keeps the number under 1024: "512 B", "1.5 GiB"."""
    if value is None:
        return "?"
    units = ["B", "KiB", "MiB", "GiB", "TiB", "PiB"]
    amount = float(value)
    for unit in units:
        if abs(amount) < 1024 or unit == units[-1]:
            return f"{amount:.0f} {unit}" if unit == "B" else f"{amount:.1f} {unit}"
        amount /= 1024
    return f"{amount:.1f} PiB"


def duration(seconds: float | None) -> str:
    if seconds is None or seconds < 0:
        return "-"
    seconds = int(seconds)
    if seconds < 60:
        return f"{seconds}s"
    minutes, seconds = divmod(seconds, 60)
    if minutes < 60:
        return f"{minutes}m{seconds:02d}s"
    hours, minutes = divmod(minutes, 60)
    if hours < 48:
        return f"{hours}h{minutes:02d}m"
    days, hours = divmod(hours, 24)
    return f"{days}d{hours:02d}h"


def clock_time(epoch: float | None) -> str:
    if epoch is None:
        return "-"
    return time.strftime("%H:%M:%S", time.localtime(epoch))


def epoch_text(epoch: object) -> str:
    """A record's epoch: "-" when not logged (never "None"); a fractional epoch (the trainer's progress) to 2 places."""
    if not isinstance(epoch, (int, float)) or isinstance(epoch, bool):
        return "-"
    return f"{epoch:g}" if float(epoch).is_integer() else f"{epoch:.2f}"


def number(value: object, digits: int = 4) -> str:
    """A metric value: NaN/inf shown as such, small/large ones in e-notation."""
    if not isinstance(value, (int, float)):
        return "-"
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if value != 0 and (abs(value) < 1e-3 or abs(value) >= 1e6):
        return f"{value:.2e}"
    return f"{value:.{digits}g}"


def accept_length(value: object) -> str:
    """τ̂ and every accept length (tokens per verify step), one way on every screen: two decimals, as the canary's
    verdict lines and SGLang's logs print them ("1.00", "3.94"); "-" when unknown, NaN/inf as such."""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return "-"
    if not math.isfinite(value):
        return str(float(value))
    return f"{value:.2f}"


def percent(value: object) -> str:
    """Accuracy in [0, 1] (or already in percent when > 1) as a percentage."""
    if not isinstance(value, (int, float)) or (isinstance(value, float) and not math.isfinite(value)):
        return "-"
    return f"{value * 100 if value <= 1.0 else value:.1f}%"


def count(value: object) -> str:
    if not isinstance(value, (int, float)):
        return "-"
    for scale, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= scale:
            return f"{value / scale:.1f}{suffix}"
    return f"{value:.0f}"


def inert(text: Text) -> Text:
    """`text` with every control, escape and bidi character a host put in it shown as its escape (backend.safetext), styles
    kept; newlines stay (the panels' own line breaks). The net under every panel that shows host strings."""
    plain = text.plain
    if visible(plain, keep="\n") is plain:
        return text
    starts = []
    pieces = []
    position = 0
    for char in plain:
        starts.append(position)
        shown = visible(char, keep="\n")
        pieces.append(shown)
        position += len(shown)
    starts.append(position)
    result = text.blank_copy("".join(pieces))
    result.spans = [Span(starts[span.start], starts[min(span.end, len(plain))], span.style) for span in text.spans if span.start < len(plain)]
    return result


def cut_words(text: str, width: int) -> str:
    """`text` within `width` characters, cut after a whole word (or a whole shown escape such as \\x00) with "…";
    unchanged when it fits."""
    if len(text) <= width:
        return text
    head = text[: width - 1]
    space = head.rfind(" ")
    if space >= width // 2:
        return head[:space] + " …"
    escape_at = head.rfind("\\")  # a shown escape (\x1b, \u202e) is never split
    if escape_at >= width - 6:
        head = head[:escape_at]
    return head + "…"


def plain_cell(value: object) -> str:
    """A host string for a place that parses Rich markup (a DataTable's str cell, a Static's str): escapes shown, and
    "[" of anything that looks like a tag escaped, so the host's text shows as written and cannot style the UI."""
    return escape(visible(value))


P = ParamSpec("P")


def inert_text(builder: Callable[P, Text]) -> Callable[P, Text]:
    """A panel's text builder whose result is shown inert (see `inert`)."""

    @functools.wraps(builder)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> Text:
        return inert(builder(*args, **kwargs))

    return wrapper
