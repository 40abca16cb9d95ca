"""What the benchmarks share: the code prompts they decode, prompts cut from the held-out source files, and the
spelled-out command of a result."""

from __future__ import annotations

import argparse
import shlex

PROMPTS = (
    "def __init__(self", "import os\nimport sys\n\n", "class Parser:\n    ", "for i in range(",
    "    return self.", "if __name__ == '__main__':\n", "def read(path):\n    with open(", "# Copyright",
)
PROGRAM = "dsa-serve bench"  # what a result's `command` starts with, unless the parser sets `command_prefix`
MIN_REQUESTS_PER_LEVEL = 32  # TTFT p50 at one stream from 16 requests per path (8 per round) spread 1.07-1.34x


def spelled_command(kind: str, args: argparse.Namespace, names: tuple[str, ...],
                    negatable: tuple[str, ...] = ()) -> str:
    """`dsa-serve bench KIND --flag value ...` with every setting in `names` spelled out (flags set to True
    appear bare, False / None ones are left out, but False is `--no-flag` for the `negatable` ones) and --json:
    the command that reproduces the result. `args.command_prefix`, where a parser sets it, replaces `dsa-serve
    bench` (the repository's harness sets `python -m benchmarks`)."""
    words = [*shlex.split(getattr(args, "command_prefix", PROGRAM)), kind]
    for name in names:
        value = getattr(args, name)
        if value is False and name in negatable:
            words.append("--no-" + name.replace("_", "-"))
        if value is None or value is False:
            continue
        words.append("--" + name.replace("_", "-"))
        if value is not True:
            words.append(str(value))
    return shlex.join(words + ["--json"])


class _EndOfFileAs:
    """A tokenizer whose `<|endoftext|>` is the model's EOS id: `token_stream` joins files with it, and a
    checkpoint's own tokenizer (DeepSeek's, GLM's) names its end-of-text token differently."""

    def __init__(self, tokenizer, eos_id: int):
        self.tokenizer, self.eos_id = tokenizer, eos_id

    def encode_batch(self, *args, **kwargs):
        return self.tokenizer.encode_batch(*args, **kwargs)

    def token_to_id(self, token: str) -> int | None:
        from model_workers.training.corpus import EOS_TOKEN

        return self.eos_id if token == EOS_TOKEN else self.tokenizer.token_to_id(token)


def held_out_stream(model_dir, what: str) -> list[int]:
    """The held-out standard-library sources (model_workers/training/corpus.py) as one token stream of the
    checkpoint's tokenizer, files joined by EOS; ValueError naming `what` when the checkpoint has no tokenizer."""
    from model_workers.checkpoint.tokenizer import load_tokenizer
    from model_workers.checkpoint.model_dir import load_model_config
    from model_workers.training.corpus import EOS_TOKEN, stdlib_files, token_stream

    tokenizer = load_tokenizer(model_dir)
    if tokenizer is None:
        raise ValueError(f"--model {model_dir}: {what} needs the checkpoint's tokenizer.json")
    if tokenizer.token_to_id(EOS_TOKEN) is None:
        eos_ids = load_model_config(model_dir).eos_token_ids
        if not eos_ids:
            raise ValueError(f"--model {model_dir}: {what}: the tokenizer has no {EOS_TOKEN} and config.json no "
                             "eos_token_id to join the held-out files with")
        tokenizer = _EndOfFileAs(tokenizer, eos_ids[0])
    return token_stream(tokenizer, stdlib_files().held_out).tolist()


def window_offsets(total: int, count: int, length: int, flags: str) -> list[int]:
    """Starts of `count` distinct, non-overlapping windows of `length` tokens spread evenly over a stream of
    `total` tokens (window i at i * ((total - length) // count)); ValueError naming `flags` when they do not fit."""
    step = (total - length) // max(1, count)
    if count < 1 or length < 1 or length > total or (count > 1 and step < length):
        raise ValueError(f"{flags}: {count} non-overlapping prompt(s) of {length} tokens do not fit the "
                         f"{total} tokens of the held-out files")
    return [i * step for i in range(count)]


def cut_windows(stream: list[int], count: int, length: int, flags: str) -> list[list[int]]:
    """The windows of `window_offsets` cut from `stream`."""
    return [stream[start : start + length] for start in window_offsets(len(stream), count, length, flags)]


def model_fingerprint(model_dir) -> dict:
    """Which model a result was measured on, cheaply: config.json's depth and the weights' sha256 prefix as the
    model card records it (None for a checkpoint without a card; hundreds of GB are not hashed here)."""
    import json
    from pathlib import Path

    model_dir = Path(model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    card_path = model_dir / "model_card.json"
    sha = json.loads(card_path.read_text()).get("sha256", {}).get("model.safetensors") if card_path.is_file() else None
    return {"num_hidden_layers": config.get("num_hidden_layers"), "weights_sha256": sha[:16] if sha else None}
