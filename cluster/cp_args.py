"""CP command-line options shared by the sub-commands (light: no Ray, no torch import)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from cluster.config import ResolvedCPConfig, parse_cp_config, resolve_cp_config


def add_cp_arguments(parser: argparse.ArgumentParser, required: bool = False) -> None:
    parser.add_argument("--cp-size", type=int, required=required, default=None,
                        help="context-parallel ranks (one Ray actor each); runs through Ray when given")
    parser.add_argument("--cp-strategy", choices=["zigzag", "interleave"], default="zigzag")
    parser.add_argument("--cp-impl", choices=["auto", "legacy", "v2"], default="auto")
    parser.add_argument("--ray-address", default=None, help="join this Ray cluster (default: start a local one)")


def resolve_cp_args(args: argparse.Namespace, model_dir: Path) -> ResolvedCPConfig:
    """The CP flags checked against the model's config.json (one-line errors naming the flag's field)."""
    fields = {"enable_prefill_cp": True, "cp_size": args.cp_size, "cp_strategy": args.cp_strategy,
              "cp_impl": args.cp_impl}
    return resolve_cp_config(parse_cp_config(fields), json.loads((model_dir / "config.json").read_text()))
