"""`dsa-serve bench KIND`: benchmarks that print JSON (and draw a PNG with --plot).

prefill: CP scaling over prompt lengths; attention: sparse vs dense per layer; decode: MTP speculation;
serve: HTTP load against the in-process engine and `transformers`; report: BENCHMARKS.md from results.
"""

from __future__ import annotations

from . import bench_attention, bench_decode, bench_prefill, bench_report, bench_serve


def add_parser(commands) -> None:
    bench = commands.add_parser("bench", help="benchmarks that print JSON")
    kinds = bench.add_subparsers(dest="bench_kind", required=True)
    bench_prefill.add_parser(kinds)
    bench_attention.add_parser(kinds)
    bench_decode.add_parser(kinds)
    bench_serve.add_parser(kinds)
    bench_report.add_parser(kinds)
