"""The ingress compiles every constraint before its request is queued: an invalid JSON schema, regex or grammar is
a 400 naming the field and the library's message, and a constraint still compiling after the timeout is a 400 too
(the compile goes on in the background and is cached, so a retry finds it). Compiles run on the compile cache's
thread, never on the event loop; each distinct constraint compiles once (model_workers/grammar/compile_cache.py).
"""

from __future__ import annotations

import asyncio

from tokenizers import Tokenizer

from cluster.http_api.errors import bad_request
from cp_router.grammar_spec import GrammarSpec
from cp_router.metrics import ServeMetrics
from model_workers.grammar.backend import DEFAULT_GRAMMAR_BACKEND, GrammarError, TokenizerVocab, make_backend
from model_workers.grammar.compile_cache import GrammarCache


class GrammarCheck:
    def __init__(self, tokenizer: Tokenizer | None, vocab_size: int, timeout_s: float, metrics: ServeMetrics):
        self.tokenizer, self.vocab_size, self.timeout_s, self.metrics = tokenizer, vocab_size, timeout_s, metrics
        self._cache: GrammarCache | None = None

    def cache(self, spec: GrammarSpec) -> GrammarCache:
        if self.tokenizer is None:
            raise bad_request(f"{spec.label or spec.kind}: structured outputs need the model's tokenizer.json, which "
                              "this server does not have", param=spec.label or None)
        if self._cache is None:  # the first constrained request imports the library and reads the vocabulary
            backend = make_backend(DEFAULT_GRAMMAR_BACKEND, TokenizerVocab(self.tokenizer.to_str(), self.vocab_size))
            self._cache = GrammarCache(backend, on_compiled=lambda _, seconds: self.metrics.observe_grammar_compile(
                seconds))
        return self._cache

    async def check(self, spec: GrammarSpec | None) -> None:
        """Returns once `spec` compiled (None: nothing to check); raises the 400 otherwise."""
        if spec is None:
            return
        self.metrics.count_structured_output(spec.kind)
        label = spec.label or spec.kind
        cache = await asyncio.to_thread(self.cache, spec)  # the first call builds the vocabulary: off the loop too
        try:
            await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(cache.prefetch(spec))), self.timeout_s)
        except GrammarError as exc:
            raise bad_request(str(exc), param=spec.label or None, code="invalid_grammar") from None
        except TimeoutError:
            raise bad_request(f"{label}: the {spec.kind} did not compile within {self.timeout_s:g} s "
                              "(grammar_compile_timeout_s)", param=spec.label or None, code="grammar_timeout") from None
