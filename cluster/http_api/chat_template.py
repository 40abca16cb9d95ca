"""A checkpoint's chat template (tokenizer_config.json `chat_template`), rendered like Hugging Face does.

Jinja2 in an immutable sandbox with `trim_blocks`/`lstrip_blocks` and the loop-controls extension; the
template sees `messages`, `add_generation_prompt`, the special tokens of tokenizer_config.json
(`bos_token`, `eos_token`, ...) and `raise_exception`. Template errors become 400s on `messages`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

from cluster.http_api.errors import bad_request

SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token")


class TemplateRaised(Exception):
    """`raise_exception(...)` called by the template: the conversation is not one it accepts."""


def _raise_exception(message: str) -> None:
    raise TemplateRaised(message)


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


class ChatTemplate:
    def __init__(self, source: str, special_tokens: dict[str, str]):
        environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                    extensions=["jinja2.ext.loopcontrols"])
        environment.globals["raise_exception"] = _raise_exception
        self.template = environment.from_string(source)
        self.special_tokens = special_tokens

    @classmethod
    def from_model_dir(cls, model_dir: str | Path) -> ChatTemplate | None:
        """The template of `model_dir/tokenizer_config.json`, or None when it has none."""
        path = Path(model_dir) / "tokenizer_config.json"
        if not path.is_file():
            return None
        config = json.loads(path.read_text(encoding="utf-8"))
        if config.get("chat_template") is None:
            return None
        special = {key: _token_text(config.get(key)) for key in SPECIAL_TOKEN_KEYS}
        return cls(_default_template(config["chat_template"], path), special)

    def render(self, messages: list[dict[str, str]]) -> str:
        try:
            return self.template.render(messages=messages, add_generation_prompt=True, **self.special_tokens)
        except TemplateRaised as exc:
            raise bad_request(f"messages: the chat template rejected the conversation: {exc}",
                              param="messages") from None
        except (jinja2.TemplateError, TypeError, ValueError, LookupError) as exc:
            raise bad_request(f"messages: the chat template failed on this conversation: {exc}",
                              param="messages") from None
