"""`dsa-serve` command line: one sub-command per module, arguments validated here at the edge."""

from __future__ import annotations

import argparse
import sys

from cluster.commands import bench, distill, generate, plan, random_checkpoint, serve, train
from cluster.commands.aliases import expand_config_file, resolve_speculation


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dsa-serve", description="Serve DeepSeek-Sparse-Attention models.")
    commands = parser.add_subparsers(dest="command", required=True)
    generate.add_parser(commands)
    train.add_parser(commands)
    distill.add_parser(commands)
    bench.add_parser(commands)
    serve.add_parser(commands)
    plan.add_parser(commands)
    random_checkpoint.add_parser(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        argv = expand_config_file(argv)
    except ValueError as exc:
        print(f"dsa-serve: error: {exc}", file=sys.stderr)
        return 2
    args = build_parser().parse_args(argv)
    try:
        resolve_speculation(args)
        return args.run(args) or 0
    except (ValueError, FileNotFoundError) as exc:
        print(f"dsa-serve {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
