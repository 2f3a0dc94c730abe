"""What every section of bench.md formats with: the Markdown table, a figure's cell, a workload's line."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

MIB = 1024 * 1024


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A GitHub Markdown table; numbers right-aligned, text left-aligned."""
    cells = [[str(c) for c in headers]] + [[str(c) for c in row] for row in rows]
    for row in rows:
        if len(row) != len(headers):
            raise ValueError(f"row {list(row)} has {len(row)} cells, the table has {len(headers)} columns")
    # a column is numeric when every cell is a number or "-" (not measured), and one is a number
    numeric = [
        all(_looks_numeric(row[i]) or str(row[i]) == "-" for row in rows)
        and any(_looks_numeric(row[i]) for row in rows)
        for i in range(len(headers))
    ]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]

    def line(row: list[str]) -> str:
        return "| " + " | ".join(c.rjust(w) if num else c.ljust(w) for c, w, num in zip(row, widths, numeric)) + " |"

    rule = "|" + "|".join(("-" * (w + 1) + ":") if num else ("-" * (w + 2)) for w, num in zip(widths, numeric)) + "|"
    return "\n".join([line(cells[0]), rule, *(line(row) for row in cells[1:])])


def _looks_numeric(value: Any) -> bool:
    text = str(value).strip()
    return bool(text) and text != "-" and (text[0].isdigit() or text[0] in "-+.")


def fmt(figure: dict[str, Any] | None, spec: str = ",.0f", scale: float = 1.0) -> str:
    """``median (min–max)``, or ``-`` for a figure that was not measured."""
    if figure is None:
        return "-"
    median, low, high = (scale * figure[k] for k in ("median", "min", "max"))
    if f"{low:{spec}}" == f"{high:{spec}}":
        return f"{median:{spec}}"
    return f"{median:{spec}} ({low:{spec}}–{high:{spec}})"


def workload_line(work: dict[str, Any]) -> str:
    return (
        f"`{work['model']}` hidden {work['hidden']} depth {work['depth']}, {work['in_features']} -> "
        f"{work['out_features']}, {work['rows']:,} rows, global batch {work['batch_size']}, "
        f"{work['epochs']} epoch{'s' if work['epochs'] != 1 else ''} of {work['rows'] // work['batch_size']} steps"
    )
