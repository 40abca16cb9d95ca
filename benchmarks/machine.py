"""The machine lines of BENCHMARKS.md: what each result recorded of the machine it ran on, and the machine that
wrote the report (CPU, memory, OS, Python, torch and ray versions).

The first come from the JSON files alone, so the report of one folder of results reads the same wherever it is
written; the last line says where it was written, which need not be where the benches ran.
"""

from __future__ import annotations

import os
import platform
from importlib import metadata
from pathlib import Path


def recorded(result: dict) -> str:
    """What one result says of its machine: a `machine` block (bench serve, ep), else a `cpu_count`."""
    machine = result.get("machine") or {}
    if "cpu_count" in machine:
        cuda = machine.get("cuda")
        return (f"{machine['cpu_count']} logical cores, {machine.get('platform')}, Python {machine.get('python')}, "
                f"torch {machine.get('torch')}, {f'CUDA {cuda}' if cuda else 'no CUDA'}")
    if machine:
        return ", ".join(f"{k} {v}" for k, v in machine.items() if k != "note")
    if result.get("cpu_count") is not None:
        return f"{result['cpu_count']} logical cores"
    return "not recorded"


def machine_lines(results: list[tuple[str, dict]]) -> list[str]:
    """The machines the results record, each with its files, then the machine writing the report."""
    by_machine: dict[str, list[str]] = {}
    for name, result in results:
        by_machine.setdefault(recorded(result), []).append(f"`{name}.json`")
    lines = ["What the results record of the machine they ran on:", ""]
    lines += [f"- {machine}: {', '.join(names)}" for machine, names in by_machine.items()]
    return lines + ["", f"This report was written on: {this_machine()}."]


def this_machine() -> str:
    def version(package: str) -> str:
        try:
            return metadata.version(package)
        except metadata.PackageNotFoundError:
            return "not installed"

    memory = meminfo_gib()
    return (f"{cpu_model()}, {os.cpu_count()} logical cores, {f'{memory:.1f} GiB' if memory else 'memory unknown'}, "
            f"{platform.platform()}, Python {platform.python_version()}, torch {version('torch')}, "
            f"ray {version('ray')}")


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

