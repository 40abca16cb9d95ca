"""docs/architecture.md, 'Layers and who may import whom', enforced by reading every import with `ast` (module
level, TYPE_CHECKING blocks and function bodies alike): who may import whom, model families that import no other
family, no import cycle among the project's modules, files of at most 300 lines, and no module or class named
after a standard-library name."""

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
PACKAGES = ("cluster", "cp_router", "model_workers", "benchmarks")
MAX_LINES = 300

# (modules under this prefix, what they must not import, except these prefixes): the architecture page's table.
# The first rule whose prefix matches a module applies.
FAMILY_ALLOWED = ("model_workers.models", "model_workers.kernels", "model_workers.page_table", "model_workers.kv_format",
                  "model_workers.checkpoint.weight_classes", "model_workers.checkpoint.saver",
                  "model_workers.checkpoint.quantized", "cp_router.cp")
RULES = [
    ("model_workers.kernels", ("ray", "torch.distributed", "cp_router", "cluster", "model_workers"),
     ("model_workers.kernels",)),
    ("model_workers.models", ("ray", "torch.distributed", "cp_router", "cluster", "model_workers"), FAMILY_ALLOWED),
    ("model_workers", ("cluster", "ray"), ()),
    ("cp_router.cp", ("ray", "torch.distributed", "model_workers", "cluster", "cp_router"), ("cp_router.cp",)),
    ("cp_router", ("model_workers", "torch.distributed", "ray", "cluster"), ()),
]
MODELS = "model_workers.models"
SHARED_MODEL_MODULES = ("common", "family", "registry")  # not families: what every family builds with, the table
FAMILY_IMPORTERS = ("model_workers.models.registry", "model_workers.training")  # the table; the DSA tiny model's training
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


def family_of_module(name: str) -> str | None:
    """The family folder a module belongs to (model_workers.models.<family>...), None outside one."""
    parts = name.split(".")
    if len(parts) < 3 or ".".join(parts[:2]) != MODELS or parts[2] in SHARED_MODEL_MODULES:
        return None
    return parts[2]


def family_violations(module: str, imports: list[tuple[str, int]], where: str) -> list[str]:
    """A family folder importing another family; shared model code or code outside models/ importing a family
    (everything else asks models/registry.py; tests and the registry itself may name families)."""
    own, problems = family_of_module(module), []
    for name, line in imports:
        other = family_of_module(name)
        if other is None or other == own:
            continue
        if own is not None:
            problems.append(f"{where}:{line} imports {name}: family {own} must not import family {other}")
        elif not any(_under(module, allowed) for allowed in FAMILY_IMPORTERS):
            problems.append(f"{where}:{line} imports {name}: only models/registry.py may name a family")
    return problems


def layering_violations(files: list[Path]) -> list[str]:
    problems = []
    for path in files:
        module, imports, where = module_of(path), imports_of(path), str(path.relative_to(REPO))
        problems += violations_in(module, imports, where) + family_violations(module, imports, where)
    return problems


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
    ("model_workers.models.dsa.probe", "import ray", "model_workers.models must not import"),
    ("model_workers.models.dsa.probe", "from cp_router.scheduler import Scheduler", "model_workers.models must not"),
    ("model_workers.models.deepseek_v4.probe", "from model_workers.runner import ModelRunner",
     "model_workers.models must not import"),
    ("model_workers.models.common.probe", "from cluster.launch import CPGroup", "model_workers.models must not"),
    ("model_workers.kernels.torch.probe", "from model_workers.models.common.layers import Experts",
     "model_workers.kernels must not import"),
    ("model_workers.kernels.probe", "from cp_router.cp.metadata import RankMetadata", "model_workers.kernels must not"),
    ("model_workers.kernels.torch.probe", "from cluster.config import CPConfig", "model_workers.kernels must not"),
    ("model_workers.runner", "import torch.distributed as dist", "only model_workers.comm may"),
    ("model_workers.runner", "import ray", "model_workers must not import"),
    ("cp_router.cp.probe", "from model_workers.models.common.layers import MoE", "cp_router.cp must not import"),
    ("cp_router.cp.probe", "from cp_router.plans import StepPlan", "cp_router.cp must not import"),
    ("cp_router.engine", "import ray", "cp_router must not import"),
    ("model_workers.cp_worker", "from cluster.launch import CPGroup", "model_workers must not import"),
])
def test_the_checks_see_a_violation(module, line, expected):
    """The rules are not vacuous: each forbidden import, placed in a module, is reported."""
    assert any(expected in problem for problem in violations_in(module, imports_in(line, module), "probe"))


@pytest.mark.parametrize("module,line,expected", [
    ("model_workers.models.dsa.probe", "from model_workers.models.deepseek_v4.cache import V4Cache",
     "family dsa must not import family deepseek_v4"),
    ("model_workers.models.deepseek_v4.probe", "from model_workers.models.dsa import FAMILY",
     "family deepseek_v4 must not import family dsa"),
    ("model_workers.models.common.probe", "from model_workers.models.dsa.config import ModelConfig",
     "only models/registry.py may name a family"),
    ("model_workers.runner", "from model_workers.models.deepseek_v4.cache import V4Cache",
     "only models/registry.py may name a family"),
    ("cluster.engine_spec", "from model_workers.models.dsa.model import DSAForCausalLM",
     "only models/registry.py may name a family"),
])
def test_the_family_check_sees_a_violation(module, line, expected):
    """Families stay apart, and nothing but the registry picks one by importing it."""
    assert any(expected in problem for problem in family_violations(module, imports_in(line, module), "probe"))


def test_the_registry_and_a_family_importing_itself_are_allowed():
    assert family_violations("model_workers.models.registry", imports_in(
        "from model_workers.models import deepseek_v4, dsa", "model_workers.models.registry"), "probe") == []
    assert family_violations("model_workers.models.dsa.backend", imports_in(
        "from model_workers.models.dsa.cache import PagedKVCache", "model_workers.models.dsa.backend"), "probe") == []


def test_the_cycle_check_sees_a_cycle():
    graph = {"cp_router.a": ["cp_router.b"], "cp_router.b": ["cp_router.c"], "cp_router.c": ["cp_router.a"]}
    assert import_cycles(graph) == [["cp_router.a", "cp_router.b", "cp_router.c", "cp_router.a"]]
