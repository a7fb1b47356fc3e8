"""A character canvas for plots: lines of 2x2-quadrant dots per cell, text on top, rows of (text, ink) runs out.

Plain Python, no Textual: curve_plot.py lays a plot out on it and turns the runs into Strips. A dot is addressed
in dot space, x from the left and y from the bottom (two dots per cell each way); a cell keeps the ink of the
last dot or text put in it, so curves drawn later lie over earlier ones.
"""

from __future__ import annotations

import math
from typing import Sequence

# Quadrant characters by mask: 1 upper left, 2 upper right, 4 lower left, 8 lower right.
QUADRANTS = " ▘▝▀▖▌▞▛▗▚▐▜▄▙▟█"
NO_INK = -1


def dot_index(value: float, lo: float, hi: float, dots: int) -> int:
    """The dot (0 .. dots-1) that `value` of the axis lo..hi lands on; lo the first dot, hi the last."""
    if hi == lo or dots <= 1:
        return 0
    index = math.floor(0.5 + 1e-9 + (dots - 1) * (value - lo) / (hi - lo))
    return 0 if index < 0 else dots - 1 if index >= dots else index


def dot_indices(values: Sequence[float], lo: float, hi: float, dots: int) -> list[int]:
    """dot_index of each value, in one pass."""
    if hi == lo or dots <= 1:
        return [0] * len(values)
    scale, last, shift = (dots - 1) / (hi - lo), dots - 1, 0.5 + 1e-9
    out = [math.floor(shift + (v - lo) * scale) for v in values]
    return [0 if i < 0 else last if i > last else i for i in out]


class Canvas:
    """`columns` x `rows` cells; `ink` values are the caller's indices into its own styles (NO_INK: the base style)."""

    def __init__(self, columns: int, rows: int):
        self.columns = max(0, columns)
        self.rows = max(0, rows)
        cells = self.columns * self.rows
        self.masks = [0] * cells
        self.inks = [NO_INK] * cells
        self.texts: dict[int, dict[int, str]] = {}  # row -> column -> a character that replaces the cell's dots

    def dot(self, x: int, y: int, ink: int) -> None:
        """Set the dot x (from the left) y (from the bottom) in dot space; dots off the canvas are dropped."""
        column, row = x >> 1, self.rows - 1 - (y >> 1)
        if 0 <= column < self.columns and 0 <= row < self.rows:
            cell = row * self.columns + column
            self.masks[cell] |= (1 if y & 1 else 4) << (x & 1)
            self.inks[cell] = ink

    def polyline(self, xs: Sequence[int], ys: Sequence[int], ink: int) -> None:
        """Dots joined by straight runs, in order: each step moves one dot along the longer of the two deltas."""
        if not xs:
            return
        masks, inks, columns, rows = self.masks, self.inks, self.columns, self.rows
        px, py = xs[0], ys[0]
        self.dot(px, py, ink)
        for x, y in zip(xs, ys):
            dx, dy = x - px, y - py
            steps = (dx if dx > 0 else -dx) if (dx if dx > 0 else -dx) > (dy if dy > 0 else -dy) else (dy if dy > 0 else -dy)
            twice = 2 * steps
            for i in range(1, steps + 1):
                qx = px + (2 * dx * i + steps) // twice  # dx * i / steps, rounded half up
                qy = py + (2 * dy * i + steps) // twice
                column, row = qx >> 1, rows - 1 - (qy >> 1)
                if 0 <= column < columns and 0 <= row < rows:
                    cell = row * columns + column
                    masks[cell] |= (1 if qy & 1 else 4) << (qx & 1)
                    inks[cell] = ink
            px, py = x, y

    def text(self, column: int, row: int, text: str, ink: int) -> None:
        """Write `text` from cell (column, row), row 0 at the top; what falls off the right edge is cut."""
        if not 0 <= row < self.rows:
            return
        chars = self.texts.setdefault(row, {})
        for offset, char in enumerate(text):
            at = column + offset
            if 0 <= at < self.columns:
                chars[at] = char
                self.inks[row * self.columns + at] = ink if char != " " else NO_INK

    def char_at(self, column: int, row: int) -> str:
        text = self.texts.get(row, {}).get(column)
        return text if text is not None else QUADRANTS[self.masks[row * self.columns + column]]

    def runs(self, row: int) -> list[tuple[str, int]]:
        """Row `row` (0 at the top) as runs of (characters, ink), neighbouring cells of one ink merged."""
        start, end = row * self.columns, (row + 1) * self.columns
        inks = self.inks[start:end]
        chars = [QUADRANTS[mask] for mask in self.masks[start:end]]
        for column, char in self.texts.get(row, {}).items():
            chars[column] = char
        cuts = [i for i in range(1, len(inks)) if inks[i] != inks[i - 1]]
        bounds = [0, *cuts, len(inks)]
        return [("".join(chars[a:b]), inks[a]) for a, b in zip(bounds, bounds[1:]) if b > a]
