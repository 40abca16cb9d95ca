"""`dsa-serve bench KIND`: benchmarks that print JSON (and draw a PNG with --plot).

prefill: CP scaling over prompt lengths; attention: sparse vs dense per layer; decode: MTP speculation;
serve: HTTP load against the in-process engine and `transformers`; ep: expert parallelism against none on one
group; ep-exchange: the MoE exchange's collective shapes at DeepSeek-V3.2 sizes; kv-cache: FP8 vs bf16 KV
accuracy and bytes; soak: a real server under mixed load with disconnects, checked for leaks; report: BENCHMARKS.md
from results.
"""

from __future__ import annotations

from cluster.bench import (
    attention,
    decode,
    ep_exchange,
    expert_parallel,
    kv_cache,
    prefill,
    report,
    serve,
    soak,
)
from cluster.commands.result_output import with_results_only_on_stdout


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
    soak.add_parser(kinds)
    report.add_parser(kinds)
    for kind in kinds.choices.values():  # the result alone on stdout (result_output.py)
        kind.set_defaults(run=with_results_only_on_stdout(kind.get_default("run")))
