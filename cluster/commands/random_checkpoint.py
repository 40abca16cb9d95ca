"""`dsa-serve random-checkpoint`: a random DeepSeek-V4 checkpoint of a named shape, in the release layout."""

from __future__ import annotations

import argparse
import json


def add_parser(commands) -> None:
    parser = commands.add_parser("random-checkpoint",
                                 help="write a random DeepSeek-V4 checkpoint (release names) for benchmarks and plan")
    parser.add_argument("--out", required=True, help="output checkpoint folder")
    parser.add_argument("--shape", default="small", help="named V4 shape (small: V4-Flash's proportions, scaled down)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"], help="stored dtype")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    import torch

    from model_workers.checkpoint.v4_random import write_random_v4

    folder = write_random_v4(args.out, args.shape, args.seed, getattr(torch, args.dtype))
    print(json.dumps({"out": str(folder), "shape": args.shape, "dtype": args.dtype}))
    return 0
