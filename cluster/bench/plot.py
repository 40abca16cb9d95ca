"""PNG plots of bench results: `save_plot(result, path)` picks the plot by result["bench"].

matplotlib is optional (`pip install 'dsa-serve[bench]'`) and imported only when a plot is drawn, with
the non-interactive Agg backend. These are the plots a bench's `--plot FILE.png` draws; the "serve" plot is
`cluster.bench.serve_result.plot`. The long workload's plot is the harness's (benchmarks/serve_long_report.py).
Each plot reads its numbers through a small accessor (`prefill_points`, `decode_series`) so a change
in a bench's JSON layout is absorbed in one place; the harness's report and targets use the same accessors.
"""

from __future__ import annotations

from pathlib import Path

from cluster.bench.render import require_matplotlib
from cluster.bench.serve_result import plot as plot_serve

PREFILL_EFFICIENCY_TARGET = 0.90


def save_plot(result: dict, path: str) -> None:
    """Draws the plot for result["bench"] into the PNG file `path` (parent folders created)."""
    plt = require_matplotlib()
    kind = result.get("bench")
    if kind not in PLOTTERS:
        raise ValueError(f"no plot for bench {kind!r}; allowed: {', '.join(sorted(PLOTTERS))}")
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    if kind == "serve":
        serve_plot(result, path)
        return
    figure = PLOTTERS[kind](result, plt)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def serve_plot(result: dict, path: str) -> None:
    """Draws and saves its own figure: serve_result's three panels (a long-workload result: the harness's plot; a
    shared-prefix one: shared_prefix_report's)."""
    if result.get("workload") == "long":
        raise ValueError("a --workload long result is plotted by the repository's harness (benchmarks/"
                         "serve_long_report.py, `python -m benchmarks report`)")
    if result.get("workload") == "shared-prefix":
        from cluster.bench.shared_prefix_report import plot as plot_shared_prefix

        plot_shared_prefix(result, path)
        return
    plot_serve(result, path)


def plot_attention(result: dict, plt):
    """Time per layer vs L (log-log): sparse, its indexer part, dense; the crossover and the 4·topk target."""
    runs = sorted(result["runs"], key=lambda r: r["length"])
    lengths = [r["length"] for r in runs]
    figure, axes = plt.subplots(figsize=(7, 4.5))
    axes.loglog(lengths, [r["sparse_s"] for r in runs], "o-", label=f"sparse (top-{result['index_topk']})")
    axes.loglog(lengths, [r["sparse_indexer_s"] for r in runs], ".--", label="sparse: indexer top-k part")
    axes.loglog(lengths, [r["dense_s"] for r in runs], "s-", label="dense (all causal keys)")
    if result.get("crossover_length") is not None:
        axes.axvline(result["crossover_length"], color="green", label=f"crossover L={result['crossover_length']}")
    axes.axvline(4 * result["index_topk"], color="gray", linestyle=":", label="target: 4 x index_topk")
    axes.set_xscale("log", base=2)
    axes.set_xlabel("prompt length L (tokens)")
    axes.set_ylabel("seconds per layer (one request)")
    axes.set_title(f"attention, {result.get('dtype', '')}, {result.get('threads', '?')} thread(s)")
    axes.legend(fontsize=8)
    axes.grid(True, which="both", alpha=0.3)
    return figure


def first_key(entry: dict, *names: str, default=None):
    """The value of the first of `names` present in `entry`."""
    return next((entry[n] for n in names if entry.get(n) is not None), default)


def prefill_points(result: dict) -> list[dict]:
    """One point per measured prompt length: {prompt_len, cp_size, c1_wall_s, cp_wall_s, efficiency, entry}.

    Reads either a single prefill result (runs = [C=1, C]) or one with a "lengths" list of such results.
    efficiency = (C=1 wall / C wall) / C unless the entry carries its own strong-scaling efficiency.
    """
    points = []
    for entry in result.get("lengths") or [result]:
        runs = entry.get("runs") or []
        c1 = next((r for r in runs if r.get("cp_size") == 1), None)
        cp = runs[-1] if runs else None
        cp_size = first_key(entry, "cp_size", default=cp.get("cp_size") if cp else 1)
        c1_wall = first_key(entry, "c1_wall_s", "wall_s_cp1", default=c1["wall_s"] if c1 else None)
        cp_wall = first_key(entry, "cp_wall_s", "wall_s", default=cp["wall_s"] if cp else None)
        efficiency = first_key(entry, "strong_scaling_efficiency", "efficiency")
        if efficiency is None and c1_wall and cp_wall and cp_size:
            efficiency = c1_wall / cp_wall / cp_size
        points.append({"prompt_len": entry.get("prompt_len"), "cp_size": cp_size, "c1_wall_s": c1_wall,
                       "cp_wall_s": cp_wall, "efficiency": efficiency, "entry": entry})
    return sorted(points, key=lambda p: p["prompt_len"] or 0)


def plot_prefill(result: dict, plt):
    """Wall time of C=1 and C=cp vs L, and the strong-scaling efficiency vs L with its 0.90 target."""
    points = [p for p in prefill_points(result) if p["prompt_len"]]
    lengths = [p["prompt_len"] for p in points]
    figure, (times, efficiency) = plt.subplots(1, 2, figsize=(10, 4))
    times.plot(lengths, [p["c1_wall_s"] for p in points], "o-", label="C=1")
    cp_size = points[-1]["cp_size"] if points else "C"
    times.plot(lengths, [p["cp_wall_s"] for p in points], "s-", label=f"C={cp_size}")
    times.set_ylabel("prefill wall time (s)")
    efficiency.plot(lengths, [p["efficiency"] for p in points], "o-", label="(t1 / tC) / C")
    efficiency.axhline(PREFILL_EFFICIENCY_TARGET, color="gray", linestyle=":", label="target 0.90")
    efficiency.set_ylabel("strong-scaling efficiency")
    efficiency.set_ylim(0, 1.1)
    for axes in (times, efficiency):
        axes.set_xscale("log", base=2)
        axes.set_xlabel("prompt length L (tokens)")
        axes.legend(fontsize=8)
        axes.grid(True, alpha=0.3)
    first = points[0]["entry"] if points else {}
    strategy, dtype = first_key(result, "cp_strategy", default=first.get("cp_strategy", "")), first_key(
        result, "dtype", default=first.get("dtype", ""))
    figure.suptitle(f"CP prefill {strategy} {dtype}".strip())
    return figure


def decode_series(result: dict) -> dict[int, list[dict]]:
    """batch_size -> its runs sorted by speculative_num_steps (k)."""
    series: dict[int, list[dict]] = {}
    for run in result.get("runs", []):
        series.setdefault(run.get("batch_size", 1), []).append(run)
    return {b: sorted(runs, key=lambda r: r.get("speculative_num_steps", 0)) for b, runs in sorted(series.items())}


def plot_decode(result: dict, plt):
    """tokens/s vs k per batch size, and the measured accepted length next to the formula."""
    figure, (speed, accepted) = plt.subplots(1, 2, figsize=(10, 4))
    for batch, runs in decode_series(result).items():
        ks = [r.get("speculative_num_steps", 0) for r in runs]
        speed.plot(ks, [r["tokens_per_s"] for r in runs], "o-", label=f"B={batch}")
        line = accepted.plot(ks, [r.get("mean_accepted_length", 1.0) for r in runs], "o-", label=f"B={batch} measured")
        accepted.plot(ks, [r.get("formula_accepted_length", 1.0) for r in runs], "x:", color=line[0].get_color(),
                      label=f"B={batch} formula")
    all_ks = sorted({r.get("speculative_num_steps", 0) for r in result.get("runs", [])})
    speed.set_ylabel("tokens/s")
    accepted.set_ylabel("tokens per verify step")
    for axes in (speed, accepted):
        axes.set_xlabel("speculative steps k")
        axes.set_xticks(all_ks)
        axes.legend(fontsize=8)
        axes.grid(True, alpha=0.3)
    figure.suptitle(f"decode with MTP speculation, {result.get('dtype', '')}")
    return figure


PLOTTERS = {"attention": plot_attention, "prefill": plot_prefill, "decode": plot_decode, "serve": serve_plot}
