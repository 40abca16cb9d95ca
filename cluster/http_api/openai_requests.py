"""OpenAI-compatible request models: the sampling fields both routes share, `POST /v1/completions`, and the limits
(the chat request, with messages and tools, is chat_requests.py's).

Field rules follow OpenAI: max_tokens >= 1, temperature in [0, 2], top_p in (0, 1], n in 1..16, logprobs 0..20
(vLLM's limit; with echo the prompt tokens come first), at most 4 stop strings, presence / frequency penalties in
[-2, 2], logit_bias in [-100, 100]. Extensions (vLLM-style): top_k (0 or -1 = off), min_p, repetition_penalty,
min_tokens, ignore_eos, stop_token_ids, prompt_logprobs 0..20. An explicit JSON null means "the default". Fields
this server knows but does not implement yet are accepted only at their no-op value (e.g. best_of 1, suffix "") and
rejected otherwise; unknown fields are ignored, as vLLM does, and named in one log line per request (body.py).
Checks needing the model (vocabulary, context window) run after tokenization: `ModelLimits`. A number with no
fraction (10.0) is an integer, as in JSON Schema; the models' JSON schemas (GET /openapi.json) publish these rules.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Annotated, Any, Callable

from pydantic import (
    AfterValidator,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationInfo,
    WithJsonSchema,
    field_validator,
    model_validator,
)

from cluster.http_api.errors import bad_request
from cluster.http_api.request_model import RequestModel
from cluster.http_api.structured_outputs import ConstraintFields
from cluster.http_api.openapi_schema import optional_fields_take_null

MAX_N = 16
MAX_LOGPROBS = 20  # vLLM's default max_logprobs
MAX_STOP_STRINGS = 4
MAX_STOP_CHARS = 256
MAX_CHOICES = 128  # prompts x n per HTTP request
MAX_SEED = 2**63 - 1
MAX_REPETITION_PENALTY = 10.0
MAX_LOGIT_BIAS = 300  # entries, as OpenAI
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
TOKEN_ID_KEY = re.compile(r"-?[0-9]{1,19}")  # a logit_bias key: a token id (int64) as a string
PROMPT_SHAPES = "a non-empty string, a list of strings, a list of token ids, or a list of lists of token ids"


def _only(no_op: Any) -> Callable[[Any], Any]:
    def check(value: Any) -> Any:
        if value is not None and (type(value) is not type(no_op) or value != no_op):  # true is not 1
            raise ValueError(f"is not supported by this server; omit it or send {no_op!r}")
        return value

    return check


def _no_op_field(no_op: Any) -> Any:
    """A field accepted only at `no_op` (or null), and published so."""
    return Annotated[Any, AfterValidator(_only(no_op)), WithJsonSchema({"anyOf": [{"const": no_op}, {"type": "null"}]})]


OneOnly = _no_op_field(1)
EmptyTextOnly = _no_op_field("")
STOP_TEXT_SCHEMA = {"type": "string", "minLength": 1, "maxLength": MAX_STOP_CHARS}
STOP_SCHEMA = {"anyOf": [STOP_TEXT_SCHEMA, {"type": "array", "items": STOP_TEXT_SCHEMA, "maxItems": MAX_STOP_STRINGS}]}
StopStrings = Annotated[list[str], WithJsonSchema(STOP_SCHEMA)]  # one string or a list (`_stop_as_list`)


def _is_token_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_prompt_list(items: list[Any]) -> None:
    if all(isinstance(item, str) for item in items) or all(_is_token_id(item) for item in items):
        kind_ok = True
    else:
        kind_ok = all(isinstance(item, list) and all(_is_token_id(token) for token in item) for item in items)
    if not kind_ok:
        raise ValueError(f"must be {PROMPT_SHAPES}")
    for position, item in enumerate(items):
        if isinstance(item, (str, list)) and not item:
            raise ValueError(f"item {position} is empty; every prompt needs at least one character or token")


def _check_prompt(value: Any) -> Any:
    if isinstance(value, str) and value:
        return value
    if isinstance(value, list) and value:
        _check_prompt_list(value)
        return value
    raise ValueError(f"must be {PROMPT_SHAPES}")


PromptInput = Annotated[str | list[str] | list[int] | list[list[int]], BeforeValidator(_check_prompt)]


class StreamOptions(RequestModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: every chunk carries the usage so far


class SamplingRequest(ConstraintFields):
    """Fields shared by completions and chat completions (the structured-output ones: structured_outputs.py)."""

    model_config = ConfigDict(json_schema_extra=optional_fields_take_null)  # `_null_means_default`, published

    model: str | None = None
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=-1)
    n: int = Field(1, ge=1, le=MAX_N)
    stop: StopStrings = Field(default_factory=list)
    stream: bool = False
    stream_options: StreamOptions | None = None
    seed: int | None = Field(None, ge=0, le=MAX_SEED)
    user: str | None = Field(None, max_length=256)
    min_tokens: int = Field(0, ge=0)
    ignore_eos: bool = False
    stop_token_ids: list[int] = Field(default_factory=list, max_length=64)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    repetition_penalty: float = Field(1.0, gt=0, le=MAX_REPETITION_PENALTY)  # vLLM's (`vllm bench serve` sends 1.0)
    min_p: float = Field(0.0, ge=0, le=1)
    logit_bias: dict[str, float] = Field(default_factory=dict, max_length=MAX_LOGIT_BIAS)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)  # vLLM's: each prompt token's logprob + k top

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        return {key: value for key, value in data.items()
                if value is not None or key not in cls.model_fields or cls.model_fields[key].is_required()}

    @field_validator("logit_bias")
    @classmethod
    def _bias_keys_are_token_ids(cls, value: dict[str, float]) -> dict[str, float]:
        for key, bias in value.items():
            if not TOKEN_ID_KEY.fullmatch(key.strip()):  # ASCII digits: int() must read it ("²".isdigit() is true)
                raise ValueError(f"keys must be token ids (as strings), got {key!r:.80}")
            if not -100 <= bias <= 100:
                raise ValueError(f"biases must be in [-100, 100], got {bias} for token {key}")
        return value

    def engine_logit_bias(self) -> tuple[tuple[int, float], ...]:
        """logit_bias as (token id, bias) pairs in id order (the vocabulary check needs the model: ModelLimits)."""
        return tuple(sorted((int(key), float(bias)) for key, bias in self.logit_bias.items()))

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_as_list(cls, value: Any) -> Any:
        stops = [value] if isinstance(value, str) else value
        if isinstance(stops, list):
            if len(stops) > MAX_STOP_STRINGS:
                raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings are allowed (got {len(stops)})")
            if any(isinstance(stop, str) and not 0 < len(stop) <= MAX_STOP_CHARS for stop in stops):
                raise ValueError(f"every stop string must have 1..{MAX_STOP_CHARS} characters")
        return stops

    @field_validator("stream_options")
    @classmethod
    def _stream_options_need_stream(cls, value: StreamOptions | None, info: ValidationInfo) -> StreamOptions | None:
        if value is not None and info.data.get("stream") is False:
            raise ValueError("only allowed when stream is true")
        return value

    @property
    def engine_prompt_logprobs(self) -> int | None:
        """The top alternatives the engine scores prompt tokens with (None: prompt logprobs are not computed)."""
        return self.prompt_logprobs

    @property
    def include_usage_in_stream(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def usage_in_every_chunk(self) -> bool:
        return self.stream_options is not None and self.stream_options.continuous_usage_stats


class CompletionRequest(SamplingRequest):
    prompt: PromptInput
    max_tokens: int = Field(COMPLETIONS_DEFAULT_MAX_TOKENS, ge=1)
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    add_special_tokens: bool = True  # vLLM's default for completions: the tokenizer's BOS, if it adds one
    best_of: OneOnly = None
    suffix: EmptyTextOnly = None

    @field_validator("prompt")
    @classmethod
    def _at_most_max_choices(cls, value: Any, info: ValidationInfo) -> Any:
        count, n = (1 if isinstance(value, str) or _is_token_id(value[0]) else len(value)), info.data.get("n", 1)
        if count * n > MAX_CHOICES:
            raise ValueError(f"{count} prompts x n={n} exceeds {MAX_CHOICES} choices per request")
        return value

    @property
    def engine_prompt_logprobs(self) -> int | None:
        """`prompt_logprobs`, and echo with logprobs (the prompt tokens' logprobs come first): the larger k."""
        wanted = [k for k in (self.prompt_logprobs, self.logprobs if self.echo else None) if k is not None]
        return max(wanted) if wanted else None

    def prompts(self) -> list[str | list[int]]:
        """The prompt as a list of prompts, each a string or a list of token ids."""
        if isinstance(self.prompt, str) or _is_token_id(self.prompt[0]):
            return [self.prompt]
        return list(self.prompt)


@dataclass(frozen=True)
class ModelLimits:
    """What the served model allows; the server passes these in from the engine's ModelInfo."""

    vocab_size: int
    max_model_len: int

    def check_token_ids(self, token_ids: list[int], param: str) -> None:
        for position, token_id in enumerate(token_ids):
            if not 0 <= token_id < self.vocab_size:
                raise bad_request(f"{param}: token id {token_id} at position {position} is outside the vocabulary "
                                  f"(allowed 0..{self.vocab_size - 1})", param=param, code="invalid_token_id")

    def resolve_max_tokens(self, prompt_tokens: int, max_tokens: int | None, min_tokens: int, param: str) -> int:
        """max_tokens within the window (None = all the room left); 400 context_length_exceeded otherwise."""
        room = self.max_model_len - prompt_tokens
        window = f"This model's maximum context length is {self.max_model_len} tokens"
        if room < 1:
            raise bad_request(f"{window}; the prompt has {prompt_tokens} tokens, leaving no room to generate",
                              param=param, code="context_length_exceeded")
        if max_tokens is not None and max_tokens > room:
            raise bad_request(f"{window}; you requested {prompt_tokens + max_tokens} tokens ({prompt_tokens} in the "
                              f"prompt, {max_tokens} for the completion); max_tokens may be at most {room}",
                              param="max_tokens", code="context_length_exceeded")
        resolved = room if max_tokens is None else max_tokens
        if min_tokens > resolved:
            raise bad_request(f"min_tokens: must be at most max_tokens ({resolved}) (got {min_tokens})",
                              param="min_tokens")
        return resolved

    def engine_top_k(self, top_k: int) -> int:
        """0 (off) for -1, 0 and any k that keeps the whole vocabulary."""
        return top_k if 0 < top_k < self.vocab_size else 0
