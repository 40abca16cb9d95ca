"""The mixed load of `python -m benchmarks soak`: OpenAI-style requests of many kinds over loopback HTTP.

`--concurrency` closed-loop clients share one httpx client; each picks a kind at random (seeded, weights in
`KINDS`) and sends it, back to back, until the phase's deadline. Good requests vary everything a client may:
completions and chat completions, streamed or not, short prompts or long ones (1000-2000 tokens), max_tokens
8-200, n of 1-3, logprobs, greedy or seeded sampling. Misbehaving clients: `disconnect` closes its stream after
1-4 chunks, `timeout` gives up on a whole-body request after 0.1-1 s (both close their connection), `bad_request`
sends one of `BAD_BODIES` (must get a 4xx with an OpenAI error body). Every request ends in one outcome; the
ones in `FAILURES` fail the soak.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections import Counter
from dataclasses import dataclass, field

import httpx

from cluster.bench.common import PROMPTS
from cluster.bench.load import sse_payload

KINDS = {"completion": 3, "completion_stream": 3, "chat": 2, "chat_stream": 3, "long_prompt": 1,
         "disconnect": 2, "timeout": 1, "bad_request": 1}
FAILURES = ("http_5xx", "http_4xx", "stream_error", "malformed", "accepted_bad_request", "transport_error")
REQUEST_TIMEOUT_S = 300.0  # a good request taking longer than this is a hung server (transport_error)
LONG_TOKENS = (1000, 2000)
MAX_NOTES = 20


def bad_bodies(max_model_len: int) -> list[tuple[str, str, bytes]]:
    """(name, path, raw body) of requests a server must refuse with a 4xx."""
    def body(**fields) -> bytes:
        return json.dumps(fields).encode()

    completions, chat = "/v1/completions", "/v1/chat/completions"
    return [("truncated_json", completions, b'{"prompt": "def f(", "max_tokens": 1'),
            ("not_an_object", completions, b"[1, 2, 3]"),
            ("negative_max_tokens", completions, body(prompt="x", max_tokens=-5)),
            ("unknown_model", completions, body(model="no-such-model", prompt="x", max_tokens=4)),
            ("n_zero", completions, body(prompt="x", max_tokens=4, n=0)),
            ("temperature_string", completions, body(prompt="x", max_tokens=4, temperature="hot")),
            ("too_many_logprobs", completions, body(prompt="x", max_tokens=4, logprobs=1000)),
            ("no_prompt", completions, body(max_tokens=4)),
            ("prompt_too_long", completions, body(prompt=[7] * (max_model_len + 1), max_tokens=1)),
            ("empty_messages", chat, body(messages=[], max_tokens=4)),
            ("bad_role", chat, body(messages=[{"role": "robot", "content": "hi"}], max_tokens=4))]


@dataclass
class LoadContext:
    """What every client shares: the server, the long prompt's token ids, the bad bodies, the tallies."""

    client: httpx.AsyncClient
    url: str
    long_ids: list[int]  # >= LONG_TOKENS[1] token ids of code text (from the server's /tokenize)
    long_text: str
    bad: list[tuple[str, str, bytes]]
    outcomes: Counter = field(default_factory=Counter)  # (kind, outcome) -> requests
    bad_seen: Counter = field(default_factory=Counter)  # bad body name -> requests answered 4xx
    notes: Counter = field(default_factory=Counter)  # "kind outcome: detail" of failures (MAX_NOTES kept)

    def note(self, kind: str, outcome: str, detail: str) -> str:
        """Keeps what went wrong (a few distinct lines); returns `outcome`."""
        line = f"{kind} {outcome}: {detail}"[:300]
        if line in self.notes or len(self.notes) < MAX_NOTES:
            self.notes[line] += 1
        return outcome


def sampling(rng: random.Random) -> dict:
    """Greedy half the time, else seeded sampling (some with top_p)."""
    if rng.random() < 0.5:
        return {"temperature": 0}
    return {"temperature": 0.8, "seed": rng.randrange(1 << 31), **({"top_p": 0.9} if rng.random() < 0.5 else {})}


def good_body(kind: str, rng: random.Random, ctx: LoadContext) -> tuple[str, dict]:
    """(path, body) of a valid request of `kind` (completion*, chat*, long_prompt, disconnect, timeout)."""
    chat = kind.startswith("chat") or (kind in ("long_prompt", "disconnect") and rng.random() < 0.5)
    stream = kind.endswith("stream") or kind == "disconnect" or (kind == "long_prompt" and rng.random() < 0.5)
    n = rng.choice((1, 1, 1, 2, 3))
    body = {"max_tokens": rng.randint(150, 200) if kind == "timeout" else rng.randint(8, 200), "n": n,
            "stream": stream, **sampling(rng)}
    if stream:
        body["stream_options"] = {"include_usage": True}
    long = kind == "long_prompt"
    length = rng.randint(*LONG_TOKENS)
    if chat:
        text = ctx.long_text[:len(ctx.long_text) * length // LONG_TOKENS[1]] if long else rng.choice(PROMPTS)
        body["messages"] = [{"role": "user", "content": text}]
        if rng.random() < 0.3:
            body.update(logprobs=True, top_logprobs=2)
        return "/v1/chat/completions", body
    body["prompt"] = ctx.long_ids[:length] if long else rng.choice(PROMPTS)
    if rng.random() < 0.3:
        body["logprobs"] = 2
    return "/v1/completions", body


def check_whole(body: dict, answer: dict) -> str:
    """ok, or malformed: n choices, each finished, logprobs where asked, usage present."""
    choices = answer.get("choices") or []
    wanted_logprobs = body.get("logprobs") not in (None, False)
    if len(choices) != body["n"] or "usage" not in answer:
        return "malformed"
    for choice in choices:
        if choice.get("finish_reason") is None or (wanted_logprobs and choice.get("logprobs") is None):
            return "malformed"
    return "ok"


async def send_whole(ctx: LoadContext, kind: str, path: str, body: dict, timeout_s: float) -> str:
    response = await ctx.client.post(ctx.url + path, json=body, timeout=timeout_s)
    if response.status_code != 200:
        return ctx.note(kind, status_outcome(response.status_code), f"{response.status_code} {response.text[:200]}")
    outcome = check_whole(body, response.json())
    return outcome if outcome == "ok" else ctx.note(kind, outcome, response.text[:200])


async def send_stream(ctx: LoadContext, kind: str, path: str, body: dict, stop_after_chunks: int | None) -> str:
    """Reads the SSE stream to [DONE] (or closes it after `stop_after_chunks` chunks: disconnected)."""
    finished, chunks = set(), 0
    async with ctx.client.stream("POST", ctx.url + path, json=body, timeout=REQUEST_TIMEOUT_S) as response:
        if response.status_code != 200:
            text = (await response.aread()).decode(errors="replace")[:200]
            return ctx.note(kind, status_outcome(response.status_code), f"{response.status_code} {text}")
        async for line in response.aiter_lines():
            payload = sse_payload(line)
            if payload is None:
                continue
            if payload == "[DONE]":
                return "ok" if len(finished) == body["n"] else ctx.note(kind, "malformed", f"finished {finished}")
            event = json.loads(payload)
            if "error" in event:
                return ctx.note(kind, "stream_error", json.dumps(event["error"]))
            for choice in event.get("choices") or []:
                chunks += 1
                if choice.get("finish_reason") is not None:
                    finished.add(choice["index"])
            if stop_after_chunks is not None and chunks >= stop_after_chunks:
                return "disconnected"  # leaving the block closes the connection mid-stream
    return ctx.note(kind, "malformed", "the stream ended without [DONE]")


def status_outcome(status: int) -> str:
    return "http_5xx" if status >= 500 else "http_4xx"


async def send_bad(ctx: LoadContext, rng: random.Random) -> str:
    """One bad body: rejected (4xx with {"error": {"message": ...}}), else a failure outcome."""
    name, path, raw = rng.choice(ctx.bad)
    response = await ctx.client.post(ctx.url + path, content=raw, headers={"content-type": "application/json"},
                                     timeout=REQUEST_TIMEOUT_S)
    if response.status_code >= 500 or response.status_code < 400:
        outcome = "http_5xx" if response.status_code >= 500 else "accepted_bad_request"
        return ctx.note("bad_request", outcome, f"{name}: {response.status_code} {response.text[:200]}")
    try:
        error = response.json()["error"]
        ok = isinstance(error, dict) and isinstance(error.get("message"), str)
    except (ValueError, KeyError, TypeError):
        ok = False
    if ok:
        ctx.bad_seen[name] += 1
    return "rejected" if ok else ctx.note("bad_request", "malformed", f"{name}: {response.text[:200]}")


async def send_one(ctx: LoadContext, kind: str, rng: random.Random) -> str:
    """One request of `kind`; its outcome."""
    try:
        if kind == "bad_request":
            return await send_bad(ctx, rng)
        path, body = good_body(kind, rng, ctx)
        if kind == "timeout":
            try:
                return await send_whole(ctx, kind, path, body, rng.uniform(0.1, 1.0))
            except httpx.TimeoutException:
                return "timed_out"
        if body["stream"]:
            return await send_stream(ctx, kind, path, body, rng.randint(1, 4) if kind == "disconnect" else None)
        return await send_whole(ctx, kind, path, body, REQUEST_TIMEOUT_S)
    except (httpx.HTTPError, ValueError) as exc:  # connection failures, hung requests, undecodable bodies
        return ctx.note(kind, "transport_error", f"{type(exc).__name__}: {exc}")


async def run_clients(ctx: LoadContext, concurrency: int, duration_s: float, seed: int) -> int:
    """`concurrency` clients sending random kinds back to back for `duration_s`; requests sent."""
    deadline, kinds, weights = time.monotonic() + duration_s, list(KINDS), list(KINDS.values())
    sent = 0

    async def client(index: int) -> None:
        nonlocal sent
        rng = random.Random(seed * 1000 + index)
        while time.monotonic() < deadline:
            kind = rng.choices(kinds, weights)[0]
            ctx.outcomes[(kind, await send_one(ctx, kind, rng))] += 1
            sent += 1

    await asyncio.gather(*[client(i) for i in range(concurrency)])
    return sent


def tally(outcomes: Counter) -> dict:
    """Requests by kind and outcome, totals by outcome, and the failure count."""
    by_kind: dict[str, dict[str, int]] = {}
    for (kind, outcome), count in sorted(outcomes.items()):
        if count:
            by_kind.setdefault(kind, {})[outcome] = count
    by_outcome = Counter()
    for (_, outcome), count in outcomes.items():
        by_outcome[outcome] += count
    return {"total": sum(by_outcome.values()), "by_outcome": dict(sorted(by_outcome.items())), "by_kind": by_kind,
            "failures": sum(by_outcome[name] for name in FAILURES), "http_5xx": by_outcome["http_5xx"]}
