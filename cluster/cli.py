"""`dsa-serve` command line: one sub-command per module, arguments validated here at the edge."""

from __future__ import annotations

import argparse
import sys

from . import bench_cmd, generate_cmd, serve_cmd, train_cmd


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dsa-serve", description="Serve DeepSeek-Sparse-Attention models.")
    commands = parser.add_subparsers(dest="command", required=True)
    generate_cmd.add_parser(commands)
    train_cmd.add_parser(commands)
    bench_cmd.add_parser(commands)
    serve_cmd.add_parser(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.run(args) or 0
    except (ValueError, FileNotFoundError) as exc:
        print(f"dsa-serve {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
