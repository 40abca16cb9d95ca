"""Collecting engine streams in tests: what each request streamed, and ending in an error kept as a value."""

from __future__ import annotations

import asyncio
import threading

from cp_router.protocol import EngineRequest


async def stream_outcome(engine, request: EngineRequest) -> tuple:
    """(tokens, [(logprob, top)], finish reason) as streamed; a stream that fails ends with the exception."""
    tokens, logprobs = [], []
    try:
        async for chunk in engine.generate(request):
            tokens += chunk.token_ids
            logprobs += [(lp.logprob, lp.top) for lp in chunk.logprobs or ()]
            if chunk.finish_reason is not None:
                return tokens, logprobs, chunk.finish_reason
    except Exception as exc:  # noqa: BLE001 - the test looks at it
        return tokens, logprobs, exc
    return tokens, logprobs, None


def outcomes(engine, requests: list[EngineRequest]) -> dict[str, tuple]:
    """Every request's `stream_outcome`, all run at once (blocking)."""
    async def main():
        results = await asyncio.gather(*[stream_outcome(engine, r) for r in requests])
        return dict(zip([r.request_id for r in requests], results))

    return asyncio.run(main())


def act_after_steps(engine, steps: int, action, delay_s: float = 0.0) -> list:
    """Runs `action()` once, on a thread, `delay_s` after the engine's `steps`-th step from now (so during the
    next step when delay_s > 0); the returned list gets the action's result once it ran."""
    seen, done = [0], []

    def observer(step, results):
        seen[0] += 1
        if seen[0] == steps:
            threading.Timer(delay_s, lambda: done.append(action())).start()

    engine.add_step_observer(observer)
    return done
