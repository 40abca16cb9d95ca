"""One HTTP request fans out into engine streams (prompts x n choices); their chunks merge back in arrival order.

Every engine stream that is left before its finish reason (client gone, task cancelled, a sibling choice
failed) is aborted in the engine, so its KV pages are freed at once.
"""

from __future__ import annotations

import asyncio
from contextlib import aclosing
from dataclasses import dataclass
from typing import AsyncIterator, Awaitable, TypeVar

from fastapi import Request
from starlette.requests import ClientDisconnect

from cluster.http_api.openai_requests import MAX_SEED, ModelLimits, SamplingRequest
from cluster.http_api.prompt_encoding import EncodedPrompt
from cp_router.grammar_spec import GrammarSpec
from cp_router.protocol import EngineChunk, EngineClient, EngineRequest

T = TypeVar("T")


class EngineStreamError(RuntimeError):
    """The engine broke its contract (a stream ended without a finish reason)."""


@dataclass(frozen=True)
class PlannedChoice:
    index: int  # the OpenAI choice index: prompt_index * n + sample_index
    prompt: EncodedPrompt
    request: EngineRequest


def plan_choices(request_id: str, prompts: list[EncodedPrompt], max_tokens: list[int], body: SamplingRequest,
                 logprobs: int | None, limits: ModelLimits, grammar: GrammarSpec | None = None) -> list[PlannedChoice]:
    """n engine requests per prompt; with a seed, choice i samples with seed + i (so the n choices differ);
    `grammar`: every choice's constraint (structured outputs)."""
    limits.check_token_ids(body.stop_token_ids, "stop_token_ids")
    bias = body.engine_logit_bias()
    limits.check_token_ids([token_id for token_id, _ in bias], "logit_bias")
    planned = []
    for prompt_index, prompt in enumerate(prompts):
        for sample_index in range(body.n):
            index = prompt_index * body.n + sample_index
            seed = None if body.seed is None else (body.seed + index) % (MAX_SEED + 1)
            request = EngineRequest(
                request_id=f"{request_id}-{index}", prompt_token_ids=tuple(prompt.token_ids),
                max_tokens=max_tokens[prompt_index], temperature=body.temperature, top_p=body.top_p,
                top_k=limits.engine_top_k(body.top_k), min_tokens=body.min_tokens,
                stop_token_ids=tuple(body.stop_token_ids), stop=tuple(body.stop), ignore_eos=body.ignore_eos,
                seed=seed, logprobs=logprobs, prompt_logprobs=body.engine_prompt_logprobs,
                repetition_penalty=body.repetition_penalty, presence_penalty=body.presence_penalty,
                frequency_penalty=body.frequency_penalty, min_p=body.min_p,
                logit_bias=bias, skip_special_tokens=body.skip_special_tokens,
                include_stop_str_in_output=body.include_stop_str_in_output, grammar=grammar)
            planned.append(PlannedChoice(index, prompt, request))
    return planned


async def _close(stream: AsyncIterator[EngineChunk]) -> None:
    close = getattr(stream, "aclose", None)
    if close is not None:
        await close()


async def _one_choice_stream(engine: EngineClient, choice: PlannedChoice) -> AsyncIterator[tuple[int, EngineChunk]]:
    """The one choice's (index, chunk) pairs straight from its engine stream: no task or queue in between."""
    stream = engine.generate(choice.request)
    finished = False
    try:
        async for chunk in stream:
            finished = chunk.finish_reason is not None
            yield choice.index, chunk
            if finished:
                return
        raise EngineStreamError(f"engine stream of {choice.request.request_id} ended without a finish reason")
    finally:
        if not finished:  # shielded: a second cancellation must not leave the request running in the engine
            await asyncio.shield(engine.abort(choice.request.request_id))
        await _close(stream)


async def _pump(engine: EngineClient, choice: PlannedChoice, queue: asyncio.Queue) -> None:
    """Forward one choice's stream into `queue` as (index, chunk | exception | None at the end)."""
    try:
        async with aclosing(_one_choice_stream(engine, choice)) as pairs:
            async for pair in pairs:
                queue.put_nowait(pair)
    except Exception as exc:  # noqa: BLE001 - handed to the consumer, which answers with an error body
        queue.put_nowait((choice.index, exc))
    finally:
        queue.put_nowait((choice.index, None))


def merge_choice_streams(engine: EngineClient, choices: list[PlannedChoice]) -> AsyncIterator[tuple[int, EngineChunk]]:
    """(choice index, chunk) pairs from all choices as they arrive; re-raises the first engine error. One choice
    (n = 1, one prompt: nearly every request) is read directly, several through a task each and a queue."""
    if len(choices) == 1:
        return _one_choice_stream(engine, choices[0])
    return _merged_streams(engine, choices)


async def _merged_streams(engine: EngineClient,
                          choices: list[PlannedChoice]) -> AsyncIterator[tuple[int, EngineChunk]]:
    queue: asyncio.Queue = asyncio.Queue()
    tasks = [asyncio.create_task(_pump(engine, choice, queue)) for choice in choices]
    try:
        running = len(tasks)
        while running:
            index, item = await queue.get()
            if item is None:
                running -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _wait_for_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def unless_disconnected(request: Request, awaitable: Awaitable[T]) -> T:
    """Await `awaitable`; if the client disconnects first, cancel it (aborting its streams), raise ClientDisconnect."""
    work = asyncio.ensure_future(awaitable)
    watch = asyncio.create_task(_wait_for_disconnect(request))
    try:
        done, _ = await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (work, watch):
            task.cancel()
        await asyncio.gather(work, watch, return_exceptions=True)
    if work not in done:
        raise ClientDisconnect()
    return work.result()
