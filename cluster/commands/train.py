"""`dsa-serve train-tiny`: rebuild the embedded default model from this interpreter's standard library."""

from __future__ import annotations

import argparse
import json

from cluster.commands.args import apply_threads, check_at_least_one


def add_parser(commands) -> None:
    parser = commands.add_parser("train-tiny", help="train the small default DSA + MTP model on the stdlib sources")
    parser.add_argument("--out", required=True, help="output checkpoint folder")
    parser.add_argument("--minutes", type=float, default=40.0, help="wall-clock budget (sets the step count)")
    parser.add_argument("--steps", type=int, default=None, help="exact step count (reproducible; overrides --minutes)")
    parser.add_argument("--layers", type=int, default=None,
                        help="target decoder layers under the one MTP layer (default: the recipe's, 4)")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from model_workers.training.model_card import evaluate_and_write_card
    from model_workers.training.recipe import Recipe
    from model_workers.training.trainer import train_tiny

    if args.minutes <= 0:
        raise ValueError(f"--minutes must be > 0, got {args.minutes}")
    check_at_least_one("--steps", args.steps)
    check_at_least_one("--layers", args.layers)
    apply_threads(args.threads)
    log = train_tiny(args.out, minutes=args.minutes, steps=args.steps,
                     recipe=Recipe() if args.layers is None else Recipe(num_hidden_layers=args.layers))
    card = evaluate_and_write_card(args.out, log)
    print(json.dumps(card["held_out"], indent=2))
    return 0
