"""The split between the installed benchmarks (cluster/bench/, `dsa-serve bench`) and the repository's measuring
harness (benchmarks/, `python -m benchmarks`): the harness is not installed, nothing installed imports it, and it
keeps the house rules (a docstring saying each module's job, at most 300 lines a file)."""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

from setuptools import find_packages

REPO = Path(__file__).resolve().parents[2]
INSTALLED = ("cluster", "cp_router", "model_workers")
MAX_LINES = 300


def python_files(root: str) -> list[Path]:
    return sorted(p for p in (REPO / root).rglob("*.py") if "__pycache__" not in p.parts)


def imported_names(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
    return names


def harness_imports(paths: list[Path]) -> list[str]:
    return [f"{p} imports {name}" for p in paths for name in sorted(imported_names(p))
            if name == "benchmarks" or name.startswith("benchmarks.")]


def test_the_harness_is_not_installed():
    find = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]
    packages = find_packages(str(REPO), include=find["include"], exclude=find.get("exclude", ()))
    assert "cluster.bench" in packages and "cluster" in packages
    assert not [p for p in packages if p.split(".")[0] not in INSTALLED], packages


def test_nothing_installed_imports_the_harness():
    assert harness_imports([p for root in INSTALLED for p in python_files(root)]) == []


def test_the_import_check_sees_a_harness_import(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text("import json\n\n\ndef f():\n    from benchmarks.report import build_report\n")
    assert harness_imports([probe]) == [f"{probe} imports benchmarks.report"]


def test_every_harness_module_says_its_job_and_stays_short():
    problems = []
    for path in python_files("benchmarks") + python_files("tests/soak"):
        text = path.read_text()
        if not ast.get_docstring(ast.parse(text)):
            problems.append(f"{path.relative_to(REPO)}: no module docstring")
        if len(text.splitlines()) > MAX_LINES:
            problems.append(f"{path.relative_to(REPO)}: {len(text.splitlines())} lines")
    assert problems == []
