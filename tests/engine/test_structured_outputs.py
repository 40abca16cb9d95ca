"""Structured outputs in the engine at C = 1 (the default model, its tokenizer): every constraint kind ends in text
that satisfies it, speculation drafts and verifies under the grammar without changing a token, the constraint
starts after `after_ids`, and a preempted constrained request recomputes the same tokens."""

import json
import re

import jsonschema
import pytest

from cluster.engine_setup import run_all
from cluster.engine_spec import EngineOptions
from cp_router.grammar_spec import GrammarSpec
from cp_router.protocol import EngineRequest
from model_workers.checkpoint.model_dir import resolve_model_dir
from model_workers.checkpoint.tokenizer import load_tokenizer
from support.engines import local_engine

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "size"],
          "properties": {"name": {"type": "string", "maxLength": 8}, "size": {"type": "integer", "minimum": 0,
                                                                            "maximum": 99}}}
CHOICES = ["True", "False", "None", "a \"quoted\" \\ word"]
REGEX = r"[a-z_]{1,10}\([a-z]{0,6}\)"
EBNF = 'root ::= "import " name ("." name)?\nname ::= [a-z_] [a-z_]? [a-z_]? [a-z_]?'
EBNF_AS_REGEX = r"import [a-z_]{1,4}(\.[a-z_]{1,4})?"
SPECS = {
    "json_schema": GrammarSpec("json_schema", json.dumps(SCHEMA), strict=True),
    "json_object": GrammarSpec("json_object"),
    "regex": GrammarSpec("regex", REGEX),
    "choice": GrammarSpec("choice", json.dumps(CHOICES)),
    "ebnf": GrammarSpec("ebnf", EBNF),
}
PROMPT_TEXT = "import json\n\nCONFIG = json.loads('"
MAX_TOKENS = 160


def satisfies(kind: str, text: str) -> bool:
    if kind in ("json_schema", "json_object"):
        value = json.loads(text)
        jsonschema.validate(value, SCHEMA if kind == "json_schema" else {"type": "object"})
        return True
    if kind == "choice":
        return text in CHOICES
    return re.fullmatch(REGEX if kind == "regex" else EBNF_AS_REGEX, text) is not None


@pytest.fixture(scope="module")
def model():
    return resolve_model_dir(None)


@pytest.fixture(scope="module")
def prompt(model):
    return tuple(load_tokenizer(model).encode(PROMPT_TEXT).ids)


def engine(model, k: int, num_pages: int = 96):
    return local_engine(model, EngineOptions(num_speculative_steps=k, num_pages=num_pages, page_size=8,
                                             prefill_token_budget=64))


def requests(prompt, kinds, temperatures=(0.0, 0.8, 1.0), max_tokens: int = MAX_TOKENS) -> list[EngineRequest]:
    return [EngineRequest(f"{kind}-{i}", prompt, max_tokens, temperature=t, seed=7 + i, grammar=SPECS[kind])
            for kind in kinds for i, t in enumerate(temperatures)]


def test_every_kind_ends_in_text_that_satisfies_it(model, prompt):
    """The bounded constraints must finish within MAX_TOKENS; any JSON object may go on (a string without end),
    so it is checked when it stops and as an object's opening otherwise."""
    reqs = requests(prompt, list(SPECS))
    free = run_all(engine(model, 0), [EngineRequest("free", prompt, 12, temperature=0.0)])[0]
    assert not free["text"].startswith("{")  # the model would not write JSON here unconstrained
    for req, out in zip(reqs, run_all(engine(model, 0), reqs)):
        kind = req.grammar.kind
        if kind == "json_object" and out["finish_reason"] == "length":
            assert out["text"].lstrip().startswith("{") and len(out["token_ids"]) == MAX_TOKENS
            continue
        assert out["finish_reason"] == "stop", (kind, out)
        assert out["token_ids"][-1] == 0  # the grammar ended with the model's EOS (the stop token)
        assert satisfies(kind, out["text"]), (kind, out["text"])


def test_speculation_drafts_and_verifies_under_the_grammar_without_changing_a_token(model, prompt):
    """Greedy and seeded: the same tokens for every k (model_workers/sampler.py)."""
    reqs = requests(prompt, list(SPECS), temperatures=(0.0, 0.9), max_tokens=48)
    plain = run_all(engine(model, 0), reqs)
    for k in (1, 3):
        spec_engine = engine(model, k)
        assert run_all(spec_engine, reqs) == plain, f"k={k}"
        assert spec_engine.stats.accepted > 0 and spec_engine.stats.accepted < spec_engine.stats.drafted


def test_the_constraint_starts_after_after_ids(model, prompt):
    free = run_all(engine(model, 0), [EngineRequest("free", prompt, 3, temperature=0.0)])[0]["token_ids"]
    after = tuple(free[:2])  # the first two tokens the model writes anyway: the "end of thinking" here
    spec = GrammarSpec("choice", json.dumps(CHOICES), after_ids=after)
    for k in (0, 2):
        out = run_all(engine(model, k), [EngineRequest("late", prompt, 40, temperature=0.0, grammar=spec)])[0]
        assert tuple(out["token_ids"][:2]) == after and out["finish_reason"] == "stop"
        tokenizer = load_tokenizer(model)
        assert tokenizer.decode(out["token_ids"][2:-1]) in CHOICES


def test_a_preempted_constrained_request_recomputes_the_same_tokens(model, prompt):
    reqs = requests(prompt, ["json_schema", "regex", "ebnf"], temperatures=(0.0, 0.9, 1.0))
    ample = run_all(engine(model, 2), reqs)
    small = engine(model, 2, num_pages=24)  # 192 token slots for 9 requests of 13 + up to 160 tokens
    assert run_all(small, reqs) == ample
    assert small.stats.preemptions > 0 and small.free_pages == [24]
