"""Shared parts of the API fuzzers: how many examples to run, the tally each fuzz test prints, the check that an
error answer is an OpenAI error body, and a raw ASGI client that sends a body in pieces, slowly, or not at all.

Long run: `DSA_FUZZ_EXAMPLES=2000 .venv/bin/python -m pytest -s -m fuzz tests/http_api` (the default run is
derandomized, so `make test` sees the same cases every time; a long run draws new ones).
"""

from __future__ import annotations

import asyncio
import json
import os
from collections import Counter
from dataclasses import dataclass, field

from hypothesis import HealthCheck, settings

from support.http_fakes import http_scope

FUZZ_EXAMPLES_ENV = "DSA_FUZZ_EXAMPLES"
ERROR_FIELDS = {"message", "type", "param", "code"}


def long_run() -> bool:
    return bool(os.environ.get(FUZZ_EXAMPLES_ENV))


def fuzz_examples(default: int) -> int:
    """`default`, or DSA_FUZZ_EXAMPLES when set (the long run)."""
    value = os.environ.get(FUZZ_EXAMPLES_ENV)
    return int(value) if value else default


def fuzz_settings(examples: int) -> settings:
    """Hypothesis settings of one fuzz test: `examples` cases, no deadline, the same cases unless in a long run."""
    return settings(max_examples=examples, deadline=None, database=None, derandomize=not long_run(),
                    suppress_health_check=list(HealthCheck))


def openai_error_problem(status: int, content_type: str, body: bytes) -> str | None:
    """Why an error answer is not `{"error": {"message", "type", "param", "code"}}` (None: it is one)."""
    if not content_type.startswith("application/json"):
        return f"{status} with content type {content_type!r}"
    try:
        payload = json.loads(body)
    except ValueError:
        return f"{status} with a body that is not JSON: {body[:200]!r}"
    error = payload.get("error") if isinstance(payload, dict) else None
    if not isinstance(error, dict) or set(error) != ERROR_FIELDS or set(payload) != {"error"}:
        return f"{status} with a body that is not an OpenAI error: {payload!r:.300}"
    if not isinstance(error["message"], str) or not error["message"] or not isinstance(error["type"], str):
        return f"{status} with an empty message or a type that is not a string: {error!r:.300}"
    return None


def sse_problem(body: bytes) -> str | None:
    """Why a 200 event stream is not `data: {json}` events ending in `data: [DONE]` (None: it is); an error
    event must be an OpenAI error body."""
    events = [event for event in body.decode("utf-8").split("\n\n") if event]
    if not events or events[-1] != "data: [DONE]" or not all(event.startswith("data: ") for event in events):
        return f"malformed SSE stream: {body[:300]!r}"
    for event in events[:-1]:
        payload = json.loads(event[len("data: "):])
        if "error" in payload:
            return openai_error_problem(400, "application/json", json.dumps(payload).encode())
        if not isinstance(payload.get("choices"), list):
            return f"an SSE event without choices: {payload!r:.300}"
    return None


@dataclass
class FuzzTally:
    """Counts of one fuzz test: cases, answers by status class, 5xx and non-OpenAI error bodies (with examples)."""

    name: str
    statuses: Counter = field(default_factory=Counter)
    extra: Counter = field(default_factory=Counter)
    problems: list[str] = field(default_factory=list)

    def record(self, status: int, content_type: str, body: bytes, what: str = "") -> str | None:
        """Count one answer; returns the problem with it, if any (also kept for the summary)."""
        self.statuses[status] += 1
        problem = None
        if status >= 500:
            problem = f"{status} for {what}: {body[:300]!r}"
        elif status >= 400:
            problem = openai_error_problem(status, content_type, body)
        if problem is not None:
            self.problems.append(problem)
        return problem

    def summary(self) -> dict:
        classes = Counter(f"{status // 100}xx" for status in self.elements())
        return {"fuzz": self.name, "cases": sum(self.statuses.values()), "2xx": classes["2xx"],
                "4xx": classes["4xx"], "5xx": classes["5xx"], "non_openai_errors": len(self.problems) - classes["5xx"],
                "statuses": dict(sorted(self.statuses.items())), **dict(self.extra)}

    def elements(self) -> list[int]:
        return list(self.statuses.elements())

    def report(self) -> str:
        """The one JSON line each fuzz test prints (visible with -s), then the first problems."""
        line = json.dumps(self.summary())
        print(line)
        return line + "".join(f"\n  {problem}" for problem in self.problems[:5])


@dataclass
class RawAnswer:
    status: int
    content_type: str
    body: bytes
    reached_disconnect: bool  # the app asked for more after the client was gone


async def send_raw(app, path: str, pieces: list[bytes], headers: dict[str, str], delay_s: float = 0.0,
                   end: str = "finish", timeout_s: float = 10.0) -> RawAnswer:
    """POST `pieces` as separate ASGI receive messages, `delay_s` apart. `end`: "finish" (the last piece ends the
    body), "hang_up" (the client disconnects instead) or "stall" (it neither sends more nor leaves). Status 0: the
    app sent nothing."""
    more = end != "finish"
    queue = [{"type": "http.request", "body": piece, "more_body": more or i < len(pieces) - 1}
             for i, piece in enumerate(pieces)] or [{"type": "http.request", "body": b"", "more_body": more}]
    sent: list[dict] = []
    finished, forever = asyncio.Event(), asyncio.Event()
    disconnected = False

    async def receive() -> dict:
        nonlocal disconnected
        if queue:
            if delay_s:
                await asyncio.sleep(delay_s)
            return queue.pop(0)
        if end == "hang_up":
            disconnected = True
            return {"type": "http.disconnect"}
        await (forever if end == "stall" else finished).wait()  # a complete request: the client waits for the answer
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        sent.append(message)
        if message["type"] == "http.response.body" and not message.get("more_body"):
            finished.set()

    scope = http_scope("POST", path, headers, "2.3")
    await asyncio.wait_for(app(scope, receive, send), timeout_s)
    start = next((m for m in sent if m["type"] == "http.response.start"), None)
    if start is None:
        return RawAnswer(0, "", b"", disconnected)
    content_type = dict(start.get("headers", [])).get(b"content-type", b"").decode("latin-1")
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return RawAnswer(start["status"], content_type, body, disconnected)
