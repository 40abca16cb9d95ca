"""`dsa-serve distill-mtp`: teach a checkpoint's MTP layer its own target's predictions (model_workers/training/
mtp_distill.py); the target's weights are written back unchanged, so only speculation's acceptance moves."""

from __future__ import annotations

import argparse
import json

from cluster.commands.args import apply_threads, check_at_least_one


def add_parser(commands) -> None:
    parser = commands.add_parser("distill-mtp", help="self-distil the MTP layer of a train-tiny checkpoint (target frozen)")
    parser.add_argument("--model", required=True, help="source checkpoint folder, as train-tiny wrote it")
    parser.add_argument("--out", required=True, help="output checkpoint folder (a copy of the source, new MTP weights)")
    parser.add_argument("--steps", type=int, default=None, help="training steps (default: the recipe's, 500)")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from model_workers.training.distill_checkpoint import distill_checkpoint
    from model_workers.training.mtp_distill import DistillRecipe

    check_at_least_one("--steps", args.steps)
    apply_threads(args.threads)
    recipe = DistillRecipe() if args.steps is None else DistillRecipe(steps=args.steps)
    card = distill_checkpoint(args.model, args.out, recipe)
    print(json.dumps(card["held_out"], indent=2))
    return 0
