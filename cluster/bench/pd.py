"""`dsa-serve bench pd`: prefill/decode disaggregation against a colocated engine, in one run (docs/disaggregation.md).

Engines in this process over Ray rank actors (one process per rank, so the prefill and decode ranks compute at the
same time while the engines' loops share this process; no HTTP): the colocated engine has one group of --cp-size
ranks; the disaggregated one a prefill engine of --prefill-cp-size ranks and a decode engine of one rank, joined by
`DisaggregatedEngine`. Greedy, EOS ignored, prefix caching off. Three measurements (cluster/bench/pd_runs.py):

* isolation: --streams short streams decode while --long-prompts prompts of --long-len tokens arrive one after
  another; the short streams' gaps between chunks (inter-token latency), p50 / p99, for each engine;
* transfer: one --transfer-len prompt handed off: the page bytes (against ceil(L / page) * page * bytes per token),
  the ranks' read-out and write time, and the time to serialize and deserialize the hand-off twice (rank -> engine,
  engine -> rank, as Ray's object transport does), against that prompt's prefill time (its TTFT colocated);
* alone: one stream (--alone-len prompt, --alone-tokens tokens): TTFT and tokens/s, --repeats alternating runs each,
  medians compared.
"""

from __future__ import annotations

import argparse
import json

from cluster.bench.common import model_fingerprint, spelled_command
from cluster.bench.serve_result import machine
from cluster.commands.result_output import print_result

PD_FLAGS = ("model", "cp_size", "prefill_cp_size", "streams", "stream_tokens", "long_prompts", "long_len",
            "transfer_len", "alone_len", "alone_tokens", "repeats", "speculative_num_steps")
TARGETS = {"isolation_itl_p99_ratio": ("<=", 0.2), "transfer_over_prefill": ("<=", 0.10),
           "alone_ttft_ratio": (">=", 0.8), "alone_tokens_per_s_ratio": (">=", 0.8)}


def add_parser(kinds) -> None:
    bench = kinds.add_parser("pd", help="prefill/decode disaggregation against colocated: isolation, transfer, alone")
    bench.add_argument("--model", default=None, help="checkpoint folder (default: the embedded model)")
    bench.add_argument("--cp-size", type=int, default=1, help="ranks of the colocated group")
    bench.add_argument("--prefill-cp-size", type=int, default=1, help="ranks of the prefill group (decode: one)")
    bench.add_argument("--streams", type=int, default=8, help="short streams decoding during the long prefills")
    bench.add_argument("--stream-tokens", type=int, default=64, help="tokens of each short request (renewed)")
    bench.add_argument("--long-prompts", type=int, default=2, help="long prompts, one after another")
    bench.add_argument("--long-len", type=int, default=16384, help="tokens of a long prompt")
    bench.add_argument("--transfer-len", type=int, default=8192, help="prompt tokens of the transfer measurement")
    bench.add_argument("--alone-len", type=int, default=1024, help="prompt tokens of the lone stream")
    bench.add_argument("--alone-tokens", type=int, default=128, help="tokens the lone stream generates")
    bench.add_argument("--repeats", type=int, default=3, help="alternating runs of the lone stream per engine")
    bench.add_argument("--speculative-num-steps", type=int, default=0, help="MTP drafts per step (both engines)")
    bench.add_argument("--json", action="store_true", help="print one JSON object")
    bench.set_defaults(run=run_pd)


def run_pd(args: argparse.Namespace) -> int:
    from cluster.bench.pd_runs import measure
    from model_workers.checkpoint.model_dir import resolve_model_dir

    model_dir = resolve_model_dir(args.model)
    result = {"bench": "pd", "command": spelled_command("pd", args, PD_FLAGS), "machine": machine(),
              "model": str(model_dir), "model_fingerprint": model_fingerprint(model_dir), **measure(model_dir, args)}
    result["targets"] = {name: {"target": f"{op} {bound}", "value": result["ratios"][name],
                                "met": result["ratios"][name] <= bound if op == "<=" else result["ratios"][name] >= bound}
                         for name, (op, bound) in TARGETS.items()}
    print_result(json.dumps(result, indent=None if args.json else 2))
    return 0
