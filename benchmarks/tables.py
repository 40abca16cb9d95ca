"""The tables of BENCHMARKS.md: one function per bench kind turns a result into markdown lines (`TABLES`).

A result of a kind without its own table gets `generic_table` (its scalars, then its runs); the long workload's
table is serve_long_report.py's.
"""

from __future__ import annotations

from benchmarks.markdown import markdown_table
from benchmarks.serve_long_report import efficiency_table, long_table
from cluster.bench.plot import decode_series, prefill_points


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
    lines += [f"Causal work max/mean per rank, modeled and measured ({result.get('cp_strategy')}):", ""]
    lines += markdown_table(["L", *[f"{k} (model)" for k in layouts], "measured"], rows)
    phases = ("indexer", "attention", "mlp", "communication", "other")
    rows = []
    for e in entries:
        rows.append([e["prompt_len"], "C=1", *[e.get("c1_phase_s", {}).get(k) for k in phases]])
        for rank, split in enumerate(e.get("per_rank_phase_s") or []):
            rows.append([e["prompt_len"], f"rank {rank}", *[split.get(k) for k in phases]])
    lines += ["", "Phase split (s; indexer = projections + scoring + top-k):", ""]
    lines += markdown_table(["L", "run", *phases], rows)
    blocks = [b for b in (e.get("prefill_flop_efficiency") for e in entries) if b and not b.get("skipped")]
    if blocks:
        lines += ["", "FLOP efficiency of the served CP prefill (definitions in the JSON):", ""]
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
    lines = [f"Served ({result.get('prefill_chunk_tokens')}-token chunks, the table above) vs one unchunked batch:", ""]
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
    if result.get("workload") == "shared-prefix":
        return shared_prefix_table(result)

    def p50(run: dict | None, key: str):
        return ((run or {}).get(key) or {}).get("p50")

    rows = [[r.get("concurrency"), r.get("output_tokens_per_s"), p50(r, "ttft_s"), p50(r, "itl_s"),
             r.get("ttft_p50_ratio"), r.get("itl_p50_ratio"), (r.get("transformers") or {}).get("output_tokens_per_s"),
             r.get("throughput_vs_transformers")] for r in result.get("runs", [])]
    return markdown_table(["C", "tokens/s", "TTFT p50 s", "ITL p50 s", "TTFT HTTP / in-proc", "ITL HTTP / in-proc",
                           "transformers tokens/s", "x transformers"], rows)


def shared_prefix_table(result: dict) -> list[str]:
    """Per phase and side: hit rate, prefilled tokens, TTFT p50 / p90, tokens/s; then the on / off ratios."""
    rows = []
    for phase, sides in result["phases"].items():
        for side, m in sides.items():
            rows.append([phase, side, m["num_requests"], m["hit_rate"], m["prefilled_tokens"], m["prompt_tokens"],
                         m["ttft_s"]["p50"], m["ttft_s"]["p90"], m["output_tokens_per_s"]])
            if "later_questions" in m:
                later = m["later_questions"]
                rows.append([f"{phase}: later questions", side, later["num_requests"], later["hit_rate"],
                             later["prefilled_tokens"], later["prompt_tokens"], later["ttft_s"]["p50"],
                             later["ttft_s"]["p90"], later["output_tokens_per_s"]])
    lines = markdown_table(["phase", "cache", "requests", "hit rate", "prefilled tokens", "prompt tokens",
                            "TTFT p50 s", "TTFT p90 s", "tokens/s"], rows)
    targets = result.get("targets", {})
    ratio_rows = [[name, value, targets.get(name, {}).get("target")] for name, value in result["ratios"].items()]
    sizes = result["sizes"]
    return lines + ["", f"{sizes['num_docs']} documents of {sizes['doc_len']} tokens x {sizes['questions_per_doc']} "
                        f"questions, {sizes['conversations']} conversations x {sizes['turns']} turns, "
                        f"{sizes['num_prompts']} unshared prompts at {result.get('concurrency')} streams; on / off:",
                    ""] + markdown_table(["ratio", "on / off", "target"], ratio_rows)


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


def structured_table(result: dict) -> list[str]:
    mask, validity = result["mask_overhead"], result["validity"]
    medians = mask["median_tokens_per_s"]
    lines = markdown_table(["streams", "tokens / request", "constrained tokens/s", "free tokens/s", "ratio"],
                           [[mask["streams"], mask["max_tokens"], medians["constrained"], medians["free"],
                             mask["ratio"]]])
    lines += ["", f"Schema suite: {validity['valid']} of {validity['requests']} outputs ({validity['schemas']} schemas, "
                  f"greedy and seeded) parse and validate; mean {validity['mean_tokens']} tokens per output."]
    return lines + [f"- {failure['request']}: {failure['reason']}" for failure in validity["failures"]]


def pd_table(result: dict) -> list[str]:
    isolation, transfer, alone = result["isolation"], result["transfer"], result["alone"]
    lines = markdown_table(["engine", "short streams' chunk gap p50 / p99 (s)", "lone TTFT (s)", "lone tokens/s"],
                           [[name, f"{isolation[name]['itl_p50_s']} / {isolation[name]['itl_p99_s']}",
                             alone[name]["ttft_s"], alone[name]["tokens_per_s"]] for name in ("colocated", "pd")])
    return lines + ["", f"{transfer['prompt_tokens']}-token hand-off: {transfer['bytes']:,} B (formula "
                        f"{transfer['formula_bytes']:,}), {transfer['transfer_s']} s against a {transfer['prefill_s']} s "
                        f"prefill ({transfer['transfer_over_prefill']:.1%})."]


TABLES = {"attention": attention_table, "prefill": prefill_table, "decode": decode_table, "serve": serve_table,
          "kv-cache": kv_cache_table, "structured": structured_table, "pd": pd_table}
