"""Aligned text tables and markdown tables: the one renderer of every report's tables.

Owns: `text_table` (columns padded to their widest cell, joined by two spaces, each line
right-stripped; optional dash rule under the header, optional indent) and `markdown_table` (the
same cells as a GitHub markdown table). The diff summary, the memory report and the benchmark
reports all render through these two functions.

Invariants:
- A column's width is its widest cell, header included, in `len` characters; a cell is
  left-aligned unless its column index is in `right`.
- The output is a function of the cells alone (no terminal width, no wrapping, no styling), so a
  report renders the same bytes on a terminal, in a pipe and in a file.
- Imports nothing beyond the standard library (the kernel device check uses it without flax).

NOTE: not rich's `Table`: it sizes columns against the console width (wrapping or cropping wide
reports), and its stock boxes draw the header rule across the column gaps, where these reports
keep one dash rule per column.
"""

from __future__ import annotations

from collections.abc import Sequence


def text_table(
    headers: Sequence[str],
    rows: Sequence[Sequence[object]],
    *,
    right: Sequence[int] = (),
    rule: bool = False,
    indent: str = "",
) -> list[str]:
    """The table's lines: header, the dash rule when `rule`, then one line per row.

    Every row has as many cells as `headers`; cells are `str()`-ed. `right`: indices of the
    right-aligned columns. `indent` prefixes every line (before the right-strip of the rest)."""
    cells = [[str(c) for c in r] for r in rows]
    widths = [max(len(x) for x in col) for col in zip(headers, *cells)]

    def line(row: Sequence[str]) -> str:
        padded = (c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths)))
        return indent + "  ".join(padded).rstrip()

    out = [line(headers)]
    if rule:
        out.append(line(["-" * w for w in widths]))
    return out + [line(r) for r in cells]


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[object]], *, right: Sequence[int] = ()) -> list[str]:
    """The table as GitHub markdown lines (`right` columns right-aligned); `|` in a cell is escaped."""

    def line(row: Sequence[object]) -> str:
        return "| " + " | ".join(str(c).replace("|", "\\|") for c in row) + " |"

    align = ["---:" if i in right else "---" for i in range(len(headers))]
    return [line(headers), "|" + "|".join(align) + "|", *(line(r) for r in rows)]
