"""Compiled grammars, once per distinct constraint: an LRU bounded in entries and in bytes, compiling on a
background thread so that the caller (the HTTP ingress's event loop, a rank's step) never blocks on a compile it
does not need yet. Concurrent asks for one constraint share one compile; a failed compile is not kept."""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable

from cp_router.grammar_spec import GrammarSpec
from model_workers.grammar.backend import CompiledGrammar, GrammarBackend

DEFAULT_MAX_ENTRIES = 256
DEFAULT_MAX_BYTES = 512 << 20


@dataclass
class CacheStats:
    hits: int = 0
    compiles: int = 0
    evictions: int = 0
    compile_seconds: list[float] = field(default_factory=list)  # the latest compiles' times (bounded)


class GrammarCache:
    def __init__(self, backend: GrammarBackend, max_entries: int = DEFAULT_MAX_ENTRIES,
                 max_bytes: int = DEFAULT_MAX_BYTES, on_compiled: Callable[[GrammarSpec, float], None] | None = None):
        self.backend = backend
        self.max_entries, self.max_bytes = max_entries, max_bytes
        self.stats = CacheStats()
        self._on_compiled = on_compiled
        self._entries: OrderedDict[tuple, Future] = OrderedDict()  # key -> its compile (done or running)
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-compile")

    def prefetch(self, spec: GrammarSpec) -> Future:
        """The compile of `spec` (started now unless cached or running); the entry becomes most recently used."""
        with self._lock:
            future = self._entries.get(spec.key)
            if future is not None and not future.cancelled():
                self._entries.move_to_end(spec.key)
                self.stats.hits += 1
                return future
            future = self._pool.submit(self._compile, spec)
            self._entries[spec.key] = future
        return future

    def get(self, spec: GrammarSpec, timeout: float | None = None) -> CompiledGrammar:
        """The compiled grammar; raises GrammarError (does not compile) or TimeoutError (still compiling after
        `timeout` seconds; the compile goes on and is kept)."""
        return self.prefetch(spec).result(timeout)

    def _compile(self, spec: GrammarSpec) -> CompiledGrammar:
        start = time.perf_counter()
        try:
            compiled = self.backend.compile(spec)
        except BaseException:
            with self._lock:
                self._entries.pop(spec.key, None)
            raise
        seconds = time.perf_counter() - start
        with self._lock:
            self.stats.compiles += 1
            self.stats.compile_seconds = (self.stats.compile_seconds + [seconds])[-256:]
        if self._on_compiled is not None:
            self._on_compiled(spec, seconds)
        self._evict(spec.key, compiled.memory_bytes)
        return compiled

    def _evict(self, just_compiled: tuple, its_bytes: int) -> None:
        """Drops least recently used finished entries until both bounds hold (the newest one always stays)."""
        with self._lock:
            total = its_bytes + sum(f.result().memory_bytes for k, f in self._entries.items()
                                    if k != just_compiled and f.done() and f.exception() is None)
            for key in list(self._entries):
                if len(self._entries) <= self.max_entries and total <= self.max_bytes:
                    break
                future = self._entries[key]
                if key == just_compiled or not future.done():
                    continue
                del self._entries[key]
                self.stats.evictions += 1
                total -= future.result().memory_bytes if future.exception() is None else 0

    def __len__(self) -> int:
        return len(self._entries)

    def cached_bytes(self) -> int:
        with self._lock:
            return sum(f.result().memory_bytes for f in self._entries.values() if f.done() and f.exception() is None)
