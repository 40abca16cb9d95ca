"""The machine lines of BENCHMARKS.md: CPU, memory, OS, Python, torch and ray versions, when the report ran.

They describe where the report was written; the benches must run on the same machine for them to apply.
"""

from __future__ import annotations

import datetime
import os
import platform
from importlib import metadata
from pathlib import Path


def machine_lines() -> list[str]:
    """One markdown bullet per fact about this machine."""

    def version(package: str) -> str:
        try:
            return metadata.version(package)
        except metadata.PackageNotFoundError:
            return "not installed"

    memory = meminfo_gib()
    return [
        f"- CPU: {cpu_model()}, {os.cpu_count()} logical cores",
        f"- memory: {memory:.1f} GiB" if memory else "- memory: unknown",
        f"- OS: {platform.platform()}; Python {platform.python_version()}",
        f"- torch {version('torch')}, ray {version('ray')}",
        f"- report written {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC (the machine the "
        "report ran on; run the benches on the same machine)",
    ]


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def meminfo_gib() -> float | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) / (1 << 20)  # kB -> GiB
    except (OSError, ValueError):
        pass
    return None

