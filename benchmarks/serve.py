"""`python -m benchmarks serve`: `dsa-serve bench serve` with its `transformers` comparisons.

The same flags and measurement as the installed load generator (cluster/bench/serve.py: HTTP against the
in-process engine in alternating rounds), plus:
- the short workload: the same prompts through `transformers` `generate` in batches of C (transformers_baseline.py),
  unless --skip-transformers;
- `--workload long`: held-out prompts of 4k-16k tokens, `transformers` one request at a time and the prefill's
  FLOP efficiency (serve_long.py);
- `--workload shared-prefix` runs as in the package (the prefix cache on against off; no `transformers` side).
The result's `command` starts with `python -m benchmarks serve`; its fields are those of `dsa-serve bench serve`.
"""

from __future__ import annotations

import argparse

from benchmarks.serve_long import add_long_arguments, reject_long_flags, resolve_workload, run_long
from benchmarks.transformers_baseline import run_baseline
from cluster.bench import serve as package_serve
from cluster.bench.serve import add_arguments, check_arguments, run_short
from cluster.bench.shared_prefix import WORKLOAD as SHARED_PREFIX


def add_parser(kinds) -> None:
    bench = kinds.add_parser("serve", help="HTTP server under load: TTFT, ITL, tokens/s vs in-process and transformers")
    add_arguments(bench)
    add_long_arguments(bench)
    bench.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    if args.workload == SHARED_PREFIX:
        reject_long_flags(args)
        return package_serve.run(args)
    levels = check_arguments(args, resolve_workload)
    if args.workload == "long":
        return run_long(args, levels)
    return run_short(args, levels, run_baseline)
