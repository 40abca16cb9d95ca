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

from cluster.bench.plot import PLOTTERS, decode_series, prefill_points, save_plot
from cluster.bench.render import markdown_table
from cluster.bench.serve_long_report import efficiency_table, long_table
from cluster.bench.targets import evaluate

NO_COMMAND = "(the JSON records no command; re-run the bench with --json and a version that records it)"
BENCH_ORDER = ("prefill", "attention", "decode", "serve")


def add_parser(kinds) -> None:
    report = kinds.add_parser("report", help="write BENCHMARKS.md from a folder of bench JSON results")
    report.add_argument("--results", required=True, help="folder of *.json results (one bench command each)")
    report.add_argument("--out", default="BENCHMARKS.md", help="markdown file to write")
    report.add_argument("--plots-dir", default="docs", help="folder for the PNG plots (linked relatively)")
    report.add_argument("--notes", default=None, help="markdown inserted after the targets (analysis of the results)")
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
        rss = entry.get("peak_rss_bytes_per_rank")
        rows.append([p["prompt_len"], p["cp_size"], p["c1_wall_s"], entry.get("c1_cthreads_wall_s"), p["cp_wall_s"],
                     speedup, p["efficiency"], entry.get("equal_cores_ratio"),
                     entry.get("compute_imbalance_max_over_mean"), entry.get("measured_kv_bytes_per_rank"),
                     entry.get("formula_kv_bytes_per_rank"), max(rss) / 2**30 if rss else None])
    lines = markdown_table(["L", "C", "C=1 1 thread s", "C=1 C threads s", "C ranks s", "speedup",
                            "strong-scaling eff.", "equal-cores ratio", "compute max/mean", "KV gather bytes/rank",
                            "formula", "peak RSS/rank GiB"], rows)
    return lines + [""] + prefill_detail(result)


def prefill_detail(result: dict) -> list[str]:
    """Causal-work imbalance per layout and the phase split, per length (new layout only)."""
    entries = result.get("lengths") or []
    if not entries:
        return []
    lines = served_and_one_batch(result, entries)
    layouts = ("zigzag", "interleave", "contiguous")
    rows = [[e["prompt_len"], *[e.get("modeled_causal_work_imbalance", {}).get(k) for k in layouts],
             e.get("compute_imbalance_max_over_mean")] for e in entries]
    lines += ["Causal work max/mean per rank (model: causal query-key pairs each rank's indexer scores), next to "
             f"the measured compute max/mean of this run ({result.get('cp_strategy')}):", ""]
    lines += markdown_table(["L", *[f"{k} (model)" for k in layouts], "measured"], rows)
    phases = ("indexer", "attention", "mlp", "communication", "other")
    rows = []
    for e in entries:
        rows.append([e["prompt_len"], "C=1", *[e.get("c1_phase_s", {}).get(k) for k in phases]])
        for rank, split in enumerate(e.get("per_rank_phase_s") or []):
            rows.append([e["prompt_len"], f"rank {rank}", *[split.get(k) for k in phases]])
    lines += ["", "Time split per phase (seconds; indexer = indexer projections + scoring + top-k):", ""]
    lines += markdown_table(["L", "run", *phases], rows)
    blocks = [b for b in (e.get("prefill_flop_efficiency") for e in entries) if b and not b.get("skipped")]
    if blocks:
        lines += ["", "FLOP efficiency of the C ranks' served prefill (definitions in the JSON):", ""]
        lines += efficiency_table(blocks)
    if result.get("measured_kv_bytes_per_token") is not None:
        lines += ["", f"KV cache bytes per token: measured {result['measured_kv_bytes_per_token']}, formula "
                      f"{result.get('formula_kv_bytes_per_token')} = {result.get('kv_token_formula')}."]
    return lines


def served_and_one_batch(result: dict, entries: list[dict]) -> list[str]:
    """The served path (chunked, the table above) next to the same prompt prefilled as one batch."""
    rows = [[e["prompt_len"], e.get("chunks"), e["c1_wall_s"], e["cp_wall_s"], e["strong_scaling_efficiency"],
             e["one_batch"]["c1_wall_s"], e["one_batch"]["cp_wall_s"], e["one_batch"]["strong_scaling_efficiency"]]
            for e in entries if e.get("one_batch")]
    if not rows:
        return []
    lines = [f"Served path (chunks of {result.get('prefill_chunk_tokens')} tokens, as `serve` runs prefill; the "
             "table above) against the same prompt as one unchunked batch:", ""]
    return lines + markdown_table(["L", "chunks", "served C=1 s", "served C ranks s", "served eff.", "one batch C=1 s",
                                   "one batch C ranks s", "one batch eff."], rows) + [""]


def decode_table(result: dict) -> list[str]:
    rows = [[r.get("speculative_num_steps"), batch, r.get("tokens_per_s"), r.get("speedup_vs_first_k"),
             r.get("mean_accepted_length"), r.get("formula_accepted_length"), r.get("per_position_acceptance"),
             r.get("draft_cost_c"), r.get("verify_cost_v"), r.get("predicted_speedup"),
             r.get("engine_overhead_fraction")]
            for batch, runs in decode_series(result).items() for r in runs]
    lines = markdown_table(["k", "B", "tokens/s", "x vs k=0", "accepted length E", "(1-a^(k+1))/(1-a)",
                            "per-position acceptance", "draft cost c", "verify cost v", "E/(k·c+v)",
                            "engine overhead"], rows)
    return lines + ["", f"Engine: {result.get('engine', 'in-process worker')}; dtype {result.get('dtype')}; "
                        f"c and v in plain decode steps of the same batch size."]


def serve_table(result: dict) -> list[str]:
    if result.get("workload") == "long":
        return long_table(result)

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


def kv_cache_table(result: dict) -> list[str]:
    rows = [[name, e["measured_kv_bytes_per_token"], e["formula_kv_bytes_per_token"], e["tokens_per_gib"]]
            for name, e in result["kv"].items()]
    lines = markdown_table(["KV cache", "bytes / token (measured)", "formula", "tokens per GiB"], rows)
    agreement, delta = result["top1_agreement"], result["mean_abs_delta_logprob"]
    return lines + ["", f"FP8 against bf16 over {result['positions']} greedy positions of held-out prompts: top-1 "
                        f"agreement {agreement:.2%}, mean |Δ logprob| {delta}"
                        f" (p99 {result['p99_abs_delta_logprob']}, max {result['max_abs_delta_logprob']}); FP8 holds "
                        f"{result['fp8_capacity_gain']}x the tokens."]


TABLES = {"attention": attention_table, "prefill": prefill_table, "decode": decode_table, "serve": serve_table,
          "kv-cache": kv_cache_table}


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


def model_line(result: dict) -> str:
    """Which model the result ran on, from its `model_fingerprint` (results from before it say so)."""
    fingerprint = result.get("model_fingerprint")
    if not fingerprint:
        return "Model: not recorded in this result."
    sha = fingerprint.get("weights_sha256")
    return (f"Model: {fingerprint.get('num_hidden_layers')} decoder layers, weights sha256 "
            f"{f'`{sha}`' if sha else 'not in a model card'}.")


def result_section(name: str, result: dict, plots_dir: Path, out_dir: Path) -> list[str]:
    lines = [f"### {result['bench']}: `{name}.json`", "", "```", result.get("command") or NO_COMMAND, "```", "",
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


def build_report(results_dir: Path, out: Path, plots_dir: Path, notes: Path | None = None) -> str:
    results, skipped = load_results(results_dir)
    lines = ["# Benchmarks", "", f"Generated by `dsa-serve bench report --results {results_dir}` from "
             f"{len(results)} result file(s); reproduce everything with `make bench`.", "", "## Machine", "",
             *machine_lines(), "", "## Targets", ""]
    lines += targets_lines(results) + [""]
    if notes is not None:
        lines += [notes.read_text().rstrip(), ""]
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
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    notes = Path(args.notes) if args.notes else None
    if notes is not None and not notes.is_file():
        raise ValueError(f"--notes must be a markdown file, got {args.notes!r}")
    out.write_text(build_report(results_dir, out, Path(args.plots_dir), notes))
    print(f"wrote {out}")
    return 0
