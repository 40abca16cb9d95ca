"""The result of `dsa-serve bench serve`: one entry per concurrency level, its summary lines, `plot(result, path)`.

Both workloads build their result here (the short one in cluster/bench/serve.py, the harness's long one in
benchmarks/serve_long.py): the timing definitions, one run's HTTP / in-process / `transformers` ratios, the machine.

`plot` draws three panels: TTFT and inter-token latency (p50, p99) against concurrency for HTTP and the
in-process engine, and output tokens/s per concurrency for HTTP, in-process and `transformers` generate.
"""

from __future__ import annotations

import math
import os
import platform
from pathlib import Path

import torch

DEFINITIONS = {
    "ttft_s": "first streamed chunk - request sent",
    "itl_s": "gap between successive streamed chunks, once per chunk (a chunk carries tokens_per_chunk tokens)",
    "tpot_s": "(last chunk - first chunk) / (tokens - 1), per request",
    "ratios": "HTTP / in-process engine, p50 values",
    "throughput_vs_transformers": "HTTP output tokens/s / transformers generate output tokens/s",
}

SOURCES = (("http", "HTTP", "-"), ("in_process", "in-process", "--"))


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    return numerator / denominator if numerator is not None and denominator else None


def assemble_run(concurrency: int, http: dict, in_process: dict | None, baseline: dict | None) -> dict:
    run = {"concurrency": concurrency, **http, "in_process": in_process, "transformers": baseline}
    inner = in_process or {}
    run["ttft_p50_ratio"] = ratio(http["ttft_s"]["p50"], inner.get("ttft_s", {}).get("p50"))
    run["itl_p50_ratio"] = ratio(http["itl_s"]["p50"], inner.get("itl_s", {}).get("p50"))
    run["throughput_vs_transformers"] = ratio(http["output_tokens_per_s"], (baseline or {}).get("output_tokens_per_s"))
    return run


def machine() -> dict:
    return {"cpu_count": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
            "torch": torch.__version__, "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None}


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def summary_text(result: dict) -> str:
    lines = []
    for run in result["runs"]:
        baseline = run["transformers"] or {}
        lines.append(
            f"C={run['concurrency']}: TTFT p50 {_fmt(run['ttft_s']['p50'], '.4f')}s "
            f"(x{_fmt(run['ttft_p50_ratio'], '.2f')} in-process), ITL p50 {_fmt(run['itl_s']['p50'], '.4f')}s "
            f"(x{_fmt(run['itl_p50_ratio'], '.2f')}), {run['output_tokens_per_s']:.1f} tok/s, "
            f"{run['requests_per_s']:.2f} req/s; transformers {_fmt(baseline.get('output_tokens_per_s'), '.1f')} tok/s "
            f"(x{_fmt(run['throughput_vs_transformers'], '.2f')})")
    if result["transformers"].get("skipped"):
        lines.append(f"transformers baseline skipped: {result['transformers']['reason']}")
    return "\n".join(lines)


def _source_metric(run: dict, source: str, key: str, q: str) -> float:
    measured = run if source == "http" else run.get(source)
    value = (measured or {}).get(key, {}).get(q)
    return math.nan if value is None else value


def _latency_panel(ax, runs: list[dict], key: str, title: str) -> None:
    levels = [run["concurrency"] for run in runs]
    for source, label, style in SOURCES:
        for q, marker in (("p50", "o"), ("p99", "^")):
            values = [_source_metric(run, source, key, q) for run in runs]
            if not all(math.isnan(v) for v in values):
                ax.plot(levels, values, style, marker=marker, label=f"{label} {q}")
    ax.set_xscale("log", base=2)
    ax.set_xticks(levels, [str(c) for c in levels])
    ax.set(title=title, xlabel="concurrency", ylabel="seconds")
    ax.legend()


def _throughput_panel(ax, runs: list[dict]) -> None:
    series = [("HTTP", [run["output_tokens_per_s"] for run in runs])]
    for name, label in (("in_process", "in-process"), ("transformers", "transformers generate")):
        values = [(run[name] or {}).get("output_tokens_per_s", math.nan) for run in runs]
        if not all(math.isnan(v) for v in values):
            series.append((label, values))
    width = 0.8 / len(series)
    for j, (label, values) in enumerate(series):
        ax.bar([i + (j - (len(series) - 1) / 2) * width for i in range(len(runs))], values, width, label=label)
    ax.set_xticks(range(len(runs)), [str(run["concurrency"]) for run in runs])
    ax.set(title="output tokens/s", xlabel="concurrency", ylabel="tokens/s")
    ax.legend()


def plot(result: dict, path: str) -> None:
    """A PNG (or any format matplotlib infers from the suffix) of a `bench serve` result."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = result["runs"]
    fig, (ttft, itl, throughput) = plt.subplots(1, 3, figsize=(16, 4.8))
    _latency_panel(ttft, runs, "ttft_s", "time to first token")
    _latency_panel(itl, runs, "itl_s", "inter-token latency (per chunk)")
    _throughput_panel(throughput, runs)
    server = result["server"]
    fig.suptitle(f"bench serve: {Path(result['model']).name}, {result['dtype']}, {result['device']}, "
                 f"cp_size {server['cp_size']}, k={server['speculative_num_steps']}, {result['max_tokens']} tokens")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
