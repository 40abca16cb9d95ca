"""A C = 1 engine in this process: the rank worker called like a Ray actor handle, without Ray."""

from __future__ import annotations

import asyncio

from model_workers.cp_worker import CPWorker
from model_workers.spec import RankSpec


class _Method:
    def __init__(self, fn):
        self.fn = fn

    def remote(self, *args):
        """Runs now; returns an awaitable holding the result, like a Ray ObjectRef."""
        future = asyncio.get_running_loop().create_future()
        future.set_result(self.fn(*args))
        return future


class InProcessWorker:
    """`CPWorker(cp_rank=0, cp_size=1)` whose public methods are called as `.method.remote(...)` and awaited."""

    def __init__(self, rank: RankSpec):
        self.worker = CPWorker(0, 1, num_threads=None)
        self.worker.load(rank)

    def __getattr__(self, name: str) -> _Method:
        if name.startswith("_") or not callable(getattr(CPWorker, name, None)):
            raise AttributeError(f"CPWorker has no method {name!r}")
        return _Method(getattr(self.worker, name))
