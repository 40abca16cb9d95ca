"""Every repository path named in a docstring, README or docs page exists, and none of them cites a file outside
the repository.

Scanned: README.md, docs/**/*.md, deploy/README.md, and the module, class and function docstrings (read with
`ast`) of every .py under cluster/, cp_router/, model_workers/, benchmarks/ and tests/. A repository path is a
token that starts with a top-level folder (`cp_router/cp/metadata.py`) or names a top-level file (`Makefile`).
Globs must match at least one file; tokens holding a placeholder (`<family>`, `{id}`) are skipped; trailing
punctuation, `path:line` and `path::name` are cut off. Markdown links relative to a page must resolve too. The
design notes that lived outside the repository may not be cited anywhere in those files, comments and help texts
included: the docs pages took their place.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
TOP_FOLDERS = ("cluster", "cp_router", "model_workers", "deploy", "docs", "tests", "benchmarks", "bench-results")
TOP_FILES = ("README.md", "BENCHMARKS.md", "Makefile", "pyproject.toml")
CODE_ROOTS = ("cluster", "cp_router", "model_workers", "benchmarks", "tests")
# Files outside the repository that a clone does not have: no scanned file may cite them, in a docstring, a comment
# or a help text. (The names are split here so that this file does not cite them either.)
SHARED, DESIGN, V4_NOTE = ".." + "/shared/", "DESIGN", "deepseek_v4" + ".md"
OUTSIDE_CITATIONS = re.compile(r"(?:\.\./)+shared/[\w./\-]*|\b" + DESIGN + r"(?:\.md\b|\s*§|\s+section\b)|\b"
                               + re.escape(V4_NOTE) + r"\b")

_BOUNDARY = r"(?<![\w./\-])"  # not inside a longer path, a URL or a word
PATH_TOKEN = re.compile(_BOUNDARY + r"(?:" + "|".join(map(re.escape, TOP_FOLDERS)) + r")/[^\s`'\"()\[\],;|]*")
FILE_TOKEN = re.compile(_BOUNDARY + r"(?:" + "|".join(map(re.escape, TOP_FILES)) + r")(?![\w\-])")
MARKDOWN_LINK = re.compile(r"\]\(([^)\s]+)\)")
HEADING_CITATION = re.compile(r"(docs/[\w/\-]+\.md),? ['\"]([^'\"\n]+)['\"]")  # docs/models.md, 'What a family provides'
PLACEHOLDER = re.compile(r"[<>{}]|\$\(|\.\.\.")


def doc_files(repo: Path = REPO) -> list[Path]:
    docs = sorted((repo / "docs").rglob("*.md")) if (repo / "docs").is_dir() else []
    return [p for p in [repo / "README.md", *docs, repo / "deploy" / "README.md"] if p.is_file()]


def code_files(repo: Path = REPO) -> list[Path]:
    return sorted(p for root in CODE_ROOTS if (repo / root).is_dir() for p in (repo / root).rglob("*.py")
                  if "__pycache__" not in p.parts)


def docstrings(source: str) -> list[tuple[int, str]]:
    """(line, text) of the module's docstring and of every class's and function's."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            text = ast.get_docstring(node, clean=False)
            if text is not None:
                found.append((node.body[0].lineno, text))
    return found


def clean(token: str) -> str | None:
    """The path a token names: `path:line` and `path::name` cut, trailing punctuation dropped; None for a
    placeholder."""
    if PLACEHOLDER.search(token):
        return None
    token = token.split("::")[0]
    token = re.sub(r":\d[\d\-,]*$", "", token.split("#")[0])
    return token.rstrip(".:!?")


def paths_in(text: str) -> list[str]:
    """Every repository path a text names, cleaned, in order of appearance."""
    tokens = [m.group(0) for m in PATH_TOKEN.finditer(text)] + [m.group(0) for m in FILE_TOKEN.finditer(text)]
    return [path for path in map(clean, tokens) if path]


def exists(path: str, repo: Path = REPO) -> bool:
    """A file or folder of the repository; a glob matches at least one."""
    if any(ch in path for ch in "*?["):
        return next(iter(repo.glob(path)), None) is not None
    return (repo / path).exists()


def missing_in_text(text: str, where: str, repo: Path = REPO) -> list[str]:
    return [f"{where}: {path}" for path in dict.fromkeys(paths_in(text)) if not exists(path, repo)]


def headings(page: Path) -> list[str]:
    """The headings of a markdown page (outside code fences), backticks dropped."""
    found, fence = [], False
    for line in page.read_text().splitlines():
        if line.startswith("```"):
            fence = not fence
        elif not fence and (m := re.match(r"#{1,6}\s+(.*?)\s*$", line)):
            found.append(m.group(1).replace("`", ""))
    return found


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def broken_links(page: Path, repo: Path = REPO) -> list[str]:
    """Markdown links of a page to a file of the repository (relative to the page) that is not there, or to a
    heading (`#anchor`) that page does not have."""
    problems = []
    for target in MARKDOWN_LINK.findall(page.read_text()):
        if re.match(r"[a-z]+:", target):
            continue  # a URL or a mail address
        file_part, _, anchor = target.partition("#")
        resolved = (page.parent / file_part).resolve() if file_part else page
        if not resolved.exists():
            problems.append(f"{page.relative_to(repo)}: link {target}")
        elif anchor and resolved.suffix == ".md" and anchor not in map(slug, headings(resolved)):
            problems.append(f"{page.relative_to(repo)}: link {target}: no such heading")
    return problems


def missing_headings(text: str, where: str, repo: Path = REPO) -> list[str]:
    """Citations of a docs page's section by its heading (`docs/kv_cache.md, 'FP8 layout'`) that the page lacks."""
    return [f"{where}: {page}, '{heading}'" for page, heading in HEADING_CITATION.findall(text)
            if (repo / page).is_file() and heading not in headings(repo / page)]


def outside_citations(text: str, where: str) -> list[str]:
    return [f"{where}:{text.count(chr(10), 0, m.start()) + 1}: cites {m.group(0)}"
            for m in OUTSIDE_CITATIONS.finditer(text)]


def whole_files(repo: Path = REPO) -> list[tuple[str, str]]:
    """(where, text) of every scanned document and source file, whole: where outside citations are looked for."""
    return [(str(p.relative_to(repo)), p.read_text()) for p in doc_files(repo) + code_files(repo)]


def sources(repo: Path = REPO) -> list[tuple[str, str]]:
    """(where, text) of every scanned document and docstring."""
    found = [(str(p.relative_to(repo)), p.read_text()) for p in doc_files(repo)]
    for path in code_files(repo):
        for line, text in docstrings(path.read_text()):
            found.append((f"{path.relative_to(repo)}:{line}", text))
    return found


def missing_paths(repo: Path = REPO) -> list[str]:
    return [problem for where, text in sources(repo) for problem in missing_in_text(text, where, repo)]


def test_every_repository_path_named_in_the_docs_and_docstrings_exists():
    assert missing_paths() == []


def test_every_docs_section_cited_by_its_heading_exists():
    assert [problem for where, text in sources() for problem in missing_headings(text, where)] == []


def test_every_relative_link_of_a_docs_page_resolves():
    assert [problem for page in doc_files() for problem in broken_links(page)] == []


def test_no_document_or_source_file_cites_a_file_outside_the_repository():
    assert [problem for where, text in whole_files() for problem in outside_citations(text, where)] == []


# The checker itself: it must see what it is for, so that an empty list above means something.

def test_the_checker_reports_a_missing_path():
    text = "See `cp_router/cp/no_such_module.py` and cp_router/cp/metadata.py."
    assert missing_in_text(text, "probe") == ["probe: cp_router/cp/no_such_module.py"]


@pytest.mark.parametrize("text, expected", [
    ("`cp_router/cp/metadata.py:120` and cp_router/cp/sharding.py:10-12", ["cp_router/cp/metadata.py",
                                                                           "cp_router/cp/sharding.py"]),
    ("tests/test_layering.py::test_the_checks_see_a_violation", ["tests/test_layering.py"]),
    ("lives in cp_router/cp/, see README.md.", ["cp_router/cp/", "README.md"]),
    ("(docs/architecture.md#invariants)", ["docs/architecture.md"]),
    ("model_workers/models/<family>/ and cluster/http_api/{name}.py", []),
    ("https://example.com/docs/x.md and ../tests/x.py and my_cluster/x", []),
    ("the Makefile, pyproject.toml and BENCHMARKS.md", ["BENCHMARKS.md", "Makefile", "pyproject.toml"]),
])
def test_the_checker_finds_and_cleans_tokens(text, expected):
    assert sorted(paths_in(text)) == sorted(expected)


def test_a_glob_needs_one_match(tmp_path):
    (tmp_path / "docs" / "bench").mkdir(parents=True)
    (tmp_path / "docs" / "bench" / "a.png").write_bytes(b"")
    assert exists("docs/bench/*.png", tmp_path)
    assert not exists("docs/bench/*.svg", tmp_path)


def test_docstrings_are_read_from_modules_classes_and_functions():
    source = '"""Module: cluster/a.py."""\nclass C:\n    """Class: cluster/b.py."""\n' \
             '    def f(self):\n        """Function: cluster/c.py."""\n        x = "not a docstring: cluster/d.py"\n'
    assert [paths_in(text) for _, text in docstrings(source)] == [["cluster/a.py"], ["cluster/b.py"], ["cluster/c.py"]]


def test_the_checker_sees_a_citation_outside_the_repository_and_a_broken_link(tmp_path):
    assert outside_citations(SHARED + DESIGN + ".md section 4", "probe") == [f"probe:1: cites {SHARED}{DESIGN}.md"]
    assert outside_citations(f"see\n{V4_NOTE} section 3", "probe") == [f"probe:2: cites {V4_NOTE}"]
    assert outside_citations(f"# {DESIGN} §10 layout; {DESIGN} section 5", "probe") == [
        f"probe:1: cites {DESIGN} §", f"probe:1: cites {DESIGN} section"]
    assert outside_citations("docs/architecture.md, 'The engine spec'; models/deepseek_v4/", "probe") == []
    (tmp_path / "docs").mkdir()
    page = tmp_path / "docs" / "x.md"
    page.write_text("# The `top` part\n[ok](x.md) [web](https://example.com) [anchor](#the-top-part) [gone](y.md#part)"
                    " [lost](x.md#no-part)\n```\n# not a heading\n```\n")
    assert broken_links(page, tmp_path) == ["docs/x.md: link y.md#part", "docs/x.md: link x.md#no-part: no such heading"]
    cited = "see docs/x.md, 'The top part' and docs/x.md, 'not a heading'"
    assert missing_headings(cited, "probe", tmp_path) == ["probe: docs/x.md, 'not a heading'"]
