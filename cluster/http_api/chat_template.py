"""A checkpoint's chat template (read by model_workers/checkpoint/tokenizer.py), rendered like Hugging Face does.

Jinja2 in an immutable sandbox with `trim_blocks`/`lstrip_blocks` and the loop-controls extension; the
template sees `messages`, `tools`, `add_generation_prompt`, the special tokens of tokenizer_config.json
(`bos_token`, `eos_token`, ...), `raise_exception` and `strftime_now`, and
Hugging Face's `tojson` filter. Template errors become 400s on `messages`.
"""

from __future__ import annotations

import json
from datetime import datetime

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

from cluster.http_api.errors import bad_request
from model_workers.checkpoint.tokenizer import ChatTemplateSource


def _tojson(value, ensure_ascii: bool = False, indent=None, separators=None, sort_keys: bool = False) -> str:
    """Hugging Face's `tojson` (templates call it with ensure_ascii=False; Jinja's own escapes HTML)."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


class TemplateRaised(Exception):
    """`raise_exception(...)` called by the template: the conversation is not one it accepts."""


def _raise_exception(message: str) -> None:
    raise TemplateRaised(message)


class ChatTemplate:
    def __init__(self, source: ChatTemplateSource):
        environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                    extensions=["jinja2.ext.loopcontrols"])
        environment.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now)
        environment.filters["tojson"] = _tojson
        self.template = environment.from_string(source.source)
        self.special_tokens = source.special_tokens

    def render(self, messages: list[dict], tools: list[dict] | None = None, **kwargs) -> str:
        """The prompt text; `tools` (OpenAI's tool JSON, or None) and `kwargs` (the request's chat_template_kwargs,
        e.g. GLM's enable_thinking) reach the template as variables, as in Hugging Face's apply_chat_template."""
        try:
            return self.template.render(messages=messages, tools=tools, add_generation_prompt=True,
                                        **{**kwargs, **self.special_tokens})
        except TemplateRaised as exc:
            raise bad_request(f"messages: the chat template rejected the conversation: {exc}",
                              param="messages") from None
        except (jinja2.TemplateError, TypeError, ValueError, LookupError) as exc:
            raise bad_request(f"messages: the chat template failed on this conversation: {exc}",
                              param="messages") from None
