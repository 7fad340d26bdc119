"""Human output: plain aligned tables (machine output is ``--json``).

A table is as wide as the terminal (``shutil.get_terminal_size``: the
``COLUMNS`` variable, else the terminal's width, else 100 when the output is
no terminal). When its rows are wider, the widest columns (the reason
first) are wrapped onto continuation lines, breaking at spaces, then after
``/`` or ``.``; nothing is cut off, and ``--json`` holds every field whole.
"""

from __future__ import annotations

import re
import shutil
from collections.abc import Sequence

# Width when the output is no terminal (a pipe, a CI log) and COLUMNS is unset.
DEFAULT_WIDTH = 100
# A wrapped column keeps at least this many characters (or its header's).
MIN_COLUMN = 10


def table(
    headers: Sequence[str], rows: Sequence[Sequence[object]], width: int | None = None
) -> str:
    """``width``: the most characters a line may have (default: the terminal's)."""
    cells = [[str(h) for h in headers], *[[str(c) for c in r] for r in rows]]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    limit = width if width is not None else shutil.get_terminal_size((DEFAULT_WIDTH, 24)).columns
    # First down to each column's longest unbreakable piece (words stay
    # whole), then, if still too wide, further: the width wins.
    least = [min(w, max(len(h), MIN_COLUMN)) for w, h in zip(widths, cells[0], strict=True)]
    whole = [
        max(least[i], min(widths[i], max(len(p) for r in cells for p in _pieces(r[i]) or [""])))
        for i in range(len(widths))
    ]
    widths = _fit(_fit(widths, whole, limit), least, limit)
    lines = []
    for n, row in enumerate(cells):
        wrapped = [_wrap(c, w) for c, w in zip(row, widths, strict=True)]
        for k in range(max(len(w) for w in wrapped)):
            parts = [
                (w[k] if k < len(w) else "").ljust(c) for w, c in zip(wrapped, widths, strict=True)
            ]
            lines.append("  ".join(parts).rstrip())
        if n == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _fit(widths: list[int], floors: list[int], limit: int) -> list[int]:
    """Narrow the widest columns, never below their floors, until a line
    fits in ``limit`` (as close as the floors allow)."""
    widths = list(widths)
    while True:
        excess = sum(widths) + 2 * (len(widths) - 1) - limit
        narrowable = [i for i, w in enumerate(widths) if w > floors[i]]
        if excess <= 0 or not narrowable:
            return widths
        widest = max(narrowable, key=lambda i: widths[i])
        others = [widths[i] for i in narrowable if i != widest]
        target = max(floors[widest], max(others, default=0), widths[widest] - excess)
        widths[widest] = target if target < widths[widest] else widths[widest] - 1


def _pieces(text: str) -> list[str]:
    """Its words' parts, each ending after a ``/`` or ``.``: where a path or
    a dotted name may break."""
    return re.findall(r"[^\s/.]*[/.]|[^\s/.]+", text)


def _wrap(text: str, width: int) -> list[str]:
    """``text`` in lines of at most ``width`` characters, every character kept."""
    if len(text) <= width:
        return [text]
    lines: list[str] = []
    line = ""
    for word in text.split():
        units = [word] if len(word) <= width else _pieces(word)
        for i, unit in enumerate(units):
            glue = " " if line and i == 0 else ""
            if line and len(line) + len(glue) + len(unit) > width:
                lines.append(line)
                line, glue = "", ""
            while len(unit) > width:  # no place to break: split it, drop nothing
                lines.append(unit[:width])
                unit = unit[width:]
            line += glue + unit
    if line:
        lines.append(line)
    return lines
