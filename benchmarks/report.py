"""`python -m benchmarks report`: BENCHMARKS.md from a folder of bench JSON results.

Every `*.json` in --results is the one JSON object a bench command printed with --json (`dsa-serve bench ...` or
`python -m benchmarks ...`). The report gives the machine, the targets with PASS / MISS / not measured
(targets.py, each with the command that measures it), the notes (--notes: a folder of markdown pages, one per
topic, linked by title; or one markdown file, inserted as it is), then one section per result: the command that
reproduces it, a table of its key numbers (tables.py) and its plot, drawn into --plots-dir and linked relative to
the report. Everything in it comes from the JSON files and the notes, so the same folder gives the same report
(but for its last machine line, which says where it was written).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
from pathlib import Path

from benchmarks import HARNESS_PROGRAM
from benchmarks.machine import machine_lines
from benchmarks.markdown import markdown_table
from benchmarks.serve_long_report import plot_long
from benchmarks.tables import TABLES, generic_table
from benchmarks.targets import evaluate
from cluster.bench.plot import PLOTTERS
from cluster.bench.plot import save_plot as save_result_plot
from cluster.bench.render import require_matplotlib

REPO = Path(__file__).resolve().parents[1]
NO_COMMAND = "(the JSON records no command; re-run the bench with --json and a version that records it)"
BENCH_ORDER = ("prefill", "attention", "decode", "serve")
MAX_BYTES = 40 * 1024  # what BENCHMARKS.md may weigh (tests/bench/test_bench_report_size.py holds it there)


def add_parser(kinds) -> None:
    report = kinds.add_parser("report", help="write BENCHMARKS.md from a folder of bench JSON results")
    report.add_argument("--results", required=True, help="folder of *.json results (one bench command each)")
    report.add_argument("--out", default="BENCHMARKS.md", help="markdown file to write")
    report.add_argument("--plots-dir", default="docs", help="folder for the PNG plots (linked relatively)")
    report.add_argument("--notes", default=None, help="a folder of markdown notes (each linked by its title) or one "
                                                      "markdown file (inserted after the targets)")
    report.set_defaults(run=run_report)


def read_result(path: Path):
    """A bench's `--json` stdout: the whole file, or (Ray may print lines of its own first) its last line."""
    text = path.read_text()
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        lines = text.strip().splitlines()
        if len(lines) < 2:
            raise
        return json.loads(lines[-1])


def load_results(folder: Path) -> tuple[list[tuple[str, dict]], list[str]]:
    """(name, result) per readable bench JSON, sorted by bench then file name; and notes on skipped files."""
    results, skipped = [], []
    for path in sorted(folder.glob("*.json")):
        try:
            result = read_result(path)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            skipped.append(f"{path.name}: not JSON ({exc})")
            continue
        if not isinstance(result, dict) or "bench" not in result:
            skipped.append(f"{path.name}: no \"bench\" key")
            continue
        results.append((path.stem, result))
    rank = {kind: i for i, kind in enumerate(BENCH_ORDER)}
    return sorted(results, key=lambda item: (rank.get(item[1]["bench"], len(rank)), item[0])), skipped


def in_harness(result: dict) -> bool:
    """Whether the result's command runs in this harness: the soak, and `serve` with a `transformers` comparison
    (the long workload always has one)."""
    if result["bench"] == "soak":
        return True
    baseline = result.get("transformers") or {}
    return result["bench"] == "serve" and (result.get("workload") == "long" or not baseline.get("skipped", True))


def reproducing_command(result: dict) -> str:
    """The result's command as it runs today. Results recorded before the harness left the package name `dsa-serve
    bench soak` or a `dsa-serve bench serve` with its `transformers` comparison: `python -m benchmarks` takes the
    same flags."""
    command = result.get("command")
    if not command:
        return NO_COMMAND
    words = shlex.split(command)
    if words[:2] == ["dsa-serve", "bench"] and in_harness(result):
        return shlex.join([*shlex.split(HARNESS_PROGRAM), *words[2:]])
    return command


def save_plot(result: dict, path: str) -> None:
    """A result's plot: the installed bench's (cluster/bench/plot.py), or the long workload's (serve_long_report)."""
    if result.get("bench") == "serve" and result.get("workload") == "long":
        require_matplotlib()
        plot_long(result, path)
        return
    save_result_plot(result, path)


def model_line(result: dict) -> str:
    """Which model the result ran on, from its `model_fingerprint` (results from before it say so)."""
    fingerprint = result.get("model_fingerprint")
    if not fingerprint:
        return "Model: not recorded."
    sha = fingerprint.get("weights_sha256")
    return (f"Model: {fingerprint.get('num_hidden_layers')} decoder layers, weights sha256 "
            f"{f'`{sha}`' if sha else 'not in a model card'}.")


def relative(path: Path, out_dir: Path) -> str:
    return Path(os.path.relpath(path, out_dir)).as_posix()


def result_section(name: str, result: dict, plots_dir: Path, out_dir: Path) -> list[str]:
    lines = [f"### {result['bench']}: `{name}.json`", "", "```", reproducing_command(result), "```", "",
             model_line(result), ""]
    try:
        lines += TABLES.get(result["bench"], generic_table)(result) + [""]
    except (KeyError, TypeError, ValueError, ZeroDivisionError) as exc:  # a layout this report does not know
        lines += [f"(expected key missing: {exc!r}; all numbers:)", ""] + generic_table(result) + [""]
    if result["bench"] not in PLOTTERS:
        return lines
    plot = plots_dir / f"{name}.png"
    try:
        save_plot(result, str(plot))
        lines.append(f"![{result['bench']} {name}]({relative(plot, out_dir)})")
    except Exception as exc:  # noqa: BLE001 - a plot that cannot be drawn must not lose the report
        lines.append(f"(plot not drawn: {exc})")
    return lines + [""]


def targets_lines(results: list[tuple[str, dict]]) -> list[str]:
    by_kind: dict[str, list[dict]] = {}
    for _, result in results:
        by_kind.setdefault(result["bench"], []).append(result)
    rows = [[target.name, f"`{target.source}`", measured, verdict] for target, measured, verdict in evaluate(by_kind)]
    return ["Each target is judged on every result below that measures it; \"from\" names the command that makes "
            "such a result (each result's own command is in its section).", ""] + markdown_table(
        ["target", "from", "measured", "verdict"], rows)


def page_title(page: Path) -> str:
    """A markdown page's first `# ` heading, else its file name."""
    heading = next((line for line in page.read_text().splitlines() if line.startswith("# ")), None)
    return heading[2:].strip() if heading else page.stem


def notes_lines(notes: Path | None, out_dir: Path) -> list[str]:
    """One markdown file as it is, or a folder's pages as links (its README.md first): the report stays small and
    the investigations stay where they are written."""
    if notes is None:
        return []
    if notes.is_file():
        return [notes.read_text().rstrip(), ""]
    pages = sorted(notes.glob("*.md"), key=lambda p: (p.name != "README.md", p.name))
    return ["## Notes", "", "Investigations and dated runs, written by hand from these results, one page per topic:",
            "", *[f"- [{page_title(p)}]({relative(p, out_dir)})" for p in pages], ""]


def build_report(results_dir: Path, out: Path, plots_dir: Path, notes: Path | None = None) -> str:
    results, skipped = load_results(results_dir)
    method = relative(REPO / "docs" / "benchmarks.md", out.parent)
    lines = ["# Benchmarks", "", f"Generated by `{HARNESS_PROGRAM} report --results {results_dir}` from "
             f"{len(results)} result file(s); reproduce everything with `make bench`. What each benchmark measures, "
             f"how the targets are judged and how much the numbers move between runs: [{method}]({method}).", "",
             "## Machine", "", *machine_lines(results), "", "## Targets", ""]
    lines += targets_lines(results) + [""]
    lines += notes_lines(notes, out.parent)
    lines += ["## Results", ""]
    if not results:
        lines += ["No bench results found: every bench is not measured.", ""]
    for name, result in results:
        lines += result_section(name, result, plots_dir, out.parent)
    if skipped:
        lines += ["## Skipped files", "", *[f"- {note}" for note in skipped], ""]
    return "\n".join(lines)


def run_report(args: argparse.Namespace) -> int:
    results_dir = Path(args.results)
    if not results_dir.is_dir():
        raise ValueError(f"--results must be a folder of bench JSON files, got {args.results!r}")
    notes = Path(args.notes) if args.notes else None
    if notes is not None and not (notes.is_file() or notes.is_dir()):
        raise ValueError(f"--notes must be a markdown file or a folder of them, got {args.notes!r}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(build_report(results_dir, out, Path(args.plots_dir), notes))
    size = out.stat().st_size
    over = f", over the {MAX_BYTES // 1024} KB it may weigh" if size > MAX_BYTES else ""
    print(f"wrote {out} ({size / 1024:.1f} KB{over})")
    return 0
