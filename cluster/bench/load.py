"""The closed-loop load of `dsa-serve bench serve`: per-request timings over HTTP (SSE) or on an in-process engine.

Both paths time a request the same way. `sent` is taken just before the request leaves; a chunk is one streamed
piece of output (one SSE event carrying a choice, or one `EngineChunk`). The engine pushes one chunk per worker
call, with every token the request got in that call (up to max_steps_per_call x (k + 1)), and the ingress
forwards each as one SSE event, so both paths see the same chunks:

* TTFT = first chunk - sent;
* ITL = the gaps between successive chunks, each gap counted once whatever its chunk carried
  (`tokens_per_chunk` reports how many tokens a chunk carried on average);
* TPOT = (last chunk - first chunk) / (tokens - 1), one value per request with at least two tokens.

Over HTTP the token count of a request is the `usage.completion_tokens` of the stream's final usage event; the same
event gives `prompt_tokens` and, where the server reports it (OpenAI's `usage.prompt_tokens_details`), the prompt
tokens its prefix cache served (`cached_tokens`, None when absent). The text of every chunk is kept (`text`: what
a multi-turn client sends back).
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from dataclasses import dataclass, field
from typing import Awaitable, Callable

PERCENTILES = (50, 90, 99)


@dataclass
class RequestTiming:
    sent: float
    chunk_times: list[float] = field(default_factory=list)
    tokens: int = 0
    prompt_tokens: int = 0  # over HTTP: usage.prompt_tokens
    cached_tokens: int | None = None  # over HTTP: usage.prompt_tokens_details.cached_tokens, None if not sent
    texts: list[str] = field(default_factory=list)  # over HTTP: each chunk's text

    @property
    def text(self) -> str:
        return "".join(self.texts)

    @property
    def ttft_s(self) -> float:
        return self.chunk_times[0] - self.sent

    @property
    def itl_s(self) -> list[float]:
        return [later - earlier for earlier, later in zip(self.chunk_times, self.chunk_times[1:])]

    @property
    def tpot_s(self) -> float | None:
        if self.tokens < 2:
            return None
        return (self.chunk_times[-1] - self.chunk_times[0]) / (self.tokens - 1)


def percentile(sorted_values: list[float], q: float) -> float:
    """Linear interpolation between the closest ranks (numpy's default), q in 0..100."""
    position = (len(sorted_values) - 1) * q / 100
    low, high = math.floor(position), math.ceil(position)
    return sorted_values[low] + (sorted_values[high] - sorted_values[low]) * (position - low)


def percentiles(values: list[float]) -> dict[str, float | None]:
    """p50, p90, p99 and mean; all None for no values."""
    if not values:
        return {**{f"p{q}": None for q in PERCENTILES}, "mean": None}
    ordered = sorted(values)
    return {**{f"p{q}": percentile(ordered, q) for q in PERCENTILES}, "mean": sum(ordered) / len(ordered)}


def summarize(timings: list[RequestTiming], wall_s: float) -> dict:
    """What one closed-loop run measured (see the module docstring for the definitions)."""
    tokens = sum(t.tokens for t in timings)
    chunks = sum(len(t.chunk_times) for t in timings)
    return {
        "num_requests": len(timings), "output_tokens": tokens, "wall_s": wall_s,
        "tokens_per_request": sorted({t.tokens for t in timings}),
        "ttft_s": percentiles([t.ttft_s for t in timings]),
        "itl_s": percentiles([gap for t in timings for gap in t.itl_s]),
        "tpot_s": percentiles([t.tpot_s for t in timings if t.tpot_s is not None]),
        "tokens_per_chunk": tokens / chunks if chunks else None,
        "output_tokens_per_s": tokens / wall_s, "requests_per_s": len(timings) / wall_s,
    }


async def closed_loop(send: Callable[[int], Awaitable[RequestTiming]], num_requests: int,
                      concurrency: int) -> tuple[list[RequestTiming], float]:
    """`concurrency` workers, each sending request i = 0, 1, ... back to back until all are done."""
    indices = iter(range(num_requests))  # shared: every worker takes the next index when it is free

    async def worker() -> list[RequestTiming]:
        return [await send(index) for index in indices]

    start = time.perf_counter()
    per_worker = await asyncio.gather(*[worker() for _ in range(min(concurrency, num_requests))])
    wall_s = time.perf_counter() - start
    return [timing for timings in per_worker for timing in timings], wall_s


# HTTP ------------------------------------------------------------------------------------------------
def completion_body(prompt: str | list[int], max_tokens: int) -> dict:
    """Greedy, exactly `max_tokens` tokens (min_tokens = max_tokens: EOS and stop ids cannot end it early)."""
    return {"prompt": prompt, "max_tokens": max_tokens, "min_tokens": max_tokens, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}


def sse_payload(line: str) -> str | None:
    """The payload of a `data:` line; None for any other line (blank separators, comments, other fields)."""
    if not line.startswith("data:"):
        return None
    return line[len("data:"):].strip()


def apply_sse_line(timing: RequestTiming, line: str, now: float) -> bool:
    """Records one SSE line into `timing`; False once the stream is over (`[DONE]`)."""
    payload = sse_payload(line)
    if payload is None:
        return True
    if payload == "[DONE]":
        return False
    event = json.loads(payload)
    if "error" in event:
        raise RuntimeError(f"the server failed the request mid-stream: {event['error']}")
    if event.get("choices"):
        timing.chunk_times.append(now)
        timing.texts.append(event["choices"][0].get("text") or "")
    if event.get("usage"):
        record_usage(timing, event["usage"])
    return True


def record_usage(timing: RequestTiming, usage: dict) -> None:
    """The stream's usage event: completion and prompt tokens, and the prefix cache's share when reported."""
    timing.tokens = usage["completion_tokens"]
    timing.prompt_tokens = usage.get("prompt_tokens") or 0
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
    timing.cached_tokens = None if cached is None else int(cached)


async def http_request(session, url: str, body: dict) -> RequestTiming:
    """One streamed `POST {url}/v1/completions` through an aiohttp.ClientSession, the client `vllm bench serve`
    uses (httpx's streaming costs about 1 ms more per request on the bench VM, which TTFT would count)."""
    timing = RequestTiming(time.perf_counter())
    async with session.post(f"{url}/v1/completions", json=body) as response:
        if response.status != 200:
            raise RuntimeError(f"POST {url}/v1/completions answered {response.status}: "
                               f"{(await response.read()).decode(errors='replace')[:500]}")
        async for raw_line in response.content:  # one line at a time
            if not apply_sse_line(timing, raw_line.decode("utf-8").rstrip("\r\n"), time.perf_counter()):
                break
    if not timing.chunk_times:
        raise RuntimeError(f"POST {url}/v1/completions streamed no completion chunk")
    return timing


# in-process engine -------------------------------------------------------------------------------------
async def engine_request(engine, request) -> RequestTiming:
    """One `EngineRequest` through `engine.generate`, timed like the HTTP path."""
    timing = RequestTiming(time.perf_counter())
    async for chunk in engine.generate(request):
        timing.chunk_times.append(time.perf_counter())
        timing.tokens = chunk.completion_tokens
    return timing
