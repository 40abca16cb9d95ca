"""matplotlib on demand for the benchmarks' `--plot FILE.png` (plot.py, serve_result.py, and the harness's plots).

A leaf module (it imports no other bench module), so every plotting module can use it.
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
