"""What a request's output is constrained to (structured outputs): plain data that travels with `SamplingParams`
from the HTTP edge to the rank that samples (docs/structured_outputs.md).

The constraint is compiled by the grammar backend (model_workers/grammar/) on every process that needs it, once per
distinct `GrammarSpec.key` (an LRU). `after_ids`: the constraint starts only once the output contains these token
ids in a row (a reasoning model's end-of-thinking marker), so reasoning stays free and the answer is constrained.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Literal

GrammarKind = Literal["json_schema", "json_object", "regex", "choice", "ebnf", "structural_tag"]
GRAMMAR_KINDS: tuple[GrammarKind, ...] = ("json_schema", "json_object", "regex", "choice", "ebnf", "structural_tag")


@dataclass(frozen=True)
class GrammarSpec:
    kind: GrammarKind
    # json_schema: the schema as JSON text; regex: the pattern; choice: a JSON list of the strings; ebnf: the grammar
    # (GBNF / xgrammar EBNF, root rule `root`); structural_tag: xgrammar's structural tag as JSON; json_object: ""
    source: str = ""
    strict: bool = False  # json_schema: objects take no properties the schema does not name (OpenAI's `strict`)
    after_ids: tuple[int, ...] = ()  # the constraint starts after these output tokens (() = from the first token)
    label: str = ""  # the request field it came from, for error messages and the requests-by-type metric

    def __post_init__(self):
        if self.kind not in GRAMMAR_KINDS:
            raise ValueError(f"grammar kind must be one of {', '.join(GRAMMAR_KINDS)}, got {self.kind!r}")

    @property
    def key(self) -> tuple[str, str, bool]:
        """What the compiled grammar depends on (the compile cache's key)."""
        return (self.kind, self.source, self.strict)

    @property
    def digest(self) -> str:
        """A short stable name of `key` (logs)."""
        return hashlib.blake2b(repr(self.key).encode(), digest_size=8).hexdigest()
