"""BENCHMARKS.md stays a generated page: notes are linked, not embedded (a folder of pages) or inserted (one file);
results recorded before the harness moved show the command that reproduces them now; and the report of the
repository's bench-results/ stays under 40 KB, as does the BENCHMARKS.md checked in."""

from __future__ import annotations

from pathlib import Path

import pytest

import benchmarks.report as report
from benchmarks.cli import main

REPO = Path(__file__).resolve().parents[2]
SOAK = {"bench": "soak", "command": "dsa-serve bench soak --duration-s 600.0 --serve-args '' --json"}
SERVE = {"bench": "serve", "command": "dsa-serve bench serve --engine-placement colocated --json",
         "transformers": {"skipped": False}, "runs": []}


def test_a_notes_folder_is_linked_page_by_page_by_title(tmp_path):
    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "speculation.md").write_text("# Speculation at batch 1\n\nlong text that stays here\n")
    (notes / "README.md").write_text("# Bench notes\n\nthe index\n")
    (notes / "untitled.md").write_text("no heading\n")
    results = tmp_path / "results"
    results.mkdir()
    out = tmp_path / "out" / "B.md"
    assert main(["report", "--results", str(results), "--out", str(out), "--notes", str(notes)]) == 0
    text = out.read_text()
    assert "- [Bench notes](../notes/README.md)\n- [Speculation at batch 1](../notes/speculation.md)\n" \
           "- [untitled](../notes/untitled.md)" in text
    assert "long text that stays here" not in text
    assert text.index("## Targets") < text.index("## Notes") < text.index("## Results")


def test_notes_that_are_neither_file_nor_folder_exit_2(tmp_path, capsys):
    assert main(["report", "--results", str(tmp_path), "--notes", str(tmp_path / "missing.md")]) == 2
    assert "--notes must be a markdown file or a folder" in capsys.readouterr().err


@pytest.mark.parametrize("result, command", [
    (SOAK, "python -m benchmarks soak --duration-s 600.0 --serve-args '' --json"),
    (SERVE, "python -m benchmarks serve --engine-placement colocated --json"),  # it ran the transformers baseline
    ({**SERVE, "workload": "long", "transformers": {"skipped": True}}, "python -m benchmarks serve --engine-placement "
                                                                     "colocated --json"),
    ({**SERVE, "transformers": {"skipped": True, "reason": "--skip-transformers"}}, SERVE["command"]),
    ({"bench": "decode", "command": "dsa-serve bench decode --json"}, "dsa-serve bench decode --json"),
    ({**SOAK, "command": "python -m benchmarks soak --json"}, "python -m benchmarks soak --json"),
    ({"bench": "decode"}, report.NO_COMMAND),
])
def test_each_result_shows_the_command_that_reproduces_it_now(result, command):
    assert report.reproducing_command(result) == command


def test_the_report_of_bench_results_stays_under_40_kb(monkeypatch):
    """What `make bench` writes, from the checked-in results and notes (the plots' links, not their drawing)."""
    monkeypatch.setattr(report, "save_plot", lambda result, path: None)
    text = report.build_report(REPO / "bench-results", REPO / "BENCHMARKS.md", REPO / "docs" / "bench",
                               REPO / "docs" / "bench_notes")
    assert len(text.encode()) <= report.MAX_BYTES
    results, skipped = report.load_results(REPO / "bench-results")
    assert len(results) >= 20 and skipped == []
    assert all(f"`{name}.json`" in text for name, _ in results) and "## Notes" in text
    assert (REPO / "BENCHMARKS.md").stat().st_size <= report.MAX_BYTES
