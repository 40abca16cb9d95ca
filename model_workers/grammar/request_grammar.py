"""One request's constraint on the rank that samples: a matcher over its output, the tokens allowed next, and the
bookkeeping that lets speculation try tokens and take them back.

The constraint starts once the output holds `GrammarSpec.after_ids` in a row (a reasoning model's end of thinking;
from the first token when empty). `advance` pushes a token (an emitted one, or a draft / verify row's trial);
`rollback(n)` takes back the last n pushes; `commit` makes the pushes so far permanent (emitted tokens). A draft the
grammar rejects makes the request unconstrained until rolled back: verification rejects it anyway (its target
probability is 0), and the rows after it are discarded.
"""

from __future__ import annotations

import time

import torch

from cp_router.grammar_spec import GrammarSpec
from model_workers.grammar.backend import Matcher, allowed_tokens, bitmask_words
from model_workers.grammar.compile_cache import GrammarCache

_MATCHED, _WAITING, _IDLE, _REJECTED = "matched", "waiting", "idle", "rejected"


class MaskClock:
    """Seconds this process spent computing grammar masks since the last `take` (a rank reports it per step)."""

    def __init__(self):
        self.seconds, self.masks = 0.0, 0

    def take(self) -> tuple[float, int]:
        taken, self.seconds, self.masks = (self.seconds, self.masks), 0.0, 0
        return taken


MASK_CLOCK = MaskClock()


class RequestGrammar:
    def __init__(self, matcher: Matcher, vocab_size: int, after_ids: tuple[int, ...] = ()):
        self.matcher, self.vocab_size, self.after_ids = matcher, vocab_size, after_ids
        self.active = not after_ids  # the constraint has started
        self.rejected = False  # a pushed token was not allowed (a draft): unconstrained until rolled back
        self._recent: tuple[int, ...] = ()  # while waiting: the last len(after_ids) tokens
        self._pushes: list[tuple[str, tuple[int, ...]]] = []  # since the last commit: (kind, _recent before)
        self._bitmask = torch.zeros(bitmask_words(vocab_size), dtype=torch.int32)  # [ceil(V / 32)]

    @classmethod
    def start(cls, cache: GrammarCache, spec: GrammarSpec, stop_ids: tuple[int, ...],
              output_ids: tuple[int, ...] = ()) -> RequestGrammar:
        """A request's grammar after `output_ids` (a recomputed request replays the output it already has)."""
        grammar = cls(cache.backend.matcher(cache.get(spec), stop_ids), cache.backend.vocab_size, spec.after_ids)
        for token in output_ids:
            grammar.advance(token)
        grammar.commit()
        return grammar

    def allowed(self) -> torch.Tensor | None:
        """[V] bool: the tokens allowed next; None when nothing is constrained here (before the constraint starts,
        after a stop token ended it, after a rejected trial token)."""
        if not self.active or self.rejected or self.matcher.is_terminated():
            return None
        start = time.perf_counter()
        self.matcher.fill_bitmask(self._bitmask)
        allowed = allowed_tokens(self._bitmask, self.vocab_size)
        MASK_CLOCK.seconds += time.perf_counter() - start
        MASK_CLOCK.masks += 1
        return allowed

    def advance(self, token_id: int) -> bool:
        """Pushes one output token; False when the grammar rejects it."""
        if self.rejected or (self.active and self.matcher.is_terminated()):
            self._pushes.append((_IDLE, self._recent))
            return not self.rejected
        if not self.active:
            self._pushes.append((_WAITING, self._recent))
            self._recent = (self._recent + (token_id,))[-len(self.after_ids):]
            self.active = self._recent == self.after_ids
            return True
        if self.matcher.accept(token_id):
            self._pushes.append((_MATCHED, self._recent))
            return True
        self._pushes.append((_REJECTED, self._recent))
        self.rejected = True
        return False

    def rollback(self, num_tokens: int) -> None:
        """Takes back the last `num_tokens` pushes (at most those since the last commit)."""
        matched = 0
        for _ in range(num_tokens):
            kind, recent = self._pushes.pop()
            if kind == _MATCHED:
                matched += 1
            elif kind == _WAITING:
                self.active, self._recent = False, recent
            elif kind == _REJECTED:
                self.rejected = False
        self.matcher.rollback(matched)

    def commit(self) -> None:
        self._pushes.clear()
