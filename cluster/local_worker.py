"""A C = 1 engine in this process: the rank worker called like a Ray actor handle, without Ray."""

from __future__ import annotations

import asyncio
from pathlib import Path

from model_workers.cp_worker import CPWorker


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

    def __init__(self, model_dir: str | Path, dtype: str, num_pages: int, page_size: int, kv_cache_dtype: str = "auto",
                 deterministic: bool = False, speculative_token_map: str = "auto"):
        self.worker = CPWorker(0, 1, num_threads=None)
        self.worker.load(str(model_dir), dtype, num_pages, page_size, kv_cache_dtype=kv_cache_dtype,
                         deterministic=deterministic, speculative_token_map=speculative_token_map)

    def __getattr__(self, name: str) -> _Method:
        if name.startswith("_") or not callable(getattr(CPWorker, name, None)):
            raise AttributeError(f"CPWorker has no method {name!r}")
        return _Method(getattr(self.worker, name))
