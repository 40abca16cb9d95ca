"""The training corpus: this interpreter's standard-library Python sources, and a byte-level BPE over them.

Every machine that runs the project has these files, so the default model is rebuilt without any
download. The file list is sorted and the train / held-out split is fixed by position in that list.
"""

from __future__ import annotations

import json
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

EOS_TOKEN = "<|endoftext|>"
HELD_OUT_EVERY = 20  # every 20th file of the sorted list is held out
# Left out: installed packages, tests, and generated data (codec tables, pydoc topic dumps) whose
# repetitive literals would dominate a small model's training.
EXCLUDED_DIRS = {"site-packages", "dist-packages", "test", "tests", "idlelib", "lib2to3", "__pycache__",
                 "encodings", "pydoc_data"}


@dataclass(frozen=True)
class CorpusFiles:
    root: Path
    train: tuple[Path, ...]
    held_out: tuple[Path, ...]


def stdlib_files(root: Path | None = None) -> CorpusFiles:
    root = Path(root or sysconfig.get_paths()["stdlib"])
    files = sorted(
        f for f in root.rglob("*.py") if not EXCLUDED_DIRS & set(f.relative_to(root).parts[:-1])
    )
    if not files:
        raise FileNotFoundError(f"no Python sources under {root}")
    held_out = tuple(f for i, f in enumerate(files) if i % HELD_OUT_EVERY == 0)
    train = tuple(f for i, f in enumerate(files) if i % HELD_OUT_EVERY != 0)
    return CorpusFiles(root, train, held_out)


def read_text(path: Path) -> str:
    return path.read_text(encoding="utf-8", errors="replace")


def train_tokenizer(files: tuple[Path, ...], vocab_size: int) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator((read_text(f) for f in files), trainer=trainer)
    return tokenizer


# The default model's chat: a conversation as Python comments, the text it was trained on. With
# chat_template_kwargs {"enable_thinking": true} the answer opens a <think> block (the model, trained on source code
# only, does not close it: what it writes is returned as reasoning_content under --reasoning-parser).
CHAT_TEMPLATE = """{% for message in messages %}
# {{ message.role }}: {{ message.content }}
{% endfor %}
{% if add_generation_prompt %}
# assistant:{{ ' <think>' if enable_thinking else '' }}
{% endif %}
"""


def save_tokenizer(tokenizer: Tokenizer, out_dir: Path, max_length: int) -> None:
    tokenizer.save(str(out_dir / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": EOS_TOKEN,
        "bos_token": EOS_TOKEN,
        "model_max_length": max_length,
        "clean_up_tokenization_spaces": False,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out_dir / "chat_template.jinja").write_text(CHAT_TEMPLATE)


def token_stream(tokenizer: Tokenizer, files: tuple[Path, ...]) -> torch.Tensor:
    """All files tokenized and joined, each followed by EOS: [N] int64."""
    eos = tokenizer.token_to_id(EOS_TOKEN)
    encoded = tokenizer.encode_batch([read_text(f) for f in files], add_special_tokens=False)
    ids: list[int] = []
    for item in encoded:
        ids.extend(item.ids)
        ids.append(eos)
    return torch.tensor(ids, dtype=torch.long)
