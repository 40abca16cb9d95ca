"""The small interface a grammar library sits behind (xgrammar today; llguidance could be a second entry).

A backend compiles a `GrammarSpec` against the checkpoint's tokenizer (once per distinct constraint: compile_cache.py)
and makes matchers of the compiled grammar. A matcher follows one request's output: the tokens allowed next as a
packed bitmask (bit j of word i is token 32 * i + j, the layout xgrammar and llguidance share), accepting a token,
rolling back (speculative drafts), and whether a stop token ended it.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np
import torch

from cp_router.grammar_spec import GrammarSpec

GRAMMAR_BACKENDS = {"xgrammar": "model_workers.grammar.xgrammar_backend:XGrammarBackend"}
DEFAULT_GRAMMAR_BACKEND = "xgrammar"


class GrammarError(ValueError):
    """A constraint the backend cannot compile: the message names the field and the library's reason."""


class CompiledGrammar(Protocol):
    @property
    def memory_bytes(self) -> int:
        """What the compiled grammar holds in memory (the compile cache's byte bound)."""


class Matcher(Protocol):
    def fill_bitmask(self, bitmask: torch.Tensor) -> None:
        """Writes the tokens allowed next into bitmask [ceil(V / 32)] int32 (CPU)."""

    def accept(self, token_id: int) -> bool:
        """Advances by one token; False (and unchanged) when the grammar rejects it."""

    def rollback(self, num_tokens: int) -> None:
        """Undoes the last `num_tokens` accepted tokens."""

    def is_terminated(self) -> bool:
        """A stop token was accepted: the constrained output is complete."""


class GrammarBackend(Protocol):
    name: str
    vocab_size: int

    def compile(self, spec: GrammarSpec) -> CompiledGrammar:
        """Raises GrammarError for a constraint that does not compile."""

    def matcher(self, compiled: CompiledGrammar, stop_ids: tuple[int, ...]) -> Matcher:
        """A fresh matcher; `stop_ids` end the constrained output once the grammar is complete."""


@dataclass(frozen=True)
class TokenizerVocab:
    """What a backend needs of the checkpoint's tokenizer: tokenizer.json's text and the model's vocabulary size
    (the logits' width, which may exceed the tokenizer's)."""

    tokenizer_json: str
    vocab_size: int

    @classmethod
    def of_model_dir(cls, model_dir: str | Path, vocab_size: int) -> TokenizerVocab | None:
        path = Path(model_dir) / "tokenizer.json"
        return cls(path.read_text(encoding="utf-8"), vocab_size) if path.is_file() else None


def make_backend(name: str, vocab: TokenizerVocab) -> GrammarBackend:
    """The backend registered as `name` (GRAMMAR_BACKENDS), over `vocab`; the library is imported here, on first
    use, not when a process starts."""
    if name not in GRAMMAR_BACKENDS:
        raise ValueError(f"grammar_backend must be one of {', '.join(GRAMMAR_BACKENDS)}, got {name!r}")
    module_name, class_name = GRAMMAR_BACKENDS[name].split(":")
    return getattr(importlib.import_module(module_name), class_name)(vocab)


def bitmask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def allowed_tokens(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Packed bitmask [ceil(V / 32)] int32 (CPU) -> allowed [V] bool (numpy's unpackbits: 5x torch's shifts)."""
    bits = np.unpackbits(bitmask.numpy().view(np.uint8), bitorder="little")[:vocab_size]  # [V] uint8, little-endian
    return torch.from_numpy(bits.view(np.bool_))
