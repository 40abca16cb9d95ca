"""What the benchmarks share: the code prompts they decode and the spelled-out command of a result."""

from __future__ import annotations

import argparse
import shlex

PROMPTS = (
    "def __init__(self", "import os\nimport sys\n\n", "class Parser:\n    ", "for i in range(",
    "    return self.", "if __name__ == '__main__':\n", "def read(path):\n    with open(", "# Copyright",
)


def spelled_command(kind: str, args: argparse.Namespace, names: tuple[str, ...]) -> str:
    """`dsa-serve bench KIND --flag value ...` with every setting in `names` spelled out (flags set to True
    appear bare, False / None ones are left out) and --json: the command that reproduces the result."""
    words = ["dsa-serve", "bench", kind]
    for name in names:
        value = getattr(args, name)
        if value is None or value is False:
            continue
        words.append("--" + name.replace("_", "-"))
        if value is not True:
            words.append(str(value))
    return shlex.join(words + ["--json"])
