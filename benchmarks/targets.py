"""The project's performance targets, each checked against the bench results that measure it.

A check takes {bench kind: [result, ...]} and returns (measured text, True / False), or None when no
result measures it ("not measured"). Key names a bench may still rename are read through
cluster/bench/plot.py's `first_key` / `prefill_points`, so a layout change is absorbed here in one place.
Each target names the command that makes the results it reads (`source`): an installed `dsa-serve bench KIND`, or
this harness's `python -m benchmarks serve` where the target needs a `transformers` comparison.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from benchmarks import HARNESS_PROGRAM
from cluster.bench.plot import decode_series, first_key, prefill_points

GIB = 1 << 30
Outcome = tuple[str, bool] | None
HARNESS_SERVE = f"{HARNESS_PROGRAM} serve"
LONG = f"{HARNESS_SERVE} --workload long"
SHARED_PREFIX = "dsa-serve bench serve --workload shared-prefix"


@dataclass(frozen=True)
class Target:
    name: str
    bench: str  # which bench's results it reads
    check: Callable[[dict[str, list[dict]]], Outcome]
    command: str | None = None  # the command that measures it, when not `dsa-serve bench {bench}`

    @property
    def source(self) -> str:
        return self.command or f"dsa-serve bench {self.bench}"


def cp_efficiency(results: dict[str, list[dict]]) -> Outcome:
    points = [p for r in results.get("prefill", []) for p in prefill_points(r)
              if p["cp_size"] == 2 and (p["prompt_len"] or 0) >= 8192 and p["efficiency"] is not None]
    if not points:
        return None
    worst = min(points, key=lambda p: p["efficiency"])
    lengths = ", ".join(str(p["prompt_len"]) for p in points)
    text = f"min {worst['efficiency']:.3f} (at L={worst['prompt_len']}; L measured: {lengths})"
    return text, worst["efficiency"] >= 0.90


def sparse_crossover(results: dict[str, list[dict]]) -> Outcome:
    outcomes = []
    for result in results.get("attention", []):
        topk, crossover = result["index_topk"], result.get("crossover_length")
        longest = max(r["length"] for r in result["runs"])
        if crossover is None and longest <= 4 * topk:
            continue  # never measured past 4·topk: no verdict either way
        text = f"L={crossover} = {crossover / topk:g} x index_topk {topk}" if crossover else "sparse never faster"
        outcomes.append((text, crossover is not None and crossover <= 4 * topk))
    return combine(outcomes)


def decode_run(result: dict, k: int, batch: int) -> dict | None:
    runs = decode_series(result).get(batch, [])
    return next((r for r in runs if r.get("speculative_num_steps", 0) == k), None)


def spec_speedup(results: dict[str, list[dict]]) -> Outcome:
    outcomes = []
    for result in results.get("decode", []):
        base, spec = decode_run(result, 0, 1), decode_run(result, 2, 1)
        if base and spec:
            ratio = spec["tokens_per_s"] / base["tokens_per_s"]
            text = f"{ratio:.2f}x ({spec['tokens_per_s']:.1f} vs {base['tokens_per_s']:.1f} tok/s)"
            outcomes.append((text, ratio >= 1.5))
    return combine(outcomes)


def engine_overhead(results: dict[str, list[dict]]) -> Outcome:
    outcomes = []
    for result in results.get("decode", []):
        runs = decode_series(result).get(8, [])
        run = decode_run(result, 0, 8) or (runs[0] if runs else None)
        if run and run.get("engine_overhead_fraction") is not None:
            share = run["engine_overhead_fraction"]
            outcomes.append((f"{share:.1%} (k={run.get('speculative_num_steps', 0)})", share <= 0.15))
    return combine(outcomes)


def serve_results(results: dict[str, list[dict]], workload: str) -> list[dict]:
    """The `bench serve` results of one workload ("short": those without a workload key too) on the path `serve`
    takes by default: direct ingress (a `--no-direct-ingress` run, through Serve's proxy, is reported, not judged)."""
    return [r for r in results.get("serve", []) if r.get("workload", "short") == workload
            and (r.get("server") or {}).get("direct_ingress") is not False]


def serve_ratio(key: str, limit: float) -> Callable[[dict[str, list[dict]]], Outcome]:
    """HTTP / in-process ratio `key` of every short-workload serve run (each concurrency level) must be <= limit."""

    def check(results: dict[str, list[dict]]) -> Outcome:
        runs = [run for r in serve_results(results, "short") for run in r.get("runs", []) if run.get(key) is not None]
        return combine([(f"C={run.get('concurrency')}: {run[key]:.3f}", run[key] <= limit) for run in runs])

    return check


def short_runs_at(results: dict[str, list[dict]], concurrency: int) -> list[dict]:
    """The short-workload serve runs at one concurrency level."""
    return [run for r in serve_results(results, "short") for run in r.get("runs", [])
            if run.get("concurrency") == concurrency]


def serve_ratio_at(key: str, concurrency: int, limit: float) -> Callable[[dict[str, list[dict]]], Outcome]:
    """HTTP / in-process ratio `key` of the short workload at one concurrency level must be <= limit."""

    def check(results: dict[str, list[dict]]) -> Outcome:
        runs = [run for run in short_runs_at(results, concurrency) if run.get(key) is not None]
        return combine([(f"{run[key]:.3f}", run[key] <= limit) for run in runs])

    return check


def http_throughput(results: dict[str, list[dict]]) -> Outcome:
    """HTTP output tokens/s at 32 streams over the in-process engine's, same run (>= 0.9)."""
    outcomes = []
    for run in short_runs_at(results, 32):
        ours, local = run.get("output_tokens_per_s"), (run.get("in_process") or {}).get("output_tokens_per_s")
        if ours and local:
            outcomes.append((f"{ours / local:.2f}x ({ours:.1f} vs {local:.1f} tok/s)", ours / local >= 0.9))
    return combine(outcomes)


def in_process_vs_transformers(results: dict[str, list[dict]]) -> Outcome:
    """In-process output tokens/s at 32 streams over batched `transformers` generate's, same run (>= 1.0)."""
    outcomes = []
    for run in short_runs_at(results, 32):
        local = (run.get("in_process") or {}).get("output_tokens_per_s")
        theirs = (run.get("transformers") or {}).get("output_tokens_per_s")
        if local and theirs:
            outcomes.append((f"{local / theirs:.2f}x ({local:.1f} vs {theirs:.1f} tok/s)", local / theirs >= 1.0))
    return combine(outcomes)


def peak_rss(results: dict[str, list[dict]]) -> Outcome:
    names = ("peak_rss_bytes_per_rank", "per_rank_peak_rss_bytes", "peak_rss_bytes")
    outcomes = []
    for point in (p for r in results.get("prefill", []) for p in prefill_points(r)):
        runs = point["entry"].get("runs") or [{}]
        value = first_key(point["entry"], *names, default=first_key(runs[-1], *names))
        if value is not None and (point["prompt_len"] or 0) >= 32768:
            worst = max(value) if isinstance(value, list) else value
            text = f"{worst / GIB:.2f} GiB (L={point['prompt_len']}, C={point['cp_size']})"
            outcomes.append((text, worst <= 4 * GIB))
    return combine(outcomes)


def kv_bytes(results: dict[str, list[dict]]) -> Outcome:
    outcomes = []
    for result in (r for rs in results.values() for r in rs):
        if result.get("measured_kv_bytes_per_token") is not None:
            measured, formula = result["measured_kv_bytes_per_token"], result.get("formula_kv_bytes_per_token")
            unit = "bytes/token"
        elif result.get("bench") == "prefill" and result.get("cp_size", 1) > 1:
            measured, formula = result.get("measured_kv_bytes_per_rank"), result.get("formula_kv_bytes_per_rank")
            unit = f"gathered bytes/rank at L={result.get('prompt_len')}, C={result.get('cp_size')}"
        else:
            continue
        if measured is not None and formula:
            outcomes.append((f"{measured:.0f} vs formula {formula:.0f} {unit}", abs(measured / formula - 1) <= 0.01))
    return combine(outcomes)


def long_ratio(key: str, prompt_len: int, concurrency: int, passes: Callable[[float], bool]
               ) -> Callable[[dict[str, list[dict]]], Outcome]:
    """Ratio `key` (ours / transformers) of the long workload's run at (prompt_len, concurrency)."""

    def check(results: dict[str, list[dict]]) -> Outcome:
        outcomes = []
        for result in serve_results(results, "long"):
            for run in result.get("runs", []):
                at = (run.get("prompt_len"), run.get("concurrency")) == (prompt_len, concurrency)
                if at and run.get(key) is not None:
                    outcomes.append((f"{run[key]:.3g}x (L={prompt_len}, C={concurrency})", passes(run[key])))
        return combine(outcomes)

    return check


def prefill_flop_efficiency(results: dict[str, list[dict]]) -> Outcome:
    """The long workload's measured prefill (8k tokens at C = 2 by default): model FLOPs / (wall x GEMM rate)."""
    outcomes = []
    for result in serve_results(results, "long"):
        block = result.get("prefill_flop_efficiency") or {}
        if not block.get("skipped", True):
            text = f"{block['efficiency']:.3f} (L={block['prompt_len']}, C={block['cp_size']})"
            outcomes.append((text, block["efficiency"] >= 0.5))
    return combine(outcomes)


def shared_prefix_ratio(name: str, doc_len: int = 0, concurrency: int | None = None
                        ) -> Callable[[dict[str, list[dict]]], Outcome]:
    """Ratio `name` (cache on / off, one run) of the shared-prefix runs with documents of at least `doc_len`
    tokens (and at `concurrency` streams, if given) against its limit (cluster/bench/shared_prefix_report.py)."""
    from cluster.bench.shared_prefix_report import RATIOS

    *_, sign, limit = RATIOS[name]

    def check(results: dict[str, list[dict]]) -> Outcome:
        runs = [r for r in serve_results(results, "shared-prefix") if (r.get("ratios") or {}).get(name) is not None
                and r["sizes"]["doc_len"] >= doc_len and concurrency in (None, r.get("concurrency"))]
        return combine([(f"{r['ratios'][name]:.3f}x (documents of {r['sizes']['doc_len']} tokens)",
                         r["ratios"][name] <= limit if sign == "<=" else r["ratios"][name] >= limit) for r in runs])

    return check


def structured_mask_overhead(results: dict[str, list[dict]]) -> Outcome:
    return combine([(f"{r['mask_overhead']['ratio']:.3f}x ({r['mask_overhead']['streams']} streams)",
                     r["mask_overhead"]["ratio"] >= 0.85) for r in results.get("structured", [])])


def structured_validity(results: dict[str, list[dict]]) -> Outcome:
    return combine([(f"{r['validity']['valid']} / {r['validity']['requests']} ({r['validity']['schemas']} schemas)",
                     r["validity"]["valid"] == r["validity"]["requests"] and r["validity"]["schemas"] >= 50)
                    for r in results.get("structured", [])])


def pd_ratio(name: str, limit: float, sign: str) -> Callable[[dict[str, list[dict]]], Outcome]:
    def check(results: dict[str, list[dict]]) -> Outcome:
        return combine([(f"{r['ratios'][name]:.3f}", r["ratios"][name] <= limit if sign == "<=" else
                         r["ratios"][name] >= limit) for r in results.get("pd", [])])

    return check


def combine(outcomes: list[tuple[str, bool]]) -> Outcome:
    """Several results measuring one target: every one must pass."""
    if not outcomes:
        return None
    return "; ".join(text for text, _ in outcomes), all(ok for _, ok in outcomes)


TARGETS = (
    Target("CP strong-scaling efficiency at C=2 >= 0.90 for prompts >= 8k", "prefill", cp_efficiency),
    Target("sparse attention faster than dense beyond ~4 x index_topk (crossover <= 4 x index_topk)",
           "attention", sparse_crossover),
    Target("speculative decoding k=2, batch 1 >= 1.5x tokens/s of k=0", "decode", spec_speedup),
    Target("serving TTFT p50 HTTP / in-process <= 1.15 at 1 stream (direct ingress, the default)", "serve",
           serve_ratio_at("ttft_p50_ratio", 1, 1.15)),
    Target("serving ITL p50 HTTP / in-process <= 1.10 (every concurrency; direct ingress)", "serve",
           serve_ratio("itl_p50_ratio", 1.10)),
    Target("serving tokens/s HTTP / in-process >= 0.9 at 32 streams (direct ingress)", "serve", http_throughput),
    Target("short-prompt decode in process at 32 streams >= 1.0x batched transformers", "serve",
           in_process_vs_transformers, HARNESS_SERVE),
    Target("per-step engine overhead <= 15% at batch 8", "decode", engine_overhead),
    Target("peak RSS per rank for a 32k prefill <= 4 GiB", "prefill", peak_rss),
    Target("KV bytes = formula (within 1%)", "prefill", kv_bytes),
    Target("long context: throughput at 8k, concurrency 4 >= 12x transformers", "serve",
           long_ratio("throughput_ratio_vs_transformers", 8192, 4, lambda x: x >= 12), LONG),
    Target("long context: TTFT p50 at 8k, concurrency 4 <= 0.06x transformers", "serve",
           long_ratio("ttft_ratio_vs_transformers", 8192, 4, lambda x: x <= 0.06), LONG),
    Target("long context: throughput at 16k, concurrency 4 >= 20x transformers", "serve",
           long_ratio("throughput_ratio_vs_transformers", 16384, 4, lambda x: x >= 20), LONG),
    Target("prefill FLOP efficiency >= 0.5 (the long workload's prefill)", "serve", prefill_flop_efficiency, LONG),
    Target("prefix cache: TTFT of a request whose first 8k tokens are cached <= 0.1x cache off", "serve",
           shared_prefix_ratio("cached_prefix_ttft_p50_ratio", doc_len=8192), SHARED_PREFIX),
    Target("prefix cache, multi-turn chat: prefilled tokens <= 0.2x cache off", "serve",
           shared_prefix_ratio("chat_prefilled_tokens_ratio"), SHARED_PREFIX),
    Target("prefix cache, multi-turn chat: TTFT p50 <= 0.25x cache off", "serve",
           shared_prefix_ratio("chat_ttft_p50_ratio"), SHARED_PREFIX),
    Target("prefix cache, nothing shared: tokens/s at 32 streams >= 0.9x cache off (median of 3 rounds)", "serve",
           shared_prefix_ratio("no_sharing_throughput_ratio", concurrency=32), SHARED_PREFIX),
    Target("structured outputs: decode tokens/s at 32 streams, every request JSON-schema constrained >= 0.85x "
           "unconstrained", "structured", structured_mask_overhead),
    Target("structured outputs: every output of >= 50 schemas parses and validates", "structured",
           structured_validity),
    Target("disaggregation: inter-token p99 of 8 streams while 16k prompts arrive <= 0.2x colocated", "pd",
           pd_ratio("isolation_itl_p99_ratio", 0.2, "<=")),
    Target("disaggregation: an 8k prompt's hand-off <= 10 % of its prefill time", "pd",
           pd_ratio("transfer_over_prefill", 0.10, "<=")),
    Target("disaggregation, one stream alone: TTFT >= 0.8x colocated", "pd",
           pd_ratio("alone_ttft_ratio", 0.8, ">=")),
    Target("disaggregation, one stream alone: tokens/s >= 0.8x colocated", "pd",
           pd_ratio("alone_tokens_per_s_ratio", 0.8, ">=")),
)


def evaluate(results: dict[str, list[dict]]) -> list[tuple[Target, str, str]]:
    """(target, measured text, "PASS" | "MISS" | "not measured") for every target."""
    rows = []
    for target in TARGETS:
        outcome = target.check(results)
        if outcome is None:
            rows.append((target, "not measured", "not measured"))
        else:
            rows.append((target, outcome[0], "PASS" if outcome[1] else "MISS"))
    return rows
