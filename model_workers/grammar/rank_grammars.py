"""A rank's grammar side: the compile cache over the checkpoint's tokenizer, built on the first constrained request
(the library is imported then, not when the rank starts), and compiles started as soon as a plan names a constraint
so that they run while the rank's forward does."""

from __future__ import annotations

from pathlib import Path

from cp_router.plans import PrefillRequest
from model_workers.grammar.backend import DEFAULT_GRAMMAR_BACKEND, TokenizerVocab, make_backend
from model_workers.grammar.compile_cache import GrammarCache


class RankGrammars:
    def __init__(self, model_dir: str | Path, vocab_size: int, backend: str = DEFAULT_GRAMMAR_BACKEND):
        self.model_dir, self.vocab_size, self.backend = model_dir, vocab_size, backend
        self._cache: GrammarCache | None = None

    def cache_for(self, requests: tuple[PrefillRequest, ...]) -> GrammarCache | None:
        """The compile cache when a request of the batch is constrained (None otherwise, or without a tokenizer);
        the compiles of its constraints are started."""
        specs = [req.sampling.grammar for req in requests if req.sampling.grammar is not None]
        if not specs:
            return None
        if self._cache is None:
            vocab = TokenizerVocab.of_model_dir(self.model_dir, self.vocab_size)
            if vocab is None:
                return None
            self._cache = GrammarCache(make_backend(self.backend, vocab))
        for spec in specs:
            self._cache.prefetch(spec)
        return self._cache
