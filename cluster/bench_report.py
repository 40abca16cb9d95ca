"""`dsa-serve bench report`: BENCHMARKS.md from a folder of bench JSON results.

Every `*.json` in --results is the one JSON object a `dsa-serve bench ... --json` command printed. The
report gives the machine, one section per result (its command, a table of its key numbers, its plot,
drawn into --plots-dir and linked relative to the report), and the targets with PASS / MISS / not
measured (`bench_targets.py`).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
from importlib import metadata
from pathlib import Path

from .bench_plot import decode_series, prefill_points, save_plot
from .bench_targets import evaluate

NO_COMMAND = "(the JSON records no command; re-run the bench with --json and a version that records it)"
BENCH_ORDER = ("prefill", "attention", "decode", "serve")


def add_parser(kinds) -> None:
    report = kinds.add_parser("report", help="write BENCHMARKS.md from a folder of bench JSON results")
    report.add_argument("--results", required=True, help="folder of *.json results (one bench command each)")
    report.add_argument("--out", default="BENCHMARKS.md", help="markdown file to write")
    report.add_argument("--plots-dir", default="docs", help="folder for the PNG plots (linked relatively)")
    report.set_defaults(run=run_report)


def load_results(folder: Path) -> tuple[list[tuple[str, dict]], list[str]]:
    """(name, result) per readable bench JSON, sorted by bench then file name; and notes on skipped files."""
    results, skipped = [], []
    for path in sorted(folder.glob("*.json")):
        try:
            result = json.loads(path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            skipped.append(f"{path.name}: not JSON ({exc})")
            continue
        if not isinstance(result, dict) or "bench" not in result:
            skipped.append(f"{path.name}: no \"bench\" key")
            continue
        results.append((path.stem, result))
    rank = {kind: i for i, kind in enumerate(BENCH_ORDER)}
    return sorted(results, key=lambda item: (rank.get(item[1]["bench"], len(rank)), item[0])), skipped


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


def attention_table(result: dict) -> list[str]:
    rows = [[r["length"], r["sparse_s"], r["sparse_indexer_s"], r["sparse_indexer_s"] / r["sparse_s"],
             r["sparse_attention_s"], r["dense_s"], r["dense_over_sparse"]] for r in result["runs"]]
    lines = markdown_table(["L", "sparse s", "indexer s", "indexer share", "gathered attention s", "dense s",
                            "dense / sparse"], rows)
    crossover = result.get("crossover_length")
    where = f"L = {crossover} ({result['crossover_over_index_topk']:g} x index_topk)" if crossover else "never"
    return lines + ["", f"index_topk = {result['index_topk']}, dtype {result.get('dtype')}, "
                        f"{result.get('threads')} thread(s); sparse faster than dense from: {where}."]


def prefill_table(result: dict) -> list[str]:
    rows = []
    for p in prefill_points(result):
        entry = p["entry"]
        speedup = p["c1_wall_s"] / p["cp_wall_s"] if p["c1_wall_s"] and p["cp_wall_s"] else None
        rows.append([p["prompt_len"], p["cp_size"], p["c1_wall_s"], p["cp_wall_s"], speedup, p["efficiency"],
                     entry.get("measured_kv_bytes_per_rank"), entry.get("formula_kv_bytes_per_rank")])
    return markdown_table(["L", "C", "C=1 wall s", "C wall s", "speedup", "efficiency", "KV bytes/rank",
                           "formula"], rows)


def decode_table(result: dict) -> list[str]:
    rows = [[r.get("speculative_num_steps"), batch, r.get("tokens_per_s"), r.get("speedup_vs_first_k"),
             r.get("mean_accepted_length"), r.get("formula_accepted_length"), r.get("engine_overhead_fraction")]
            for batch, runs in decode_series(result).items() for r in runs]
    return markdown_table(["k", "B", "tokens/s", "x vs first k", "accepted length", "formula",
                           "engine overhead"], rows)


def serve_table(result: dict) -> list[str]:
    def p50(run: dict | None, key: str):
        return ((run or {}).get(key) or {}).get("p50")

    rows = [[r.get("concurrency"), r.get("output_tokens_per_s"), p50(r, "ttft_s"), p50(r, "itl_s"),
             r.get("ttft_p50_ratio"), r.get("itl_p50_ratio"), (r.get("transformers") or {}).get("output_tokens_per_s"),
             r.get("throughput_vs_transformers")] for r in result.get("runs", [])]
    return markdown_table(["C", "tokens/s", "TTFT p50 s", "ITL p50 s", "TTFT HTTP / in-proc", "ITL HTTP / in-proc",
                           "transformers tokens/s", "x transformers"], rows)


def generic_table(result: dict) -> list[str]:
    """Any other bench: its top-level numbers, then its runs (the union of their scalar keys)."""
    scalars = [[k, v] for k, v in result.items() if isinstance(v, (int, float)) and not isinstance(v, bool)]
    lines = markdown_table(["key", "value"], scalars) if scalars else []
    runs = [r for r in result.get("runs", []) if isinstance(r, dict)]
    keys = list(dict.fromkeys(k for r in runs for k, v in r.items() if isinstance(v, (int, float, str))))
    if runs and keys:
        lines += [""] + markdown_table(keys, [[r.get(k) for k in keys] for r in runs])
    return lines


TABLES = {"attention": attention_table, "prefill": prefill_table, "decode": decode_table, "serve": serve_table}


def machine_lines() -> list[str]:
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


def result_section(name: str, result: dict, plots_dir: Path, out_dir: Path) -> list[str]:
    lines = [f"### {result['bench']}: `{name}.json`", "", "```", result.get("command") or NO_COMMAND, "```", ""]
    try:
        lines += TABLES.get(result["bench"], generic_table)(result) + [""]
    except (KeyError, TypeError, ValueError, ZeroDivisionError) as exc:  # a layout this report does not know
        lines += [f"(expected key missing: {exc!r}; all numbers:)", ""] + generic_table(result) + [""]
    plot = plots_dir / f"{name}.png"
    try:
        save_plot(result, str(plot))
        lines.append(f"![{result['bench']} {name}]({Path(os.path.relpath(plot, out_dir)).as_posix()})")
    except Exception as exc:  # noqa: BLE001 - a plot that cannot be drawn must not lose the report
        lines.append(f"(plot not drawn: {exc})")
    return lines + [""]


def targets_lines(results: list[tuple[str, dict]]) -> list[str]:
    by_kind: dict[str, list[dict]] = {}
    for _, result in results:
        by_kind.setdefault(result["bench"], []).append(result)
    rows = [[target.name, f"`bench {target.bench}`", measured, verdict]
            for target, measured, verdict in evaluate(by_kind)]
    return markdown_table(["target", "from", "measured", "verdict"], rows)


def build_report(results_dir: Path, out: Path, plots_dir: Path) -> str:
    results, skipped = load_results(results_dir)
    lines = ["# Benchmarks", "", f"Generated by `dsa-serve bench report --results {results_dir}` from "
             f"{len(results)} result file(s).", "", "## Machine", "", *machine_lines(), "", "## Targets", ""]
    lines += targets_lines(results) + ["", "## Results", ""]
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
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(build_report(results_dir, out, Path(args.plots_dir)))
    print(f"wrote {out}")
    return 0
