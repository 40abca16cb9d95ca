"""Command lines users bring from SGLang and vLLM, mapped onto ours at the edge (one line for what we lack).

SGLang: `--attn-cp-size C` (our --cp-size), `--enable-prefill-cp` (prefill CP is on whenever C > 1),
`--speculative-algorithm {EAGLE,NEXTN,MTP}` with `--speculative-eagle-topk 1` and
`--speculative-num-draft-tokens k+1`. vLLM: `--speculative-config '{"method": "mtp", "num_speculative_tokens":
k}'`. All of them resolve to `speculative_num_steps = k` (the checkpoint's MTP layers draft a chain of k).
`--config FILE.yaml` (vLLM's) takes flag names as keys; flags on the command line win over the file.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

SPECULATIVE_ALGORITHMS = ("EAGLE", "NEXTN", "MTP")  # SGLang's names of MTP-layer drafting for DeepSeek models
SPECULATIVE_METHODS = ("mtp", "deepseek_mtp", "eagle")  # vLLM's, when no separate draft model is named
SPECULATIVE_CONFIG_KEYS = ("method", "num_speculative_tokens")


def add_speculative_aliases(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--speculative-algorithm", default=None, metavar="{EAGLE,NEXTN,MTP}",
                        help="SGLang's: MTP-layer drafting (give the draft count with --speculative-num-steps)")
    parser.add_argument("--speculative-eagle-topk", type=int, default=None, help="SGLang's: only 1 (a chain)")
    parser.add_argument("--speculative-num-draft-tokens", type=int, default=None,
                        help="SGLang's: k + 1 (the verified tokens per step)")
    parser.add_argument("--speculative-config", default=None,
                        help='vLLM\'s: \'{"method": "mtp", "num_speculative_tokens": k}\'')


def resolve_speculation(args: argparse.Namespace) -> None:
    """Sets `args.speculative_num_steps` from whichever form was given; ValueError when they disagree."""
    if not hasattr(args, "speculative_config"):
        return
    sources = {}
    if args.speculative_num_steps is not None:
        sources["--speculative-num-steps"] = args.speculative_num_steps
    if args.speculative_num_draft_tokens is not None:
        if args.speculative_num_draft_tokens < 1:
            raise ValueError(f"--speculative-num-draft-tokens must be >= 1 (k + 1), "
                             f"got {args.speculative_num_draft_tokens}")
        sources["--speculative-num-draft-tokens - 1"] = args.speculative_num_draft_tokens - 1
    if args.speculative_config is not None:
        sources["--speculative-config num_speculative_tokens"] = speculative_config_steps(args.speculative_config)
    check_algorithm(args.speculative_algorithm, args.speculative_eagle_topk)
    if len(set(sources.values())) > 1:
        given = ", ".join(f"{name} = {value}" for name, value in sources.items())
        raise ValueError(f"the speculative draft counts disagree: {given}; give one of them")
    if args.speculative_algorithm is not None and not sources:
        raise ValueError("--speculative-algorithm needs a draft count: --speculative-num-steps k or "
                         "--speculative-num-draft-tokens k+1")
    args.speculative_num_steps = next(iter(sources.values()), 0)


def check_algorithm(algorithm: str | None, eagle_topk: int | None) -> None:
    if algorithm is not None and algorithm.upper() not in SPECULATIVE_ALGORITHMS:
        raise ValueError(f"--speculative-algorithm {algorithm} is not supported; allowed: "
                         f"{', '.join(SPECULATIVE_ALGORITHMS)} (drafting with the checkpoint's MTP layers)")
    if eagle_topk is not None and eagle_topk != 1:
        raise ValueError(f"--speculative-eagle-topk {eagle_topk} is not supported; allowed: 1 (one chain of drafts)")


def speculative_config_steps(text: str) -> int:
    """k of vLLM's --speculative-config JSON; ValueError naming the key or method it cannot take."""
    try:
        config = json.loads(text)
    except ValueError:
        raise ValueError(f"--speculative-config must be a JSON object, got {text!r}") from None
    if not isinstance(config, dict):
        raise ValueError(f"--speculative-config must be a JSON object, got {text!r}")
    unknown = sorted(set(config) - set(SPECULATIVE_CONFIG_KEYS))
    if unknown:
        raise ValueError(f"--speculative-config: {', '.join(unknown)} not supported; allowed keys: "
                         f"{', '.join(SPECULATIVE_CONFIG_KEYS)} (the draft is the checkpoint's MTP layers)")
    if config.get("method") not in SPECULATIVE_METHODS:
        raise ValueError(f"--speculative-config method {config.get('method')!r} is not supported; allowed: "
                         f"{', '.join(SPECULATIVE_METHODS)}")
    steps = config.get("num_speculative_tokens")
    if not isinstance(steps, int) or isinstance(steps, bool) or steps < 0:
        raise ValueError(f"--speculative-config num_speculative_tokens must be an integer >= 0, got {steps!r}")
    return steps


def expand_config_file(argv: list[str]) -> list[str]:
    """`COMMAND ... --config FILE.yaml ...` -> the file's keys as flags right after COMMAND (so later flags win)."""
    if "--config" not in argv:
        return argv
    at = argv.index("--config")
    if at + 1 >= len(argv):
        raise ValueError("--config needs a YAML file")
    path, rest = Path(argv[at + 1]), argv[:at] + argv[at + 2:]
    return rest[:1] + config_flags(path) + rest[1:]


def config_flags(path: Path) -> list[str]:
    import yaml

    if not path.is_file():
        raise ValueError(f"--config {path}: no such file")
    values = yaml.safe_load(path.read_text()) or {}
    if not isinstance(values, dict):
        raise ValueError(f"--config {path}: must map flag names to values")
    flags = []
    for key, value in values.items():
        flag = "--" + str(key).replace("_", "-")
        if value is True:
            flags.append(flag)
        elif isinstance(value, list):
            flags += [flag, *map(str, value)]
        elif value is not None and value is not False:
            flags += [flag, json.dumps(value) if isinstance(value, dict) else str(value)]
    return flags
