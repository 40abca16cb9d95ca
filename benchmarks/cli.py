"""The harness's command line: `python -m benchmarks serve | soak | report`, arguments checked here at the edge.

serve: `dsa-serve bench serve` plus its `transformers` baseline, and `--workload long`; soak: a real server under
mixed load with disconnects, checked for leaks; report: BENCHMARKS.md and its plots from a folder of results.
As with `dsa-serve bench`, a command's result alone goes to stdout; a bad flag exits 2 naming it.
"""

from __future__ import annotations

import argparse
import sys

from benchmarks import HARNESS_PROGRAM, report, serve, soak
from cluster.commands.aliases import resolve_speculation
from cluster.commands.result_output import with_results_only_on_stdout


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=HARNESS_PROGRAM, description="The measuring harness of dsa-serve (from a "
                                                                       "checkout; docs/benchmarks.md).")
    kinds = parser.add_subparsers(dest="bench_kind", required=True)
    serve.add_parser(kinds)
    soak.add_parser(kinds)
    report.add_parser(kinds)
    for kind in kinds.choices.values():
        kind.set_defaults(run=with_results_only_on_stdout(kind.get_default("run")), command_prefix=HARNESS_PROGRAM)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        resolve_speculation(args)
        return args.run(args) or 0
    except (ValueError, FileNotFoundError) as exc:
        print(f"{HARNESS_PROGRAM} {args.bench_kind}: error: {exc}", file=sys.stderr)
        return 2
