"""Hypothesis-built malformed requests sent as raw bytes over ASGI: invalid and truncated JSON, huge numbers,
deep nesting, odd unicode, wrong types per field, duplicate keys, very long strings, wrong content types, empty
bodies, streaming on and off, and bodies delivered in many small receive messages (slowly, or abandoned).

Every answer: no 5xx; an error is an OpenAI error body; a 200 is a whole response or an SSE stream of JSON
events ending in [DONE]; an abandoned body never reaches the engine. Each test prints one JSON line of counts
(`-s`). Long run:
    DSA_FUZZ_EXAMPLES=2000 .venv/bin/python -m pytest -s -m fuzz tests/http_api/test_fuzz_bodies.py
"""

from __future__ import annotations

import asyncio
import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cluster.http_api.ingress import build_app
from cluster.http_api.openai_responses import ChatCompletionResponse, CompletionResponse
from cluster.serve_settings import IngressSettings
from cp_router.protocol import ModelInfo
from support.fuzz import FuzzTally, fuzz_examples, fuzz_settings, send_raw, sse_problem
from support.http_fakes import VOCAB_SIZE, FakeEngine

pytestmark = pytest.mark.fuzz
MAX_BODY = 256 * 1024
INFO = ModelInfo(name="tiny-dsa", vocab_size=VOCAB_SIZE, max_model_len=96, has_chat_template=True)
ROUTES = {"/v1/completions": ({"prompt": "hello world", "max_tokens": 4}, CompletionResponse),
          "/v1/chat/completions": ({"messages": [{"role": "user", "content": "hello"}], "max_tokens": 4},
                                   ChatCompletionResponse)}
FIELDS = ["model", "prompt", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "n",
          "stop", "stream", "stream_options", "seed", "user", "logprobs", "top_logprobs", "echo", "logit_bias",
          "stop_token_ids", "min_tokens", "tools", "tool_choice", "chat_template_kwargs", "prompt_logprobs",
          "response_format", "best_of", "suffix", "frequency_penalty", "repetition_penalty"]
# Where a string lands in a body (each a fragment over the route's base body): the text the tokenizer, the chat
# template, the stop matcher or an error message reads.
TEXT_SPOTS = {
    "/v1/completions": [lambda m: {"prompt": m}, lambda m: {"prompt": [m, "hello"]}, lambda m: {"stop": m},
                        lambda m: {"stop": ["x", m]}, lambda m: {"user": m}, lambda m: {"model": m},
                        lambda m: {"logit_bias": {m: 1}}, lambda m: {"suffix": m},
                        lambda m: {"echo": True, "prompt": m}],
    "/v1/chat/completions": [
        lambda m: {"messages": [{"role": "user", "content": m}]},
        lambda m: {"messages": [{"role": "user", "content": [{"type": "text", "text": m}]}]},
        lambda m: {"messages": [{"role": "system", "content": m}, {"role": "user", "content": "hello"}]},
        lambda m: {"messages": [{"role": "user", "content": "hello", "name": m}]}, lambda m: {"stop": m},
        lambda m: {"user": m}, lambda m: {"model": m}, lambda m: {"chat_template_kwargs": {m: m}}]}
NUMBER_SPOTS = {
    "/v1/completions": [lambda m: {"prompt": [3, m]}, lambda m: {"prompt": [[m]]}, lambda m: {"logprobs": m},
                        lambda m: {"max_tokens": m}],
    "/v1/chat/completions": [lambda m: {"max_completion_tokens": m}, lambda m: {"logprobs": True, "top_logprobs": m}]}
SHARED_NUMBER_SPOTS = [lambda m: {"temperature": m}, lambda m: {"top_p": m}, lambda m: {"top_k": m},
                       lambda m: {"n": m}, lambda m: {"seed": m}, lambda m: {"min_tokens": m},
                       lambda m: {"presence_penalty": m}, lambda m: {"repetition_penalty": m},
                       lambda m: {"logit_bias": {"3": m}}, lambda m: {"stop_token_ids": [m]},
                       lambda m: {"prompt_logprobs": m}, lambda m: {"best_of": m}]
MARK = "\x00MARK"
ODD_TEXT = ["\ud800", "a\udfffb", "\udc00\ud800", "\x00", "nul\x00in", "\u202eevil\u202c", "e\u0301\u0301\u0301" * 50,
            "\ufeff", "\U0001f600" * 100, "\u0000" * 64, "\r\n\t\x1b[31m", "\u2028\u2029", "\U0010ffff", "\ufffe\uffff",
            "\u00b2", "--5", "\u0661", "1" * 5000, "hello " * 2000, "{{ 7 * 7 }}", "<|endoftext|>", "</s>"]
HUGE_NUMBERS = ["1e400", "-1e400", "1" + "0" * 400, "-" + "9" * 4000, "9" * 4301, "1e-400", "0.1e999999", "-0",
                "123456789" * 600, "1.0", "16.0", "2.5e1", "9223372036854775808", "-9223372036854775809", "true"]
CONTENT_TYPES = ["application/json", "application/json; charset=utf-8", "APPLICATION/JSON", "text/plain", "",
                 "application/x-www-form-urlencoded", "multipart/form-data; boundary=x", "application/problem+json",
                 "application/json; charset=latin-1", "application/jsonx"]


def json_values(leaf_text=st.text(max_size=20)):
    """Any JSON value (small)."""
    leaves = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | leaf_text
    return st.recursive(leaves, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8),
                                                                                           inner, max_size=4),
                        max_leaves=12)


def _with_literal(body: dict, spot, literal: str, ensure_ascii: bool) -> str:
    """The body with `spot`'s fragment, its marker replaced by the raw JSON text `literal`."""
    text = json.dumps({**body, **spot(MARK)}, ensure_ascii=ensure_ascii)
    return text.replace(json.dumps(MARK), literal)


@st.composite
def malformed_text(draw, path: str) -> str:
    """A request body as text: the route's valid base body, bent one way."""
    body = {**ROUTES[path][0], "stream": draw(st.booleans())}
    ascii_only = draw(st.booleans())
    kind = draw(st.sampled_from(["valid", "wrong_type", "huge_number", "deep", "duplicate", "truncated", "odd_text",
                                 "garbage", "long_string", "not_an_object"]))
    text_spot = draw(st.sampled_from(TEXT_SPOTS[path]))
    number_spot = draw(st.sampled_from(NUMBER_SPOTS[path] + SHARED_NUMBER_SPOTS))
    if kind == "wrong_type":
        for field in draw(st.lists(st.sampled_from(FIELDS), min_size=1, max_size=3, unique=True)):
            body[field] = draw(json_values(st.text(max_size=20) | st.sampled_from(ODD_TEXT)))
    if kind == "huge_number":
        return _with_literal(body, number_spot, draw(st.sampled_from(HUGE_NUMBERS)), ascii_only)
    if kind == "deep":
        depth = draw(st.sampled_from([50, 99, 100, 101, 200, 500, 999, 10**4, 10**5]))
        spot = draw(st.sampled_from([text_spot, number_spot]))
        return _with_literal(body, spot, draw(st.sampled_from(["[", '{"a":'])) * depth + "1" +
                             draw(st.sampled_from(["]", "}"])) * depth, ascii_only)
    if kind in ("odd_text", "long_string"):
        value = draw(st.sampled_from(ODD_TEXT)) if kind == "odd_text" else \
            "w9 " * draw(st.sampled_from([10**3, 3 * 10**4, 10**5]))
        return _with_literal(body, text_spot, json.dumps(value, ensure_ascii=ascii_only), ascii_only)
    if kind == "duplicate":
        key = draw(st.sampled_from(sorted(body)))
        return json.dumps(body)[:-1] + f", {json.dumps(key)}: {json.dumps(draw(json_values()))}}}"
    if kind == "not_an_object":
        return json.dumps(draw(json_values()))
    text = json.dumps(body, ensure_ascii=ascii_only)
    if kind == "truncated":
        return text[: draw(st.integers(0, len(text) - 1))]
    if kind == "garbage":
        position = draw(st.integers(0, len(text)))
        return text[:position] + draw(st.sampled_from(["}", "{", "\\", '"', ",", "NaN", "Infinity", "\x00"])) \
            + text[position:]
    return text


def _encode(draw, text: str) -> bytes:
    raw = text.encode("utf-8", "surrogatepass")  # a lone surrogate left raw: invalid UTF-8 on the wire
    if draw(st.integers(0, 7)):  # 1 in 8: bytes that are not UTF-8
        return raw
    extra = draw(st.sampled_from([b"\xff", b"\xc3", b"\xed\xa0\x80", b"\x00", b"\xef\xbb\xbf"]))
    position = draw(st.integers(0, len(raw)))
    return raw[:position] + extra + raw[position:]


@st.composite
def requests(draw) -> tuple[str, bytes, str]:
    path = draw(st.sampled_from(sorted(ROUTES)))
    raw = _encode(draw, draw(malformed_text(path)))
    content_types = CONTENT_TYPES if draw(st.integers(0, 7)) == 0 else CONTENT_TYPES[:3]  # 1 in 8: maybe not JSON
    return path, raw, draw(st.sampled_from(content_types))


def check_success(path: str, answer) -> str | None:
    """Why a 200 is not a whole response or a well-formed SSE stream (None: it is)."""
    if answer.content_type.startswith("text/event-stream"):
        return sse_problem(answer.body)
    ROUTES[path][1].model_validate_json(answer.body)
    return None


@pytest.fixture(scope="module")
def app(checkpoint):
    return build_app(FakeEngine(INFO), IngressSettings(model_dir=str(checkpoint), max_body_bytes=MAX_BODY))


@pytest.fixture(scope="module")
def loop():
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


def fuzz(name: str, examples: int, strategy, check) -> FuzzTally:
    tally = FuzzTally(name)

    @fuzz_settings(examples)
    @given(strategy)
    def run(drawn):
        check(tally, drawn)

    try:
        run()
    finally:
        tally.report()
    return tally


def check_request(tally: FuzzTally, loop, app, drawn: tuple[str, bytes, str]) -> None:
    """Send one raw request; its answer must be an OpenAI error (never 5xx), a whole response or an SSE stream."""
    path, raw, content_type = drawn
    answer = loop.run_until_complete(send_raw(app, path, [raw], {"content-type": content_type}))
    problem = tally.record(answer.status, answer.content_type, answer.body, f"{raw[:200]!r}")
    if answer.status == 200:
        problem = problem or check_success(path, answer)
        tally.extra["streamed"] += answer.content_type.startswith("text/event-stream")
    assert problem is None, problem


def test_malformed_bodies_get_openai_errors_never_5xx(app, loop):
    tally = fuzz("hypothesis malformed bodies", fuzz_examples(200), requests(),
                 lambda tally, drawn: check_request(tally, loop, app, drawn))
    summary = tally.summary()
    assert summary["5xx"] == 0 and not tally.problems, tally.report()
    assert summary["4xx"] and summary["2xx"], tally.report()  # both the rejections and the answers were exercised


def grid() -> list[tuple[str, bytes, str]]:
    """Every odd string in every text spot and every huge number in every number spot, escaped and raw, streamed
    and not: the combinations a random draw would rarely reach."""
    cases = []
    for path in sorted(ROUTES):
        spots = [(spot, json.dumps(value, ensure_ascii=ascii_only)) for spot in TEXT_SPOTS[path] for value in ODD_TEXT
                 for ascii_only in (True, False)]
        spots += [(spot, number) for spot in NUMBER_SPOTS[path] + SHARED_NUMBER_SPOTS for number in HUGE_NUMBERS]
        for i, (spot, literal) in enumerate(spots):
            body = {**ROUTES[path][0], "stream": i % 2 == 0}
            text = _with_literal(body, spot, literal, ensure_ascii=False)
            cases.append((path, text.encode("utf-8", "surrogatepass"), "application/json"))
    return cases


def test_every_odd_value_in_every_spot(app, loop):
    tally = FuzzTally("grid of odd values")
    for case in grid():
        check_request(tally, loop, app, case)
    summary = tally.summary()
    assert summary["5xx"] == 0 and not tally.problems, tally.report()
    assert summary["2xx"] and summary["4xx"], tally.report()
    tally.report()


@st.composite
def deliveries(draw) -> tuple[str, list[bytes], float, bool]:
    """A valid body cut into pieces (empty ones too), sent `delay` apart; hang_up: the client stops part-way."""
    path = draw(st.sampled_from(sorted(ROUTES)))
    raw = json.dumps({**ROUTES[path][0], "stream": draw(st.booleans()), "user": "slow \u00e9\u202e\U0001f600"}).encode()
    cuts = sorted(draw(st.lists(st.integers(0, len(raw)), max_size=40)))  # a cut may split a UTF-8 character
    pieces = [raw[start:end] for start, end in zip([0, *cuts], [*cuts, len(raw)])]
    hang_up = draw(st.booleans())
    if hang_up:
        pieces = pieces[: draw(st.integers(0, len(pieces)))]
    return path, pieces, draw(st.sampled_from([0.0, 0.0005, 0.002])), hang_up


def test_slow_and_abandoning_senders(app, loop):
    engine = app.state.ingress.engine

    def check(tally, drawn):
        path, pieces, delay_s, hang_up = drawn
        reached = len(engine.requests)
        answer = loop.run_until_complete(send_raw(app, path, pieces, {"content-type": "application/json"}, delay_s,
                                                  "hang_up" if hang_up else "finish"))
        tally.extra["pieces"] += len(pieces)
        tally.extra["abandoned"] += hang_up
        problem = tally.record(answer.status, answer.content_type, answer.body, f"{len(pieces)} pieces")
        if hang_up:  # nobody is left to read an answer; the engine must not have been asked
            problem = problem or (None if answer.status in (0, 499) and len(engine.requests) == reached
                                  else f"an abandoned body got {answer.status} and reached the engine")
        else:
            problem = problem or (check_success(path, answer) if answer.status == 200
                                  else f"a complete body sent slowly got {answer.status}: {answer.body[:200]!r}")
        assert problem is None, problem

    tally = fuzz("hypothesis slow senders", fuzz_examples(60), deliveries(), check)
    summary = tally.summary()
    assert summary["5xx"] == 0 and not tally.problems, tally.report()
    assert tally.extra["abandoned"] and summary["2xx"], tally.report()
