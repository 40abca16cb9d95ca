"""One request's stream on the engine side: new tokens in, `EngineChunk`s out (text, stop strings, logprobs, and
prompt logprobs on the first chunk)."""

from __future__ import annotations

import asyncio
import random

from cp_router.detokenize import IncrementalText
from cp_router.handoff import HandoffTicket, RequestHandoff
from cp_router.protocol import EngineChunk, EngineRequest, TokenLogprob
from cp_router.sampling import SamplingParams


def sampling_of(request: EngineRequest) -> SamplingParams:
    """The engine's SamplingParams; an unseeded request draws its seed once (kept across a recompute)."""
    seed = request.seed if request.seed is not None else random.getrandbits(62)
    return SamplingParams(
        temperature=request.temperature, seed=seed, top_p=request.top_p, top_k=request.top_k,
        min_tokens=request.min_tokens, max_tokens=request.max_tokens, stop_token_ids=tuple(request.stop_token_ids),
        ignore_eos=request.ignore_eos, logprobs=request.logprobs, repetition_penalty=request.repetition_penalty,
        presence_penalty=request.presence_penalty, frequency_penalty=request.frequency_penalty, min_p=request.min_p,
        logit_bias=tuple(request.logit_bias), prompt_logprobs=request.prompt_logprobs, grammar=request.grammar,
    )


def token_logprob_of(entry: tuple) -> TokenLogprob:
    """A rank's (id, logprob, ((id, logprob), ...), rank) tuple as a `TokenLogprob`."""
    token_id, logprob, top, rank = entry
    return TokenLogprob(token_id, logprob, tuple(top), rank)


class RequestStream:
    """Chunks for one request; `push` runs in the step loop, the consumer reads `queue`."""

    def __init__(self, request: EngineRequest, tokenizer):
        self.request = request
        self.text = IncrementalText(tokenizer, tuple(request.stop), request.skip_special_tokens,
                                    request.include_stop_str_in_output)
        self.queue: asyncio.Queue[EngineChunk | HandoffTicket | BaseException] = asyncio.Queue()
        self.completion_tokens = 0
        self.cached_tokens = 0  # set by the engine once its first prefill was scheduled (prefix caching)
        self.finished = False

    def push(self, token_ids: list[int], logprobs: list[tuple], finish_reason: str | None,
             prompt_logprobs: list[tuple] | None = None) -> str | None:
        """Queues one chunk; returns the finish reason (stop strings can end a request early). `logprobs` and
        `prompt_logprobs` (prompt positions 1.., given once) are the ranks' (id, logprob, top, rank) tuples."""
        kept: list[int] = []
        for position, token in enumerate(token_ids):
            kept.append(token)
            if self._shows(finish_reason, position == len(token_ids) - 1):
                self.text.add(token)
            if self.text.stopped:
                finish_reason = "stop"
                break
        self.completion_tokens += len(kept)
        chunk_logprobs = None
        if self.request.logprobs is not None:
            chunk_logprobs = tuple(token_logprob_of(entry) for entry in logprobs[: len(kept)])
        prompt = None if prompt_logprobs is None else (None, *(token_logprob_of(entry) for entry in prompt_logprobs))
        self.queue.put_nowait(EngineChunk(
            tuple(kept), self.text.release(final=finish_reason is not None), finish_reason,
            len(self.request.prompt_token_ids), self.completion_tokens, chunk_logprobs, prompt,
            min(self.cached_tokens, len(self.request.prompt_token_ids)),
        ))
        self.finished = finish_reason is not None
        return finish_reason

    def hand_off(self, handoff: RequestHandoff, output_ids: list[int]) -> None:
        """Disaggregation, prefill side: the stream ends with the ticket a decode group goes on from."""
        self.queue.put_nowait(HandoffTicket(handoff, tuple(output_ids), self.text.released, self.cached_tokens))
        self.finished = True

    def resume_after(self, ticket: HandoffTicket) -> None:
        """Disaggregation, decode side: the tokens and text the prefill group streamed count as sent already."""
        for token in ticket.output_ids:
            self.text.add(token)
        self.text.released = ticket.text_released
        self.completion_tokens, self.cached_tokens = len(ticket.output_ids), ticket.cached_tokens

    def _shows(self, finish_reason: str | None, last: bool) -> bool:
        """Whether a token's text joins the output: not a stop token's (EOS or stop_token_ids, which end the
        request with "stop"), as vLLM, unless include_stop_str_in_output."""
        return not (last and finish_reason == "stop") or self.request.include_stop_str_in_output

    def end(self, finish_reason: str) -> None:
        if not self.finished:
            self.push([], [], finish_reason)

    def fail(self, error: BaseException) -> None:
        if not self.finished:
            self.finished = True
            self.queue.put_nowait(error)
