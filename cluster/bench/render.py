"""What the reports and plots of the benchmarks share: markdown tables of values, and matplotlib on demand.

A leaf module (it imports no other bench module), so report.py, plot.py and the workload reports can all use it.
"""

from __future__ import annotations

MATPLOTLIB_MISSING = "--plot needs matplotlib: pip install 'dsa-serve[bench]'"


def require_matplotlib():
    """matplotlib.pyplot on the Agg backend; ValueError naming --plot if matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ValueError(MATPLOTLIB_MISSING) from None
    return plt


def fmt(value) -> str:
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
