"""Markdown tables of values for BENCHMARKS.md (report.py, tables.py, serve_long_report.py): a leaf module."""

from __future__ import annotations


def fmt(value) -> str:
    """A table cell: 4 significant digits for floats, `–` for a missing value, lists joined by commas."""
    if value is None:
        return "–"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, list):
        return ", ".join(fmt(v) for v in value)
    return str(value)


def markdown_table(headers: list[str], rows: list[list]) -> list[str]:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    return lines + ["| " + " | ".join(fmt(v) for v in row) + " |" for row in rows]
