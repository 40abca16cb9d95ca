"""The long workload's rendering: its table for the report, its text summary, its plot; and the
`prefill_flop_efficiency` table that the report (report.py) also shows for `bench prefill` results.

The plot has two panels against prompt length: TTFT p50 and output tokens/s, ours (solid) and `transformers`
(dashed), one line per concurrency.
"""

from __future__ import annotations

import math
from pathlib import Path

from benchmarks.markdown import markdown_table
from cluster.bench.flops import PHASES
from cluster.bench.render import require_matplotlib

LONG_HEADERS = ["L", "C", "TTFT p50 s", "TTFT p90 s", "tokens/s", "transformers TTFT p50 s", "transformers TTFT p90 s",
                "transformers tokens/s", "x tokens/s", "TTFT / transformers"]


def _get(run: dict | None, key: str, q: str | None = None):
    value = (run or {}).get(key)
    return (value or {}).get(q) if q else value


def long_rows(result: dict) -> list[list]:
    """One row per (length, concurrency): ours, then transformers, then the two ratios (LONG_HEADERS)."""
    rows = []
    for run in result.get("runs", []):
        theirs = run.get("transformers")
        rows.append([run["prompt_len"], run["concurrency"], _get(run, "ttft_s", "p50"), _get(run, "ttft_s", "p90"),
                     run.get("output_tokens_per_s"), _get(theirs, "ttft_s", "p50"), _get(theirs, "ttft_s", "p90"),
                     _get(theirs, "output_tokens_per_s"), run.get("throughput_ratio_vs_transformers"),
                     run.get("ttft_ratio_vs_transformers")])
    return rows


def skipped_notes(result: dict) -> list[str]:
    """Why a comparison is missing: the transformers baseline or one of its lengths skipped."""
    baseline = result.get("transformers") or {}
    if baseline.get("skipped"):
        return [f"transformers skipped: {baseline.get('reason')}"]
    notes = [f"transformers L={e['prompt_len']} skipped: {e.get('reason')}" for e in baseline.get("lengths", [])
             if e.get("skipped")]
    tried = baseline.get("dtypes_tried") or {}
    probes = ", ".join(f"{d} {p['e2e_s']:.3g} s" if "e2e_s" in p else f"{d} failed" for d, p in tried.items())
    return notes + [f"transformers dtype {baseline.get('dtype')} (probe at L={baseline.get('probe_prompt_len')}: "
                    f"{probes}), {baseline.get('threads')} threads, one request at a time"]


def long_table(result: dict) -> list[str]:
    """The report's section body for a `serve --workload long` result."""

    lines = markdown_table(LONG_HEADERS, long_rows(result)) + [""]
    headline = result.get("headline") or {}
    lines.append(f"At L={headline.get('prompt_len')}, C={headline.get('concurrency')}: throughput x"
                 f"{_fmt(result.get('throughput_ratio_vs_transformers'))}, TTFT p50 x"
                 f"{_fmt(result.get('ttft_ratio_vs_transformers'))} of transformers. "
                 + "; ".join(skipped_notes(result)) + ".")
    block = result.get("prefill_flop_efficiency") or {}
    if not block.get("skipped", True):
        lines += ["", "Prefill FLOP efficiency:", ""] + efficiency_table([block])
    return lines


def efficiency_table(blocks: list[dict]) -> list[str]:
    """L, C, wall s, model GFLOP, GEMM GFLOP/s (one rank, all ranks), efficiency, and per phase."""

    rows = [[b["prompt_len"], b["cp_size"], b["wall_s"], b["model_flops"]["total"] / 1e9,
             b["gemm_flops_per_s"]["rank"] / 1e9, b["gemm_flops_per_s"]["all"] / 1e9, b["efficiency"],
             *[b["phase_efficiency"].get(p) for p in PHASES]] for b in blocks if not b.get("skipped")]
    return markdown_table(["L", "C", "wall s", "model GFLOP", "GEMM GFLOP/s rank", "GEMM GFLOP/s all", "efficiency",
                           *[f"{p} eff." for p in PHASES]], rows)


def _fmt(value, spec: str = ".3g") -> str:
    return "-" if value is None else format(value, spec)


def summary_text_long(result: dict) -> str:
    lines = []
    for row in long_rows(result):
        length, c, p50, p90, tps, t50, _, ttps, x_tps, x_ttft = row
        lines.append(f"L={length} C={c}: TTFT p50 {_fmt(p50)}s p90 {_fmt(p90)}s, {_fmt(tps)} tok/s; transformers "
                     f"TTFT p50 {_fmt(t50)}s, {_fmt(ttps)} tok/s; x{_fmt(x_tps)} tokens/s, x{_fmt(x_ttft)} TTFT")
    block = result.get("prefill_flop_efficiency") or {}
    if not block.get("skipped", True):
        phases = ", ".join(f"{p} {_fmt(block['phase_efficiency'].get(p))}" for p in PHASES)
        lines.append(f"prefill L={block['prompt_len']} C={block['cp_size']}: {block['wall_s']:.2f}s, FLOP efficiency "
                     f"{block['efficiency']:.3f} ({phases})")
    return "\n".join(lines + skipped_notes(result))


def _series(result: dict, source: str, key: str, q: str | None) -> dict[int, tuple[list, list]]:
    """concurrency -> (lengths, values) of ours (`source` "ours") or transformers'."""
    out: dict[int, tuple[list, list]] = {}
    for run in sorted(result.get("runs", []), key=lambda r: r["prompt_len"]):
        value = _get(run if source == "ours" else run.get("transformers"), key, q)
        lengths, values = out.setdefault(run["concurrency"], ([], []))
        lengths.append(run["prompt_len"])
        values.append(math.nan if value is None else value)
    return out


def plot_long(result: dict, path: str) -> None:
    """TTFT p50 and output tokens/s vs prompt length (log-log), ours vs transformers, one line per concurrency."""

    plt = require_matplotlib()
    figure, panels = plt.subplots(1, 2, figsize=(11, 4.5))
    for axes, (key, q, title) in zip(panels, (("ttft_s", "p50", "TTFT p50 (s)"),
                                              ("output_tokens_per_s", None, "output tokens/s"))):
        for source, style, label in (("ours", "o-", "dsa-serve"), ("transformers", "s--", "transformers")):
            for i, (c, (lengths, values)) in enumerate(_series(result, source, key, q).items()):
                if not all(math.isnan(v) for v in values):  # one colour per concurrency, ours solid
                    axes.plot(lengths, values, style, color=f"C{i}", label=f"{label} C={c}")
        axes.set_xscale("log", base=2)
        axes.set_yscale("log")
        axes.set(title=title, xlabel="prompt length (tokens)")
        axes.legend(fontsize=8)
        axes.grid(True, which="both", alpha=0.3)
    server = result.get("server", {})
    figure.suptitle(f"bench serve --workload long: {Path(result.get('model', '')).name}, {result.get('dtype')}, "
                    f"cp_size {server.get('cp_size')}, k={server.get('speculative_num_steps')}, "
                    f"{result.get('max_tokens')} tokens")
    figure.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    plt.close(figure)
