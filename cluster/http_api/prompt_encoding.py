"""Prompts to token ids in the ingress (the checkpoint's tokenizer.json and chat template), and back.

Without tokenizer.json the server still serves token-id prompts; text prompts are then a 400 that says so,
and logprob tokens are shown as `token_id:<id>`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from tokenizers import Tokenizer

from cluster.http_api.chat_requests import ChatMessage
from cluster.http_api.chat_template import ChatTemplate
from cluster.http_api.deepseek_encoding import MODEL_TYPES as DEEPSEEK_MODEL_TYPES
from cluster.http_api.deepseek_encoding import DeepSeekV32Encoding
from cluster.http_api.errors import APIError, bad_request
from cluster.http_api.openai_requests import ModelLimits
from cluster.http_api.reasoning import THINK_END, opens_reasoning
from model_workers.checkpoint.tokenizer import CheckpointText, decode, encode, load_checkpoint_text


@dataclass(frozen=True)
class EncodedPrompt:
    token_ids: list[int]
    text: str  # the prompt as text (what `echo` returns); "" for token ids without a tokenizer


class PromptEncoder:
    def __init__(self, tokenizer: Tokenizer | None, chat_template: ChatTemplate | None):
        self.tokenizer = tokenizer
        self.chat_template = chat_template

    @classmethod
    def from_text(cls, text: CheckpointText) -> PromptEncoder:
        source = text.chat_template
        if source is None:
            return cls(text.tokenizer, None)
        template = DeepSeekV32Encoding() if source.builtin in DEEPSEEK_MODEL_TYPES else ChatTemplate(source)
        return cls(text.tokenizer, template)

    @classmethod
    def from_model_dir(cls, model_dir: str | Path | None, chat_template_file: str | None = None) -> PromptEncoder:
        return cls.from_text(load_checkpoint_text(model_dir, chat_template_file))

    def _encode_text(self, text: str, param: str, add_special_tokens: bool = False) -> list[int]:
        if self.tokenizer is None:
            raise bad_request(f"{param}: this model has no tokenizer.json; send the prompt as token ids",
                              param=param, code="no_tokenizer")
        return encode(self.tokenizer, text, add_special_tokens)

    def encode(self, prompt: str | list[int], limits: ModelLimits, param: str = "prompt",
               add_special_tokens: bool = False) -> EncodedPrompt:
        """One prompt of a completions request (text: with the tokenizer's BOS when `add_special_tokens`, as vLLM
        does by default); token ids are taken as they are and checked against the vocabulary."""
        token_ids = self._encode_text(prompt, param, add_special_tokens) if isinstance(prompt, str) else list(prompt)
        if not token_ids:
            raise bad_request(f"{param}: the prompt encodes to zero tokens", param=param)
        limits.check_token_ids(token_ids, param)
        return EncodedPrompt(token_ids, prompt if isinstance(prompt, str) else self.decode(token_ids))

    def encode_chat(self, messages: list[ChatMessage], limits: ModelLimits, template_kwargs: dict | None = None,
                    tools: list[dict] | None = None, forced_prefix: str = "") -> EncodedPrompt:
        """The conversation through the chat template (`template_kwargs`: the request's chat_template_kwargs;
        `tools`: its tools, OpenAI's JSON). `forced_prefix` (a forced tool call's opening) is written after the
        generation prompt, a think block the prompt opened being closed first: a forced call is not reasoned."""
        if self.chat_template is None:
            raise APIError(404, "this model has no chat template (tokenizer_config.json chat_template); "
                                "use /v1/completions", code="chat_template_missing")
        rendered = self.chat_template.render([m.for_template() for m in messages], tools=tools,
                                             **(template_kwargs or {}))
        if forced_prefix:
            rendered += (THINK_END if opens_reasoning(rendered) else "") + forced_prefix
        return self.encode(rendered, limits, param="messages")

    def token_count(self, text: str) -> int:
        """How many tokens `text` encodes to (0 without a tokenizer)."""
        return 0 if self.tokenizer is None else len(encode(self.tokenizer, text))

    def decode(self, token_ids: list[int]) -> str:
        return "" if self.tokenizer is None else decode(self.tokenizer, list(token_ids))

    def token_text(self, token_id: int) -> str:
        """One token as shown in logprobs."""
        return f"token_id:{token_id}" if self.tokenizer is None else decode(self.tokenizer, [token_id])
