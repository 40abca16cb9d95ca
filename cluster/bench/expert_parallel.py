"""`dsa-serve bench ep`: what expert parallelism costs and saves on one CP group of C ranks.

The same C-rank group (zigzag CP prefill, requests owned by the least loaded rank) runs twice: EP = 1 (every
rank holds every routed expert, decode needs no collective) and EP = C (rank r holds routed experts
[r·n/C, (r+1)·n/C); decode is DP attention in lockstep: every step one row-count all-gather plus two
collectives per MoE layer, and a rank with nothing to decode still joins every forward). Reported:
* decode tokens/s at each batch size B and speculation depth k, and EP / no-EP ("the price of lockstep");
* per decode step under EP: collectives, milliseconds each, and bytes received by tag (CommStats tags);
* prefill of one prompt per --prompt-len (time to first token, on the served path) and its collective seconds;
* per rank: peak RSS, checkpoint bytes read, loaded parameter bytes, and `dsa-serve plan`'s weight bytes.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections import defaultdict

from cluster.bench.common import PROMPTS, model_fingerprint, spelled_command
from cluster.commands.args import add_dtype_argument, add_speculative_argument, int_list
from cluster.commands.result_output import print_result
from cluster.config import MAX_SPECULATIVE_STEPS

EP_FLAGS = ("model", "cp_size", "batch_size", "speculative_num_steps", "max_tokens", "prompt_len", "dtype",
            "steps_per_call", "repeats")
TAGS = ("kv", "hidden", "experts", "rows", "other")


def add_parser(kinds) -> None:
    ep = kinds.add_parser("ep", help="expert parallelism: decode / prefill / memory, EP = C against EP = 1")
    ep.add_argument("--model", default=None, help="checkpoint folder (default: the embedded model)")
    ep.add_argument("--cp-size", type=int, default=2, help="C: ranks of the group (EP = C against EP = 1)")
    ep.add_argument("--batch-size", default="1,8,32", help="decode batch sizes B, a comma list")
    add_speculative_argument(ep, default="0,2", many=True)
    ep.add_argument("--max-tokens", type=int, default=32, help="tokens generated per decode request")
    ep.add_argument("--prompt-len", default="8192,16384", help="prefill prompt lengths, a comma list")
    add_dtype_argument(ep, default="bfloat16", allow_auto=False)
    ep.add_argument("--steps-per-call", type=int, default=4, help="decode steps per worker call")
    ep.add_argument("--repeats", type=int, default=3, help="timed passes per decode batch / prefill length (median)")
    ep.add_argument("--json", action="store_true", help="print one JSON object")
    ep.set_defaults(run=run_ep)


class DecodeRecord:
    """Per-rank sums over the decode-only steps (no prefill on any rank) an engine ran while attached."""

    def __init__(self):
        self.steps = 0
        self.per_rank: dict[int, dict] = defaultdict(lambda: {"collectives": 0, "comm_s": 0.0, "decode_steps": 0,
                                                              "requests": 0, "peak_rss_bytes": 0,
                                                              "bytes_by_tag": defaultdict(int)})

    def observe(self, step, results) -> None:
        if step.prefill is not None or any(p.group_prefill_rows for p in step.plans.values()):
            return
        self.steps += 1
        for result in results:
            rank = self.per_rank[result.cp_rank]
            rank["collectives"] += result.num_collectives
            rank["comm_s"] += result.comm_s
            rank["decode_steps"] += sum(result.decode_steps.values())
            rank["peak_rss_bytes"] = max(rank["peak_rss_bytes"], result.peak_rss_bytes)
            rank["requests"] += len(step.plans[result.cp_rank].decode) if result.cp_rank in step.plans else 0
            for tag, moved in result.comm_bytes_by_tag.items():
                rank["bytes_by_tag"][tag] += moved

    def summary(self) -> dict:
        """Per decode step (inside worker calls) of each rank: collectives, ms per collective, bytes by tag."""
        ranks = []
        for r in sorted(self.per_rank):
            s = self.per_rank[r]
            n = max(s["decode_steps"], 1)
            ranks.append({
                "cp_rank": r, "decode_steps": s["decode_steps"], "request_steps_owned": s["requests"],
                "peak_rss_bytes": s["peak_rss_bytes"],
                "collectives_per_decode_step": s["collectives"] / n,
                "ms_per_collective": 1e3 * s["comm_s"] / s["collectives"] if s["collectives"] else 0.0,
                "comm_ms_per_decode_step": 1e3 * s["comm_s"] / n,
                "bytes_per_decode_step_by_tag": {t: s["bytes_by_tag"][t] / n for t in TAGS if s["bytes_by_tag"][t]},
            })
        return {"engine_steps": self.steps, "per_rank": ranks}


def prompt_ids(model_dir) -> list[list[int]]:
    """PROMPTS as token ids (the checkpoint's tokenizer), or short made-up ones without a tokenizer."""
    from model_workers.checkpoint.tokenizer import encode, load_tokenizer

    tokenizer = load_tokenizer(model_dir)
    return [encode(tokenizer, p) if tokenizer else [1 + i, 2 + i, 3 + i] for i, p in enumerate(PROMPTS)]


def measure_decode(engine, prompts: list[list[int]], batch: int, args) -> dict:
    """--repeats passes of greedy requests B at a time (EOS ignored, --max-tokens each) until every prompt ran
    once: the median pass's tokens/s, and the decode-only steps' collectives over all passes."""
    from cluster.engine_setup import run_all
    from cp_router.protocol import EngineRequest

    def requests(tag: str, max_tokens: int, first: int):
        return [EngineRequest(f"{tag}{batch}-{i}", tuple(prompts[i % len(prompts)]), max_tokens, 0.0,
                              ignore_eos=True, seed=i) for i in range(first, first + batch)]

    run_all(engine, requests("warm", 8, 0))
    record = DecodeRecord()
    engine.add_step_observer(record.observe)
    passes = []
    try:
        for repeat in range(args.repeats):
            start, tokens = time.perf_counter(), 0
            for first in range(0, max(batch, len(prompts)), batch):  # every prompt at least once, B at a time
                done = run_all(engine, requests(f"r{repeat}-", args.max_tokens, first))
                tokens += sum(len(r["token_ids"]) for r in done)
            passes.append((tokens / (time.perf_counter() - start), tokens))
    finally:
        engine.step_observers.remove(record.observe)
    rate, tokens = sorted(passes)[len(passes) // 2]
    return {"batch_size": batch, "tokens_per_pass": tokens, "tokens_per_s": rate,
            "tokens_per_s_passes": [p[0] for p in passes], **record.summary()}


def measure_prefills(engine, vocab_size: int, lengths: list[int], repeats: int) -> list[dict]:
    """One random prompt per length (seed 0), after a 256-token warm-up: `time_prefills`' numbers (median)."""
    import torch

    from cluster.bench.prefill_runs import time_prefills

    generator = torch.Generator().manual_seed(0)
    prompts = {n: torch.randint(0, vocab_size, (n,), generator=generator).tolist() for n in lengths}
    time_prefills(engine, prompts[lengths[0]][:256], 1, "prefill-warm")
    out = []
    for n, prompt in prompts.items():
        run = time_prefills(engine, prompt, repeats, f"prefill-{n}")
        out.append({"prompt_len": n, "ttft_s": run["wall_s"], "chunks": run["chunks"],
                    "per_rank_comm_s": run["per_rank_comm_s"], "per_rank_compute_s": run["per_rank_compute_s"],
                    "per_rank_comm_bytes": run["comm_bytes_per_rank"],
                    "peak_rss_bytes_per_rank": run["peak_rss_bytes_per_rank"]})
    return out


def run_group(model_dir, ep_size: int, k: int, prompts, batches: list[int], lengths: list[int], args) -> dict:
    """One engine (C ranks, EP = ep_size, k draft tokens): decode at every B, prefill (first k only), and
    what each rank holds."""
    import ray

    from cluster.config import ResolvedCPConfig
    from cluster.engine_spec import EngineOptions
    from cluster.ray_engine import start_engine
    from cp_router.cp.padding import ceil_div
    from model_workers.checkpoint.model_dir import load_model_config

    cp = ResolvedCPConfig(enabled=True, cp_size=args.cp_size, strategy="zigzag", impl="legacy", ep_size=ep_size)
    pages = ceil_div(max(lengths, default=0), 64) + 2 + max(batches) * ceil_div(64 + args.max_tokens + k + 1, 64)
    options = EngineOptions(args.dtype, num_pages=pages, page_size=64, num_speculative_steps=k,
                            max_steps_per_call=args.steps_per_call, enable_prefix_caching=False)
    engine, group = start_engine(model_dir, cp, options)
    try:
        out = {"ep_size": ep_size, "speculative_num_steps": k,
               "decode": [measure_decode(engine, prompts, b, args) for b in batches]}
        if lengths:
            out["prefill"] = measure_prefills(engine, load_model_config(model_dir).vocab_size, lengths, args.repeats)
            out["ranks"] = [ray.get(w.weights_info.remote()) for w in group.workers]
            out["threads_per_rank"] = options.threads_per_worker
            out["peak_rss_bytes_per_rank"] = peak_rss(out, args.cp_size)
        return out
    finally:
        group.shutdown()


def decode_comparison(groups: list[dict], cp_size: int) -> list[dict]:
    """Per (k, B): tokens/s without and with EP, their ratio, and the EP run's per-step collective costs."""
    rows = []
    for ep_run in (g for g in groups if g["ep_size"] == cp_size):
        base = next(g for g in groups if g["ep_size"] == 1 and g["speculative_num_steps"] == ep_run["speculative_num_steps"])
        for with_ep, without in zip(ep_run["decode"], base["decode"]):
            rows.append({
                "speculative_num_steps": ep_run["speculative_num_steps"], "batch_size": with_ep["batch_size"],
                "no_ep_tokens_per_s": without["tokens_per_s"], "ep_tokens_per_s": with_ep["tokens_per_s"],
                "ep_over_no_ep": with_ep["tokens_per_s"] / without["tokens_per_s"],
                "no_ep_collectives_per_decode_step": [r["collectives_per_decode_step"] for r in without["per_rank"]],
                "ep_per_rank": with_ep["per_rank"],
            })
    return rows


def prefill_comparison(groups: list[dict], cp_size: int) -> list[dict]:
    """Per prompt length: time to first token and collective seconds (max over ranks), EP = 1 and EP = C."""
    runs = {g["ep_size"]: g["prefill"] for g in groups if "prefill" in g}
    rows = []
    for without, with_ep in zip(runs[1], runs[cp_size]):
        rows.append({"prompt_len": without["prompt_len"], "chunks": without["chunks"],
                     "no_ep_ttft_s": without["ttft_s"], "ep_ttft_s": with_ep["ttft_s"],
                     "ep_over_no_ep_ttft": with_ep["ttft_s"] / without["ttft_s"],
                     "no_ep_comm_s": max(without["per_rank_comm_s"]), "ep_comm_s": max(with_ep["per_rank_comm_s"]),
                     "no_ep_comm_bytes": max(without["per_rank_comm_bytes"]),
                     "ep_comm_bytes": max(with_ep["per_rank_comm_bytes"])})
    return rows


def peak_rss(run: dict, cp_size: int) -> list[int]:
    """Each rank's peak RSS (a process maximum) over every step the group's engine reported."""
    seen = [[r["peak_rss_bytes"] for d in run["decode"] for r in d["per_rank"] if r["cp_rank"] == rank]
            + [p["peak_rss_bytes_per_rank"][rank] for p in run.get("prefill", []) if len(p["peak_rss_bytes_per_rank"]) > rank]
            for rank in range(cp_size)]
    return [max(values, default=0) for values in seen]


def memory_comparison(model_dir, groups: list[dict], cp_size: int) -> list[dict]:
    """Per EP size and rank: peak RSS, checkpoint bytes read, parameter bytes, and the capacity plan's bytes."""
    from model_workers.checkpoint.capacity import plan

    rows = []
    for g in (g for g in groups if "ranks" in g):
        planned = plan(model_dir, cp_size, g["ep_size"])["ranks"]
        for rank, info in enumerate(g["ranks"]):
            rows.append({"ep_size": g["ep_size"], "cp_rank": rank, "experts": info["experts"],
                         "peak_rss_bytes": g["peak_rss_bytes_per_rank"][rank],
                         "weight_bytes_read": info["weight_bytes_read"], "parameter_bytes": info["parameter_bytes"],
                         "plan_weight_bytes": planned[rank]["weight_bytes"],
                         "parameter_over_plan": info["parameter_bytes"] / planned[rank]["weight_bytes"]})
    return rows


def run_ep(args: argparse.Namespace) -> int:
    import torch

    from cluster.engine_spec import EngineOptions
    from cluster.launch import engine_cpus, ray_session
    from model_workers.checkpoint.model_dir import resolve_model_dir
    from model_workers.checkpoint.model_dir import load_model_config
    from model_workers.precision import (
        compute_dtype,
        cpu_has_native_bf16,
        storage_dtype,
    )

    ks = int_list(args.speculative_num_steps, "--speculative-num-steps", 0, MAX_SPECULATIVE_STEPS)
    batches = int_list(args.batch_size, "--batch-size", 1, 256)
    lengths = int_list(args.prompt_len, "--prompt-len", 1, 1 << 20)
    if args.max_tokens < 1 or args.repeats < 1:
        raise ValueError("--max-tokens and --repeats must be >= 1")
    model_dir = resolve_model_dir(args.model)
    config = load_model_config(model_dir)
    if args.cp_size < 2 or config.n_routed_experts % args.cp_size:
        raise ValueError(f"--cp-size {args.cp_size}: needs >= 2 ranks dividing {config.n_routed_experts} experts")
    groups = []
    with ray_session(engine_cpus(args.cp_size), None):
        for ep_size in (1, args.cp_size):
            for i, k in enumerate(ks):
                group = run_group(model_dir, ep_size, k, prompt_ids(model_dir), batches, lengths if i == 0 else [], args)
                groups.append(group)
    compute = str(compute_dtype(storage_dtype(args.dtype), "cpu")).removeprefix("torch.")
    result = {
        "bench": "ep", "command": spelled_command("ep", args, EP_FLAGS), "model": str(model_dir),
        "model_fingerprint": model_fingerprint(model_dir),
        "machine": {"nproc": os.cpu_count(), "torch_threads_per_rank": EngineOptions().threads_per_worker,
                    "native_bf16": cpu_has_native_bf16(), "torch": torch.__version__, "backend": "gloo (loopback)"},
        "cp_size": args.cp_size, "ep_sizes": [1, args.cp_size], "cp_strategy": "zigzag", "cp_impl": "legacy",
        "dtype": args.dtype, "compute_dtype": compute, "max_tokens": args.max_tokens,
        "model_shape": {"n_routed_experts": config.n_routed_experts, "num_experts_per_tok": config.num_experts_per_tok,
                        "num_hidden_layers": config.num_hidden_layers, "hidden_size": config.hidden_size},
        "precision_note": (f"the checkpoint is stored in {args.dtype} (what `dsa-serve plan` counts); CPU workers "
                           f"hold weights in {compute} (model_workers/precision.py: no native bf16 here), so "
                           "parameter_bytes is about twice plan_weight_bytes"),
        "decode": decode_comparison(groups, args.cp_size),
        "prefill": prefill_comparison(groups, args.cp_size) if lengths else [],
        "memory": memory_comparison(model_dir, groups, args.cp_size) if lengths else [],
        "runs": groups,
    }
    if args.json:
        print_result(json.dumps(result))
    else:
        for row in result["decode"]:
            print_result(f"k={row['speculative_num_steps']} B={row['batch_size']}:"
                         f" {row['no_ep_tokens_per_s']:.1f} tok/s without EP, {row['ep_tokens_per_s']:.1f} with"
                         f" (x{row['ep_over_no_ep']:.2f})")
    return 0
