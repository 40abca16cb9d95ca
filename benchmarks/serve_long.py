"""`python -m benchmarks serve --workload long`: long held-out prompts over HTTP, `transformers` one at a time, and
the FLOP efficiency of one CP prefill.

Per --long-prompt-lens length L, --num-prompts distinct prompts of L tokens are cut from the held-out standard
library sources (common.py `held_out_stream`: distinct, non-overlapping, deterministic). For each length and
each --concurrency level, the server this command starts (`serve`'s app and settings; its KV cache sized for
the largest concurrency at the longest length unless --num-kv-pages / --kv-cache-memory-gib say otherwise)
runs the closed loop of cluster/bench/load.py. The in-process engine is skipped by default (--no-skip-in-process runs it).
Then, once the server is stopped (a --url server stays up), one --efficiency-prefill-len prefill runs on C ranks
of one thread through `bench prefill`'s machinery (cluster/bench/prefill_runs.py) and is set against the fp32
GEMM rate (cluster/bench/flops.py). Last comes the `transformers` side (transformers_long.py).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from cluster.bench.common import cut_windows, held_out_stream, model_fingerprint, spelled_command, window_offsets
from cluster.bench.serve import DEFAULT_SHORT_CONCURRENCY
from cluster.bench.serve_result import DEFINITIONS, assemble_run, machine, ratio
from cluster.bench.shared_prefix import reject_shared_prefix_flags
from cluster.commands.args import int_list
from cluster.commands.result_output import print_result

DEFAULT_LONG_LENS, DEFAULT_LONG_CONCURRENCY = "4096,8192,16384", "1,4"
DEFAULT_EFFICIENCY_LEN = 8192
HEADLINE = {"prompt_len": 8192, "concurrency": 4}  # the run the top-level ratios come from
LONG_FLAGS = ("workload", "long_prompt_lens", "efficiency_prefill_len", "no_skip_in_process")
LONG_DEFINITIONS = {
    "prompts": "num_prompts windows of prompt_len token ids per length, from the held-out standard-library sources "
               "(model_workers/training/corpus.py stdlib_files().held_out, token_stream with the model's "
               "tokenizer), at prompts.offsets: distinct and non-overlapping within a length; every level of a "
               "length sends the same prompts (request i = prompt i)",
    "throughput_ratio_vs_transformers": "HTTP output tokens/s / transformers output tokens/s (end to end, same "
                                        "prompts); top level: at headline (prompt_len, concurrency), null if not "
                                        "measured",
    "ttft_ratio_vs_transformers": "HTTP TTFT p50 / transformers TTFT p50; top level: at headline",
    "in_process": "the in-process engine comparison is skipped by default for the long workload (it would double "
                  "the run time); --no-skip-in-process runs it",
}


def add_long_arguments(bench: argparse.ArgumentParser) -> None:
    """The long workload's own flags (--workload is `dsa-serve bench serve`'s)."""
    bench.add_argument("--long-prompt-lens", default=None,
                       help=f"--workload long: comma list of prompt lengths (default {DEFAULT_LONG_LENS})")
    bench.add_argument("--efficiency-prefill-len", type=int, default=None,
                       help=f"--workload long: tokens of the prefill the FLOP efficiency is measured on (default "
                            f"{DEFAULT_EFFICIENCY_LEN}; 0: not measured)")


def resolve_workload(args: argparse.Namespace) -> None:
    """Fills the per-workload defaults into `args` (cluster/bench/serve.py `check_arguments` calls it); ValueError
    naming the flag that does not fit the workload."""
    long = args.workload == "long"
    reject_shared_prefix_flags(args)
    if not long:
        reject_long_flags(args)
    elif args.prompt_len:
        raise ValueError("--prompt-len is a --workload short flag; the long workload's lengths are --long-prompt-lens")
    args.concurrency = args.concurrency or (DEFAULT_LONG_CONCURRENCY if long else DEFAULT_SHORT_CONCURRENCY)
    args.no_skip_in_process = long and args.skip_in_process is False  # spelled out in the result's command
    args.in_process_skipped_by_default = long and args.skip_in_process is None
    args.skip_in_process = long if args.skip_in_process is None else args.skip_in_process
    if long:
        # it measures prefill against transformers, which caches nothing, and its prompts repeat across levels
        args.disable_radix_cache = True
        args.long_prompt_lens = args.long_prompt_lens or DEFAULT_LONG_LENS
        int_list(args.long_prompt_lens, "--long-prompt-lens", 1, 1 << 20)
        args.efficiency_prefill_len = (DEFAULT_EFFICIENCY_LEN if args.efficiency_prefill_len is None
                                       else args.efficiency_prefill_len)
        if args.efficiency_prefill_len < 0:
            raise ValueError(f"--efficiency-prefill-len must be >= 0, got {args.efficiency_prefill_len}")


def reject_long_flags(args: argparse.Namespace) -> None:
    """ValueError naming a long-workload flag given to another workload."""
    for flag, value in (("--long-prompt-lens", args.long_prompt_lens),
                        ("--efficiency-prefill-len", args.efficiency_prefill_len)):
        if value is not None:
            raise ValueError(f"{flag} is a --workload long flag (this run is --workload {args.workload})")


def long_plan(args: argparse.Namespace, levels: list[int]) -> tuple[list[int], int]:
    """(the prompt lengths, the requests per level); ValueError when --num-prompts is below a concurrency."""
    lengths = sorted(set(int_list(args.long_prompt_lens, "--long-prompt-lens", 1, 1 << 20)))
    num_prompts = args.num_prompts or max(levels)
    if num_prompts < max(levels):
        raise ValueError(f"--num-prompts {num_prompts} is below --concurrency {max(levels)}: with --workload long "
                         "every level sends the same --num-prompts distinct prompts")
    return lengths, num_prompts


def check_long_fit(window: int, lengths: list[int], args: argparse.Namespace) -> None:
    """Every prompt + --max-tokens (and the efficiency prefill) within the model's window and --max-model-len."""
    for flag, length, extra in [("--long-prompt-lens", n, args.max_tokens) for n in lengths] + [
            ("--efficiency-prefill-len", args.efficiency_prefill_len, 0)]:
        if length + extra > window:
            raise ValueError(f"{flag}: {length} tokens{f' + --max-tokens {extra}' if extra else ''} exceed the "
                             f"model's max_position_embeddings {window}")
    if args.max_model_len is not None and max(lengths) + args.max_tokens > args.max_model_len:
        raise ValueError(f"--long-prompt-lens {max(lengths)} + --max-tokens {args.max_tokens} exceed --max-model-len "
                         f"{args.max_model_len}")


def size_kv_cache(args: argparse.Namespace, longest: int, most: int) -> None:
    """--num-kv-pages: `serve`'s default, or more where `most` requests of `longest` + --max-tokens tokens must fit
    at once on every rank (a CP prefill holds every request of its batch on every rank), unless the KV cache size
    was given."""
    from cluster.config import MAX_SPECULATIVE_STEPS
    from cluster.engine_limits import DEFAULT_NUM_KV_PAGES
    from cp_router.cp.padding import ceil_div

    if args.num_kv_pages is None and args.kv_cache_memory_gib is None:
        per_request = ceil_div(longest + args.max_tokens + MAX_SPECULATIVE_STEPS + 1, args.page_size) + 1
        args.num_kv_pages = max(DEFAULT_NUM_KV_PAGES, most * per_request)


def long_prompts(model_dir: Path, lengths: list[int], num_prompts: int, efficiency_len: int) -> dict:
    """{"by_length": {L: [ids, ...]}, "efficiency": ids or None, "held_out_tokens", "offsets": {L: [start, ...]}}."""
    stream = held_out_stream(model_dir, "--workload long")
    flags = {n: f"--long-prompt-lens {n} with --num-prompts {num_prompts}" for n in lengths}
    return {
        "by_length": {n: cut_windows(stream, num_prompts, n, flags[n]) for n in lengths},
        "efficiency": cut_windows(stream, 1, efficiency_len, f"--efficiency-prefill-len {efficiency_len}")[0]
        if efficiency_len else None,
        "held_out_tokens": len(stream),
        "offsets": {str(n): window_offsets(len(stream), num_prompts, n, flags[n]) for n in lengths},
    }


def efficiency_prefill(model_dir: Path, cp, args: argparse.Namespace, prompt: list[int]) -> dict:
    """One served-path prefill of `prompt` on cp_size ranks of one thread (`bench prefill`'s run_configs); a
    failure is returned as {"failed": ...} (the serving results measured before it are kept)."""
    from cluster.bench.prefill_runs import run_configs
    from model_workers.precision import resolve_dtype_name

    settings = argparse.Namespace(**{**vars(args), "dtype": resolve_dtype_name(args.dtype, model_dir, args.device)})
    try:
        (timed,) = run_configs(model_dir, [(cp, 1)], {len(prompt): prompt}, settings, 1, ("served",))
    except Exception as exc:  # noqa: BLE001 - reported in the result's prefill_flop_efficiency
        return {"failed": repr(exc)}
    return timed["paths"]["served"][len(prompt)]


def efficiency_block(model_dir: Path, cp, length: int, prefill: dict | None) -> dict:
    """`prefill_flop_efficiency` of the measured prefill, against the GEMM rates measured now (flops.py)."""
    from cluster.bench.flops import checkpoint_flop_config, flop_efficiency, gemm_rates

    if prefill is None:
        return {"skipped": True, "reason": "--efficiency-prefill-len 0"}
    if "failed" in prefill:
        return {"skipped": True, "reason": f"the prefill failed: {prefill['failed']}"}
    config, mtp_sparse = checkpoint_flop_config(model_dir)
    return flop_efficiency(config, length, prefill, gemm_rates(cp.cp_size, 1), mtp_sparse)


def long_runs(lengths: list[int], levels: list[int], http: dict, in_process: dict | None, baseline: dict) -> list:
    """One entry per (length, concurrency): HTTP summary, in-process and transformers summaries, the ratios."""
    theirs = {e["prompt_len"]: e.get("levels", {}) for e in baseline.get("lengths", [])}
    runs = []
    for length in lengths:
        for c in levels:
            other = theirs.get(length, {}).get(c)
            run = {"prompt_len": length, **assemble_run(c, http[length][c], (in_process or {}).get(length, {}).get(c),
                                                        other)}
            run["throughput_ratio_vs_transformers"] = run.pop("throughput_vs_transformers")
            theirs_ttft = ((other or {}).get("ttft_s") or {}).get("p50")
            run["ttft_ratio_vs_transformers"] = ratio(run["ttft_s"]["p50"], theirs_ttft)
            runs.append(run)
    return runs


def transformers_block(baseline: dict) -> dict:
    """The baseline without the per-level summaries (they are in `runs`)."""
    if baseline.get("skipped"):
        return baseline
    return {**baseline, "lengths": [{k: v for k, v in e.items() if k != "levels"} for e in baseline["lengths"]]}


def build_long_result(args, model_dir: Path, server: dict, prompts: dict, levels: list[int], runs: list[dict],
                      baseline: dict, efficiency: dict) -> dict:
    from benchmarks.transformers_long import QUEUE_DEFINITION
    from cluster.bench.flops import DEFINITIONS as FLOP_DEFINITIONS
    from cluster.bench.serve_server import NEGATABLE_FLAGS, SERVE_FLAGS

    headline = next((r for r in runs if all(r[k] == v for k, v in HEADLINE.items())), None)
    definitions = {k: v for k, v in DEFINITIONS.items() if k != "throughput_vs_transformers"}
    reason = LONG_DEFINITIONS["in_process"] if args.in_process_skipped_by_default else "--skip-in-process"
    in_process = {"skipped": True, "reason": reason} if args.skip_in_process else {"skipped": False}
    return {
        "bench": "serve", "workload": "long", "command": spelled_command("serve", args, SERVE_FLAGS + LONG_FLAGS,
                                                                        NEGATABLE_FLAGS),
        "model": str(model_dir), "model_fingerprint": model_fingerprint(model_dir),
        "dtype": args.dtype, "device": args.device, "max_tokens": args.max_tokens,
        "prompt_lens": sorted(prompts["by_length"]), "concurrency": levels, "num_prompts": runs[0]["num_requests"],
        "prompts": {"source": "held-out stdlib files", "held_out_tokens": prompts["held_out_tokens"],
                    "offsets": prompts["offsets"]},
        "machine": machine(), "server": server,
        "definitions": {**definitions, **LONG_DEFINITIONS, "transformers": QUEUE_DEFINITION,
                        "prefill_flop_efficiency": FLOP_DEFINITIONS},
        "in_process": in_process, "transformers": transformers_block(baseline), "runs": runs, "headline": HEADLINE,
        "throughput_ratio_vs_transformers": headline and headline["throughput_ratio_vs_transformers"],
        "ttft_ratio_vs_transformers": headline and headline["ttft_ratio_vs_transformers"],
        "prefill_flop_efficiency": efficiency,
    }


def run_long(args: argparse.Namespace, levels: list[int]) -> int:
    """The long workload, start to end (after `check_arguments`); prints the result."""
    from benchmarks.serve_long_report import plot_long, summary_text_long
    from benchmarks.transformers_long import run_long_baseline
    from cluster.bench.serve_server import measure_served, server_info
    from cluster.commands.serve import app_args
    from cluster.config import resolve_cp_settings
    from model_workers.checkpoint.model_dir import read_model_spec
    from model_workers.precision import resolve_dtype_name

    lengths, num_prompts = long_plan(args, levels)
    model = read_model_spec(args.model)  # config.json read once
    model_dir, config = model.path, model.config
    check_long_fit(config.max_position_embeddings, lengths, args)
    size_kv_cache(args, max(lengths), max(levels))
    settings = app_args(args)
    cp = resolve_cp_settings(settings, model)
    prompts = long_prompts(model_dir, lengths, num_prompts, args.efficiency_prefill_len)
    plan = {c: num_prompts for c in levels}
    groups = {n: ([(ids, ids) for ids in prompts["by_length"][n]], plan) for n in lengths}
    after = None if prompts["efficiency"] is None else (
        lambda: efficiency_prefill(model_dir, cp, args, prompts["efficiency"]))
    http, in_process, prefill = measure_served(args, model_dir, cp, settings, groups, after)
    efficiency = efficiency_block(model_dir, cp, args.efficiency_prefill_len, prefill)
    baseline = {"skipped": True, "reason": "--skip-transformers"}
    if not args.skip_transformers:
        dtype = resolve_dtype_name(args.dtype, model, args.device)
        baseline = run_long_baseline(model_dir, prompts["by_length"], plan, args.max_tokens, dtype, args.device)
    result = build_long_result(args, model_dir, {**server_info(args, cp), "num_kv_pages": args.num_kv_pages},
                               prompts, levels, long_runs(lengths, levels, http, in_process, baseline), baseline,
                               efficiency)
    print_result(json.dumps(result) if args.json else summary_text_long(result))
    if args.plot:
        plot_long(result, args.plot)
    return 0
