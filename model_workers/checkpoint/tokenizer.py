"""The text side of a checkpoint folder, read in one place: `tokenizer.json` and the chat template source.

`load_checkpoint_text` is what a process calls once: the tokenizer (through the `tokenizers` library, no
network) and the chat template as text with the special tokens it sees (compiling and rendering it is the
HTTP layer's job). Either may be absent: a folder without tokenizer.json serves token ids only.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

from model_workers.checkpoint.model_dir import CONFIG_FILE, read_config_json

SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token")
# model_type -> the special tokens its built-in encoding writes (cluster/http_api/deepseek_encoding.py renders it);
# a tokenizer without them is not that chat model's, and gets no chat template
BUILTIN_ENCODINGS = {"deepseek_v32": ("<｜User｜>", "<｜Assistant｜>", "<｜end▁of▁sentence｜>")}
CHAT_TEMPLATE_FILE = "chat_template.jinja"  # beside the tokenizer, as recent transformers save it (GLM-5 ships one)


@dataclass(frozen=True)
class ChatTemplateSource:
    """A chat template's Jinja source and the special tokens of tokenizer_config.json as text."""

    source: str
    special_tokens: dict[str, str] = field(default_factory=dict)
    builtin: str | None = None  # a model_type whose encoding is code, not Jinja (DeepSeek-V3.2); source is ""


@dataclass(frozen=True)
class CheckpointText:
    tokenizer: Tokenizer | None
    chat_template: ChatTemplateSource | None


def load_tokenizer(model_dir: str | Path) -> Tokenizer | None:
    path = Path(model_dir) / "tokenizer.json"
    return Tokenizer.from_file(str(path)) if path.is_file() else None


def encode(tokenizer: Tokenizer, text: str, add_special_tokens: bool = False) -> list[int]:
    """Token ids of `text`; with add_special_tokens, the tokenizer's post-processor adds its BOS (if it has one)."""
    return tokenizer.encode(text, add_special_tokens=add_special_tokens).ids


def decode(tokenizer: Tokenizer, ids: list[int]) -> str:
    return tokenizer.decode(ids, skip_special_tokens=False)


def _token_text(value: Any) -> str:
    """tokenizer_config.json stores special tokens as text or as {"content": text, ...}."""
    if isinstance(value, dict):
        return str(value.get("content", ""))
    return "" if value is None else str(value)


def _default_template(source: Any, path: Path) -> str:
    """`chat_template` is a string, or a list of {"name", "template"} of which "default" is used."""
    if isinstance(source, str):
        return source
    if isinstance(source, list):
        for entry in source:
            if isinstance(entry, dict) and entry.get("name") == "default":
                return str(entry["template"])
    raise ValueError(f"{path}: chat_template must be a string or a list with a 'default' entry")


def read_chat_template(model_dir: str | Path, template_file: str | Path | None = None,
                       model_type: str | None = None) -> ChatTemplateSource | None:
    """The chat template, first found of: `template_file` (--chat-template), `chat_template.jinja` in the folder,
    tokenizer_config.json's `chat_template`, the built-in encoding of the model type (DeepSeek-V3.2 ships its
    encoding as code; `model_type` as the engine spec resolved it, else config.json's); None when there is none."""
    path = Path(model_dir) / "tokenizer_config.json"
    config = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
    special = {key: _token_text(config.get(key)) for key in SPECIAL_TOKEN_KEYS}
    if template_file is not None:
        if not Path(template_file).is_file():
            raise ValueError(f"chat_template: {template_file} is not a file (a Jinja chat template)")
        return ChatTemplateSource(Path(template_file).read_text(encoding="utf-8"), special)
    if (Path(model_dir) / CHAT_TEMPLATE_FILE).is_file():
        return ChatTemplateSource((Path(model_dir) / CHAT_TEMPLATE_FILE).read_text(encoding="utf-8"), special)
    if config.get("chat_template") is not None:
        return ChatTemplateSource(_default_template(config["chat_template"], path), special)
    if model_type is None and (Path(model_dir) / CONFIG_FILE).is_file():
        model_type = read_config_json(Path(model_dir)).get("model_type")
    return ChatTemplateSource("", special, builtin=model_type) if model_type in BUILTIN_ENCODINGS else None


def load_checkpoint_text(model_dir: str | Path | None, chat_template_file: str | Path | None = None,
                         model_type: str | None = None) -> CheckpointText:
    """Tokenizer and chat template of a checkpoint folder (None: a server of token-id prompts only);
    `chat_template_file` replaces the folder's template; `model_type`: the engine spec's (else read if needed)."""
    if model_dir is None:
        return CheckpointText(None, None)
    if not Path(model_dir).is_dir():
        raise ValueError(f"model_dir: {model_dir} is not a folder")
    tokenizer, template = load_tokenizer(model_dir), read_chat_template(model_dir, chat_template_file, model_type)
    if template is not None and template.builtin is not None and not has_tokens(tokenizer, template.builtin):
        template = None
    return CheckpointText(tokenizer, template)


def has_tokens(tokenizer: Tokenizer | None, model_type: str) -> bool:
    """The tokenizer knows every special token of the model type's built-in chat encoding."""
    return tokenizer is not None and all(tokenizer.token_to_id(t) is not None for t in BUILTIN_ENCODINGS[model_type])
