"""Schemathesis over the server's own OpenAPI document (GET /openapi.json): POST /v1/completions and
/v1/chat/completions, cases that fit the schema and cases that break it, sent in-process over ASGI.

Checks on every answer: no 5xx; a 4xx is an OpenAI error body; the status, content type, headers and (for
JSON) the body are the ones the schema documents; a body that breaks the schema is rejected. First over a
deterministic fake engine, then a few cases over the real default model (real tokenizer, window, sampler).

Each test prints one JSON line of counts (`-s`). Long run (N cases per fake-engine test, N / 10 on the model):
    DSA_FUZZ_EXAMPLES=2000 .venv/bin/python -m pytest -s -m fuzz tests/http_api/test_fuzz_schema.py
"""

from __future__ import annotations

import pytest
import schemathesis
from hypothesis import given
from hypothesis import strategies as st
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.config import SchemathesisConfig
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    negative_data_rejection,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from cluster.engine_setup import start_local_engine
from cluster.engine_spec import EngineOptions
from cluster.http_api.ingress import build_app
from cluster.serve_settings import IngressSettings
from cp_router.protocol import ModelInfo
from model_workers.checkpoint.model_dir import PACKAGED_MODEL_DIR
from support.fuzz import FuzzTally, fuzz_examples, fuzz_settings, sse_problem
from support.http_fakes import VOCAB_SIZE, FakeEngine

pytestmark = pytest.mark.fuzz
ROUTES = ["/v1/completions", "/v1/chat/completions"]
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_headers_conformance,
          response_schema_conformance, negative_data_rejection]
CONFIG = SchemathesisConfig.from_dict({"max-stream-events": 100_000})  # and no schemathesis.toml is looked for
FAKE_INFO = ModelInfo(name="tiny-dsa", vocab_size=VOCAB_SIZE, max_model_len=96, has_chat_template=True)


def load_schema(app):
    """The app's published document; whole event streams are read (schemathesis stops at 20 events by default)."""
    return schemathesis.openapi.from_asgi("/openapi.json", app, config=CONFIG)


@pytest.fixture(scope="module")
def fake_schema(checkpoint):
    return load_schema(build_app(FakeEngine(FAKE_INFO), IngressSettings(model_dir=str(checkpoint),
                                                                         max_body_bytes=64 * 1024)))


@pytest.fixture(scope="module")
def real_schema():
    engine = start_local_engine(PACKAGED_MODEL_DIR, EngineOptions(num_pages=64, page_size=16, max_model_len=40))
    return load_schema(build_app(engine, IngressSettings(model_dir=str(PACKAGED_MODEL_DIR), max_body_bytes=64 * 1024)))


def streaming(case):
    """The schema-valid case with `"stream": true` (schemathesis alone rarely draws it)."""
    if isinstance(case.body, dict):
        case.body = {**case.body, "stream": True}
    return case


def fuzz_operation(schema, path: str, examples: int, name: str) -> FuzzTally:
    """`examples` schemathesis cases (schema-valid and schema-breaking, mixed) against POST `path`."""
    operation = schema[path]["POST"]
    tally = FuzzTally(name)
    positive = operation.as_strategy(GenerationMode.POSITIVE)
    cases = st.one_of(positive, positive.map(streaming), operation.as_strategy(GenerationMode.NEGATIVE))

    @fuzz_settings(examples)
    @given(case=cases)
    def run(case):
        response = case.call()
        content_type = ",".join(response.headers.get("content-type", []))  # schemathesis: lists of values
        tally.extra[f"{case.meta.generation.mode.value}_cases"] += 1
        tally.extra["streamed"] += content_type.startswith("text/event-stream")
        problem = tally.record(response.status_code, content_type, response.content, f"{case.body!r:.300}")
        assert not response.stream_cut_short
        if response.status_code == 200 and content_type.startswith("text/event-stream"):
            problem = sse_problem(response.content)
        assert problem is None, problem
        case.validate_response(response, checks=CHECKS)

    try:
        run()
    finally:
        tally.report()
    return tally


def test_the_schema_describes_the_generation_bodies(fake_schema):
    document = fake_schema.raw_schema
    for path in ROUTES:
        operation = document["paths"][path]["post"]
        body = operation["requestBody"]["content"]["application/json"]["schema"]
        assert body["$ref"].split("/")[-1] in document["components"]["schemas"]
        assert {"200", "400", "404", "408", "413", "429", "503"} <= set(operation["responses"])
        assert set(operation["responses"]["200"]["content"]) == {"application/json", "text/event-stream"}
    completion = document["components"]["schemas"]["CompletionRequest"]
    assert completion["required"] == ["prompt"]
    assert {"type": "null"} in completion["properties"]["temperature"]["anyOf"]  # null means the default
    stop = completion["properties"]["stop"]["anyOf"][0]["anyOf"]
    assert [option["type"] for option in stop] == ["string", "array"]  # one stop string, or a list


@pytest.mark.parametrize("path, examples", list(zip(ROUTES, [60, 40])))  # chat cases are slower to draw
def test_schemathesis_over_the_fake_engine(fake_schema, path, examples):
    tally = fuzz_operation(fake_schema, path, fuzz_examples(examples), f"schemathesis {path} (fake engine)")
    summary = tally.summary()
    assert summary["5xx"] == 0 and not tally.problems, tally.report()
    assert summary["positive_cases"] and summary["negative_cases"] and summary["2xx"], tally.report()
    assert summary["streamed"], tally.report()


@pytest.mark.parametrize("path", ROUTES)
def test_schemathesis_over_the_default_model(real_schema, path):
    tally = fuzz_operation(real_schema, path, max(fuzz_examples(8) // 10, 8), f"schemathesis {path} (default model)")
    assert tally.summary()["5xx"] == 0 and not tally.problems, tally.report()


ODD_PROMPTS = ["\x00", "nul\x00in", "\u202eevil\u202c", "e\u0301\u0301\u0301", "\ufeff", "\U0001f600\U0010ffff",
               "\r\n\t\x1b[31m", "\u2028\u2029", "\ufffe\uffff", "</s><|endoftext|>", "\ud800", "a\udfffb"]


def test_odd_text_through_the_default_models_tokenizer(real_schema):
    """The real tokenizer, detokenizer (echo) and chat template on odd text: served, or a 400 for lone surrogates."""
    tally = FuzzTally("odd text (default model)")
    for text in ODD_PROMPTS:
        bodies = {"/v1/completions": {"prompt": text, "max_tokens": 2, "echo": True},
                  "/v1/chat/completions": {"messages": [{"role": "user", "content": text}], "max_tokens": 2}}
        for path, body in bodies.items():
            for stream in (False, True):
                response = real_schema[path]["POST"].Case(body={**body, "stream": stream}).call()
                content_type = ",".join(response.headers.get("content-type", []))
                problem = tally.record(response.status_code, content_type, response.content, repr(text))
                lone = any(0xD800 <= ord(char) <= 0xDFFF for char in text)
                assert response.status_code == (400 if lone else 200) and problem is None, (text, response.content)
    tally.report()
