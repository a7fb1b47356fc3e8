"""Host text made inert for a terminal: control, escape and bidi characters shown as visible escapes (console and CLI)."""

from __future__ import annotations

import functools
import re
import sys
from typing import TextIO

# C0 controls (ESC among them), DEL, C1 controls (0x9b is a one-byte CSI), and the characters that reorder or hide text:
# bidi embeddings/overrides/isolates and marks, and the line/paragraph separators some terminals break lines at.
_UNSAFE = "\x00-\x1f\x7f-\x9f\u061c\u200e\u200f\u2028\u2029\u202a-\u202e\u2066-\u2069"
_UNSAFE_CHARS = re.compile(f"[{_UNSAFE}]")
_NAMES = {"\x1b": "ESC", "\x07": "BEL", "\x9b": "CSI", "\x9d": "OSC", "\x7f": "DEL", "\n": "newline", "\r": "carriage return", "\t": "tab"}


def escape_of(char: str) -> str:
    """How one unsafe character is shown: `\\x1b` for a control character, `\\u202e` for a bidi one."""
    code = ord(char)
    return f"\\x{code:02x}" if code <= 0xFF else f"\\u{code:04x}"


@functools.lru_cache(maxsize=8)
def _pattern(keep: str) -> re.Pattern[str]:
    if not keep:
        return _UNSAFE_CHARS
    return re.compile(f"(?![{re.escape(keep)}])[{_UNSAFE}]")


def visible(value: object, keep: str = "") -> str:
    """`value` as text in which every control, escape and bidi character (but those in `keep`, e.g. "\\t") is shown as
    its escape; ordinary text (backslashes included) comes back unchanged."""
    text = value if isinstance(value, str) else str(value)
    pattern = _pattern(keep)
    if pattern.search(text) is None:
        return text
    return pattern.sub(lambda match: escape_of(match.group()), text)


def unsafe_characters(text: str) -> list[str]:
    """The unsafe characters of `text`, each named once in order of appearance ('ESC (\\x1b)', 'U+202E (\\u202e)')."""
    found: list[str] = []
    for char in dict.fromkeys(_UNSAFE_CHARS.findall(text)):
        name = _NAMES.get(char) or (f"U+{ord(char):04X}" if ord(char) > 0xFF else "control character")
        found.append(f"{name} ({escape_of(char)})")
    return found


def say(text: object = "", *, file: TextIO | None = None, flush: bool = False) -> None:
    """print() for human-readable CLI output that carries host text: escapes shown, the output's own newlines kept."""
    print(visible(text, keep="\n"), file=file if file is not None else sys.stdout, flush=flush)
