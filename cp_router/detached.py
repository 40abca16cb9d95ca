"""Background tasks that belong to no request."""

from __future__ import annotations

import asyncio
import contextvars
from typing import Any, Coroutine


def detached_task(coro: Coroutine[Any, Any, Any]) -> asyncio.Task:
    """`coro` as a task of the running loop, in an empty context. Created from a request's context, a task carries
    that request's identity (Ray's current task), so cancelling that one request (its client left) would cancel
    work that serves every request: the engine's step loop, an ingress's token channel."""
    return contextvars.Context().run(asyncio.get_running_loop().create_task, coro)
