"""`dsa-serve bench KIND`: the benchmarks a deployment or a user runs; each prints JSON (and draws a PNG with --plot).

prefill: CP scaling over prompt lengths; attention: sparse vs dense per layer; decode: MTP speculation;
serve: a closed-loop HTTP load against any OpenAI-compatible URL (or a server it starts), next to the in-process
engine; ep: expert parallelism against none on one group; ep-exchange: the MoE exchange's collective shapes at
DeepSeek-V3.2 sizes; kv-cache: FP8 vs bf16 KV accuracy and bytes; structured: grammar mask overhead and the
validity of schema-constrained outputs; pd: prefill/decode disaggregation against colocated.
The measuring harness (the `transformers` baselines, the long workload, the soak, BENCHMARKS.md and its targets)
is the repository's `benchmarks/` folder, not installed: `python -m benchmarks KIND` from a checkout
(docs/benchmarks.md). `bench soak` and `bench report` answer with that command.
"""

from __future__ import annotations

import argparse

from cluster.bench import attention, decode, ep_exchange, expert_parallel, kv_cache, pd, prefill, serve, structured
from cluster.commands.result_output import with_results_only_on_stdout

IN_HARNESS = ("soak", "report")  # kinds that moved to `python -m benchmarks`


def add_parser(commands) -> None:
    bench = commands.add_parser("bench", help="benchmarks that print JSON")
    kinds = bench.add_subparsers(dest="bench_kind", required=True)
    prefill.add_parser(kinds)
    attention.add_parser(kinds)
    decode.add_parser(kinds)
    serve.add_parser(kinds)
    expert_parallel.add_parser(kinds)
    ep_exchange.add_parser(kinds)
    kv_cache.add_parser(kinds)
    structured.add_parser(kinds)
    pd.add_parser(kinds)
    for kind in kinds.choices.values():  # the result alone on stdout (result_output.py)
        kind.set_defaults(run=with_results_only_on_stdout(kind.get_default("run")))
    for name in IN_HARNESS:
        moved = kinds.add_parser(name, help=f"moved: python -m benchmarks {name} (from a checkout)", add_help=False,
                                 prefix_chars="\0")  # every word after it is taken, flags too: the answer is the same
        moved.add_argument("words", nargs="*")
        moved.set_defaults(run=in_harness)


def in_harness(args: argparse.Namespace) -> int:
    raise ValueError(f"`dsa-serve bench {args.bench_kind}` is part of the repository's measuring harness, which is "
                     f"not installed: run `python -m benchmarks {args.bench_kind} ...` from a checkout "
                     "(docs/benchmarks.md)")
