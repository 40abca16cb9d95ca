"""`dsa-serve train-tiny`: rebuild the embedded default model from this interpreter's standard library."""

from __future__ import annotations

import argparse
import json


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
    if args.steps is not None and args.steps < 1:
        raise ValueError(f"--steps must be >= 1, got {args.steps}")
    if args.layers is not None and args.layers < 1:
        raise ValueError(f"--layers must be >= 1, got {args.layers}")
    if args.threads is not None:
        if args.threads < 1:
            raise ValueError(f"--threads must be >= 1, got {args.threads}")
        import torch

        torch.set_num_threads(args.threads)
    log = train_tiny(args.out, minutes=args.minutes, steps=args.steps,
                     recipe=Recipe() if args.layers is None else Recipe(num_hidden_layers=args.layers))
    card = evaluate_and_write_card(args.out, log)
    print(json.dumps(card["held_out"], indent=2))
    return 0
