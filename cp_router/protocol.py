"""The seam between the HTTP ingress and the generation engine: request/chunk records and the client protocol.

The ingress validates and tokenizes every request before it builds an `EngineRequest`, so an engine may
assume: `prompt_token_ids` is non-empty and inside the vocabulary, `len(prompt) + max_tokens <=
max_model_len`, `0 <= min_tokens <= max_tokens`, `top_k` is 0 (off) or in 1..vocab_size-1, `top_p` in (0, 1],
`temperature` in [0, 2] (0 = greedy), `logprobs` and `prompt_logprobs` None or in 0..vocab_size. Records are
frozen dataclasses: they pickle across Ray processes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import AsyncIterator, Protocol, runtime_checkable

from cp_router.grammar_spec import GrammarSpec
from cp_router.sampling import FinishReason


@dataclass(frozen=True)
class EngineRequest:
    """One sequence to generate (an HTTP request with n choices or several prompts becomes several)."""

    request_id: str  # unique per engine; also the key of `abort`
    prompt_token_ids: tuple[int, ...]
    max_tokens: int  # >= 1; the stream ends with finish_reason "length" after this many tokens
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    min_tokens: int = 0  # EOS, stop ids and stop strings are ignored before this many tokens
    stop_token_ids: tuple[int, ...] = ()  # extra ids that end generation (finish "stop"); the id is returned
    stop: tuple[str, ...] = ()  # stop strings, matched on detokenized text; the string itself is not returned
    ignore_eos: bool = False  # keep generating past the model's EOS token(s)
    seed: int | None = None  # same seed + same request -> same tokens, whatever else is batched with it
    logprobs: int | None = None  # None: no logprobs; k >= 0: the sampled token's logprob + k top alternatives
    prompt_logprobs: int | None = None  # None: off; k >= 0: each prompt token's logprob + k top alternatives
    repetition_penalty: float = 1.0  # the options of model_workers/logits_processing.py (vLLM's semantics)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    min_p: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias)
    skip_special_tokens: bool = True  # special tokens are left out of the text (their ids are returned)
    include_stop_str_in_output: bool = False  # the matched stop string ends the text instead of being cut
    grammar: GrammarSpec | None = None  # structured outputs (cp_router/grammar_spec.py); None: unconstrained


@dataclass(frozen=True)
class TokenLogprob:
    """Log-probability of one token (generated, or of the prompt), with the most likely alternatives (most likely
    first)."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # (token_id, logprob), at most EngineRequest.logprobs entries
    rank: int | None = None  # 1-based rank of token_id among all tokens (1 + how many are likelier)


@dataclass(frozen=True)
class EngineChunk:
    """What one engine step produced for one request.

    `token_ids` are the new tokens (several per step under speculative decoding, possibly none on the final
    chunk), `text` the newly detokenized text ("" when the checkpoint has no tokenizer or the bytes of a
    character are incomplete), `logprobs` one entry per new token when the request asked for them.
    `prompt_logprobs`, on the first chunk only of a request that asked for them: one entry per prompt token, None
    for the first (nothing predicts it). The counts are cumulative. Exactly the last chunk has a `finish_reason`.
    """

    token_ids: tuple[int, ...]
    text: str
    finish_reason: FinishReason | None
    prompt_tokens: int
    completion_tokens: int
    logprobs: tuple[TokenLogprob, ...] | None = None
    prompt_logprobs: tuple[TokenLogprob | None, ...] | None = None
    cached_tokens: int = 0  # prompt tokens its prefill read from the prefix cache (known from its first chunk)


@dataclass(frozen=True)
class ModelInfo:
    """What the ingress needs to know about the served checkpoint."""

    name: str  # the `model` value clients send, and the id listed by GET /v1/models
    vocab_size: int
    max_model_len: int  # context window: prompt + generated tokens
    has_chat_template: bool  # the checkpoint carries a chat template


class EngineOverloadedError(RuntimeError):
    """The engine's bounded queue is full; the ingress answers 503 with `Retry-After: retry_after_s`."""

    def __init__(self, message: str, retry_after_s: int = 1):
        super().__init__(message)
        self.retry_after_s = retry_after_s


class EngineUnavailableError(RuntimeError):
    """The engine cannot serve this request: its rank group was lost and could not be rebuilt, or its replica
    died after the stream started. The message names the cause; the ingress answers 503 (or, mid-stream, an
    SSE error event with that message)."""


@runtime_checkable
class EngineClient(Protocol):
    """How the ingress talks to the engine replicas (implemented by the Ray Serve app over deployment handles).

    Contract:
    * `generate(request)` returns an async iterator of `EngineChunk` (write it as an `async def ... yield`
      method). The last chunk carries the finish reason. It may raise `EngineOverloadedError` on its first
      `__anext__` when the request cannot be queued; any other exception is an engine failure.
    * `abort(request_id)` ends that request and frees its KV pages at once; its stream, if still consumed,
      ends with finish_reason "abort". Aborting an unknown or finished request is a no-op. The ingress calls
      it for every stream it stops reading before the finish reason (client disconnect, cancellation,
      another choice of the same HTTP request failing) and then closes the iterator (`aclose` if present).
    * `model_info()` is cheap and constant for the life of the client.
    * `metrics_text()` returns the Prometheus text exposition of every engine replica, one `replica` label
      value per replica (merge them with `cp_router.metrics.merge_metrics_text`).
    * `flush_cache()` empties every engine replica's prefix cache (pages in use stay with their requests) and
      returns how many pages were indexed.
    * `check_health()` returns when the engine can serve and raises (any exception, with a message saying
      what is wrong: a dead rank actor, a stuck step loop) otherwise.
    """

    def generate(self, request: EngineRequest) -> AsyncIterator[EngineChunk]: ...

    async def abort(self, request_id: str) -> None: ...

    def model_info(self) -> ModelInfo: ...

    async def metrics_text(self) -> str: ...

    async def flush_cache(self) -> int: ...

    async def check_health(self) -> None: ...


def one_line(error: BaseException) -> str:
    """`Type: first line` of an error (of its cause for a Ray task error): for one-line HTTP messages."""
    cause = getattr(error, "cause", None) or error  # a RayTaskError carries the replica's exception as `cause`
    lines = str(cause).strip().splitlines()
    return f"{type(cause).__name__}: {lines[0] if lines else ''}"
