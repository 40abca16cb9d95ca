"""`dsa-serve bench structured`: structured outputs on the in-process engine (C = 1), two measurements in one run.

* mask overhead: decode tokens/s of S streams (default 32), every request constrained by a JSON schema that keeps it
  going to max_tokens (an array of at least that many integers), against the same streams unconstrained (ignore_eos,
  the same budget); runs alternate, `--repeats` pairs, the ratio is of the medians;
* validity: every schema of the suite (cluster/bench/schema_suite.py) constrains one greedy and one seeded request;
  each output must parse and validate (jsonschema, formats checked). Failures are listed with their reason.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from cluster.bench.common import model_fingerprint, spelled_command
from cluster.bench.serve_result import machine
from cluster.commands.result_output import print_result

STRUCTURED_FLAGS = ("model", "streams", "max_tokens", "repeats", "schemas", "schema_max_tokens", "speculative_num_steps")
JSON_PROMPT = "import json\n\nCONFIG = json.loads('"
MASK_PROMPT = "values = ["


def add_parser(kinds) -> None:
    bench = kinds.add_parser("structured", help="structured outputs: grammar mask overhead and schema validity")
    bench.add_argument("--model", default=None, help="checkpoint folder with a tokenizer (default: the embedded one)")
    bench.add_argument("--streams", type=int, default=32, help="concurrent constrained requests (mask overhead)")
    bench.add_argument("--max-tokens", type=int, default=128, help="tokens per request (mask overhead)")
    bench.add_argument("--repeats", type=int, default=5, help="constrained / unconstrained run pairs")
    bench.add_argument("--schemas", type=int, default=0, help="schemas of the suite to check (0: all)")
    bench.add_argument("--schema-max-tokens", type=int, default=1024, help="budget of a schema-constrained request")
    bench.add_argument("--speculative-num-steps", type=int, default=0, help="MTP drafts per step")
    bench.add_argument("--json", action="store_true", help="print one JSON object")
    bench.set_defaults(run=run_structured)


def engine_for(model_dir, args: argparse.Namespace):
    from cluster.engine_setup import start_local_engine
    from cluster.engine_spec import EngineOptions

    pages = args.streams * (-(-(args.max_tokens + 64) // 16)) + 64
    return start_local_engine(model_dir, EngineOptions(num_pages=max(pages, 512), page_size=16,
                                                       num_speculative_steps=args.speculative_num_steps,
                                                       enable_prefix_caching=False))


def timed_run(engine, requests) -> dict:
    from cluster.engine_setup import run_all

    start = time.perf_counter()
    outputs = run_all(engine, requests)
    seconds = time.perf_counter() - start
    tokens = sum(len(out["token_ids"]) for out in outputs)
    return {"seconds": round(seconds, 3), "tokens": tokens, "tokens_per_s": round(tokens / seconds, 1)}


def mask_overhead(engine, prompt: tuple[int, ...], args: argparse.Namespace) -> dict:
    from cp_router.grammar_spec import GrammarSpec
    from cp_router.protocol import EngineRequest

    schema = {"type": "array", "items": {"type": "integer"}, "minItems": args.max_tokens}
    spec = GrammarSpec("json_schema", json.dumps(schema))

    def requests(kind: str, repeat: int):
        return [EngineRequest(f"{kind}-{repeat}-{i}", prompt, args.max_tokens, temperature=0.8, seed=i,
                              ignore_eos=kind == "free", grammar=spec if kind == "constrained" else None)
                for i in range(args.streams)]

    timed_run(engine, requests("constrained", -1))  # warm-up: the compile, the first steps
    runs = {"constrained": [], "free": []}
    for repeat in range(args.repeats):
        for kind in ("free", "constrained") if repeat % 2 else ("constrained", "free"):
            runs[kind].append(timed_run(engine, requests(kind, repeat)))
    medians = {kind: statistics.median(r["tokens_per_s"] for r in runs[kind]) for kind in runs}
    return {"streams": args.streams, "max_tokens": args.max_tokens, "runs": runs,
            "median_tokens_per_s": medians, "ratio": round(medians["constrained"] / medians["free"], 3),
            "target": ">= 0.85"}


def schema_validity(engine, prompt: tuple[int, ...], args: argparse.Namespace) -> dict:
    import jsonschema

    from cluster.bench.schema_suite import SCHEMAS
    from cluster.engine_setup import run_all
    from cp_router.grammar_spec import GrammarSpec
    from cp_router.protocol import EngineRequest

    schemas = SCHEMAS[: args.schemas] if args.schemas else SCHEMAS
    requests = [EngineRequest(f"schema{i}-{t}", prompt, args.schema_max_tokens, temperature=t, seed=i,
                              grammar=GrammarSpec("json_schema", json.dumps(schema)))
                for i, schema in enumerate(schemas) for t in (0.0, 0.8)]
    outputs = run_all(engine, requests)
    failures, checker = [], jsonschema.FormatChecker()
    for request, out in zip(requests, outputs):
        try:
            jsonschema.validate(json.loads(out["text"]), json.loads(request.grammar.source), format_checker=checker)
        except (ValueError, jsonschema.ValidationError) as exc:
            failures.append({"request": request.request_id, "finish_reason": out["finish_reason"],
                             "tokens": len(out["token_ids"]), "reason": " ".join(str(exc).split())[:200]})
    lengths = [len(out["token_ids"]) for out in outputs]
    return {"schemas": len(schemas), "requests": len(requests), "valid": len(requests) - len(failures),
            "valid_fraction": round(1 - len(failures) / len(requests), 4), "failures": failures,
            "mean_tokens": round(sum(lengths) / len(lengths), 1), "max_tokens_used": max(lengths),
            "target": "1.0"}


def run_structured(args: argparse.Namespace) -> int:
    from model_workers.checkpoint.model_dir import resolve_model_dir
    from model_workers.checkpoint.tokenizer import load_tokenizer

    model_dir = resolve_model_dir(args.model)
    tokenizer = load_tokenizer(model_dir)
    if tokenizer is None:
        raise ValueError(f"--model: {model_dir} has no tokenizer.json; structured outputs need one")
    engine = engine_for(model_dir, args)
    result = {"bench": "structured", "command": spelled_command("structured", args, STRUCTURED_FLAGS),
              "model": str(model_dir), "model_fingerprint": model_fingerprint(model_dir), "machine": machine(),
              "speculative_num_steps": args.speculative_num_steps,
              "mask_overhead": mask_overhead(engine, tuple(tokenizer.encode(MASK_PROMPT).ids), args),
              "validity": schema_validity(engine, tuple(tokenizer.encode(JSON_PROMPT).ids), args)}
    print_result(json.dumps(result, indent=None if args.json else 2))
    return 0
