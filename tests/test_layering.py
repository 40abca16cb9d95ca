"""DESIGN.md section 2, enforced by reading every import with `ast` (module level, TYPE_CHECKING blocks and
function bodies alike): who may import whom, no import cycle among the project's modules, files of at most
300 lines, and no module or class named after a standard-library name."""

from __future__ import annotations

import ast
import builtins
import collections
import collections.abc
import sys
import typing
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("cluster", "cp_router", "model_workers")
MAX_LINES = 300

# (modules under this prefix, what they must not import, except these prefixes): DESIGN.md section 2's table.
RULES = [
    ("model_workers.model", ("ray", "torch.distributed", "cp_router", "cluster", "model_workers"),
     ("model_workers.model",)),
    ("model_workers.backends", ("ray", "cluster", "cp_router"), ("cp_router.cp",)),
    ("model_workers", ("cluster",), ()),
    ("cp_router.cp", ("ray", "torch.distributed", "model_workers", "cluster", "cp_router"), ("cp_router.cp",)),
    ("cp_router", ("model_workers", "torch.distributed", "ray", "cluster"), ()),
]
DISTRIBUTED_OWNER = "model_workers.comm"  # the one module that imports torch.distributed


def module_of(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def project_files(roots=PACKAGES) -> list[Path]:
    return sorted(p for root in roots for p in (REPO / root).rglob("*.py") if "__pycache__" not in p.parts)


MODULES = {module_of(p): p for p in project_files()}


def _absolute(node: ast.ImportFrom, module: str, is_package: bool) -> str:
    if node.level == 0:
        return node.module or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def imports_in(source: str, module: str, is_package: bool = False) -> list[tuple[str, int]]:
    """(imported module, line) for every import statement of `source`; `from pkg import sub` names the module
    pkg.sub when that is a project module."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            target = _absolute(node, module, is_package)
            subs = [f"{target}.{a.name}" for a in node.names if f"{target}.{a.name}" in MODULES]
            found += [(name, node.lineno) for name in subs] or [(target, node.lineno)]
    return found


def imports_of(path: Path) -> list[tuple[str, int]]:
    return imports_in(path.read_text(), module_of(path), path.name == "__init__.py")


def _under(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def violations_in(module: str, imports: list[tuple[str, int]], where: str) -> list[str]:
    """The imports of `module` its layer forbids (first matching rule of RULES), one line each."""
    problems, rule = [], next((r for r in RULES if _under(module, r[0])), None)
    for name, line in imports:
        if _under(name, "torch.distributed") and module != DISTRIBUTED_OWNER:
            problems.append(f"{where}:{line} imports {name}: only {DISTRIBUTED_OWNER} may")
        if rule is None or not any(_under(name, f) for f in rule[1]) or any(_under(name, a) for a in rule[2]):
            continue
        problems.append(f"{where}:{line} imports {name}: {rule[0]} must not import {', '.join(rule[1])}")
    return problems


def layering_violations(files: list[Path]) -> list[str]:
    return [problem for path in files
            for problem in violations_in(module_of(path), imports_of(path), str(path.relative_to(REPO)))]


def import_graph(files: list[Path]) -> dict[str, list[str]]:
    return {module_of(p): sorted({n for n, _ in imports_of(p) if n in MODULES and n != module_of(p)}) for p in files}


def import_cycles(graph: dict[str, list[str]]) -> list[list[str]]:
    """Every cycle found by a depth-first walk of an import graph (one per back edge)."""
    state, stack, cycles = {}, [], []

    def visit(node: str) -> None:
        state[node] = "open"
        stack.append(node)
        for nxt in graph.get(node, ()):
            if state.get(nxt) == "open":
                cycles.append(stack[stack.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node)
    return cycles


STDLIB_CLASS_NAMES = set(dir(builtins)) | set(typing.__all__) | set(collections.__all__) | set(collections.abc.__all__)


def naming_problems(files: list[Path]) -> list[str]:
    problems = []
    for path in files:
        stem = path.parent.name if path.name == "__init__.py" else path.stem
        if stem in sys.stdlib_module_names:
            problems.append(f"{path.relative_to(REPO)}: module named after the standard library's {stem!r}")
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and node.name in STDLIB_CLASS_NAMES:
                problems.append(f"{path.relative_to(REPO)}:{node.lineno}: class {node.name} shadows a standard name")
    return problems


def test_every_package_imports_only_what_its_layer_allows():
    assert layering_violations(project_files()) == []


def test_no_import_cycle_among_the_project_modules():
    assert import_cycles(import_graph(project_files())) == []


def test_no_source_file_is_longer_than_300_lines():
    long = {str(p.relative_to(REPO)): n for p in project_files(PACKAGES + ("tests",))
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert long == {}


def test_no_module_or_class_is_named_after_the_standard_library():
    assert naming_problems(project_files(PACKAGES + ("tests",))) == []


@pytest.mark.parametrize("module,line,expected", [
    ("model_workers.model.probe", "import ray", "model_workers.model must not import"),
    ("model_workers.model.probe", "from cp_router.scheduler import Scheduler", "model_workers.model must not import"),
    ("model_workers.runner", "import torch.distributed as dist", "only model_workers.comm may"),
    ("cp_router.cp.probe", "from model_workers.model.layers import MoE", "cp_router.cp must not import"),
    ("cp_router.cp.probe", "from cp_router.plans import StepPlan", "cp_router.cp must not import"),
    ("cp_router.engine", "import ray", "cp_router must not import"),
    ("model_workers.backends.probe", "from cp_router.scheduler import Scheduler", "model_workers.backends must not"),
    ("model_workers.cp_worker", "from cluster.launch import CPGroup", "model_workers must not import"),
])
def test_the_checks_see_a_violation(module, line, expected):
    """The rules are not vacuous: each forbidden import, placed in a module, is reported."""
    assert any(expected in problem for problem in violations_in(module, imports_in(line, module), "probe"))


def test_the_cycle_check_sees_a_cycle():
    graph = {"cp_router.a": ["cp_router.b"], "cp_router.b": ["cp_router.c"], "cp_router.c": ["cp_router.a"]}
    assert import_cycles(graph) == [["cp_router.a", "cp_router.b", "cp_router.c", "cp_router.a"]]
