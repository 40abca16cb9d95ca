"""`dsa-serve random-checkpoint`: a random checkpoint of a named shape in a family's release layout (DeepSeek-V4:
V4-Flash's proportions, scaled down), for benchmarks and `plan`; the family writes it (models/registry.py)."""

from __future__ import annotations

import argparse
import json

from model_workers.models.registry import FAMILIES

WRITERS = {family.name: family for family in FAMILIES if family.random_checkpoint is not None}


def add_parser(commands) -> None:
    parser = commands.add_parser("random-checkpoint",
                                 help="write a random DeepSeek-V4 checkpoint (release names) for benchmarks and plan")
    parser.add_argument("--out", required=True, help="output checkpoint folder")
    parser.add_argument("--family", choices=sorted(WRITERS), default="deepseek_v4", help="the model family")
    shapes = ", ".join(f"{name}: {', '.join(family.random_shapes)}" for name, family in WRITERS.items())
    parser.add_argument("--shape", default="small",
                        help=f"named shape ({shapes}; small: V4-Flash's proportions, scaled down)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"], help="stored dtype")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    import torch

    folder = WRITERS[args.family].random_checkpoint(args.out, args.shape, args.seed, getattr(torch, args.dtype))
    print(json.dumps({"out": str(folder), "shape": args.shape, "dtype": args.dtype}))
    return 0
