"""Prefix caching seen from a client (the official `openai` client over the real app and a C = 1 engine on the
default model): `usage.prompt_tokens_details.cached_tokens` in completions and chat, whole and in the streamed
usage chunk; the prefix_cache metrics; POST /flush_cache and /reset_prefix_cache; nothing cached when disabled."""

from __future__ import annotations

import asyncio
import re

import httpx
import openai

from cluster.engine_setup import start_local_engine
from cluster.engine_spec import EngineOptions
from cluster.http_api.ingress import build_app
from cluster.serve_settings import IngressSettings
from cp_router.metrics import ServeMetrics
from model_workers.checkpoint.model_dir import resolve_model_dir

MODEL = resolve_model_dir(None)
DOC = list(range(300, 500))  # 200 token ids: three full pages of 64
SYSTEM = "You are a careful assistant. " * 40


def app_and_engine(caching: bool):
    engine = start_local_engine(MODEL, EngineOptions("float32", num_pages=64, page_size=64,
                                                     enable_prefix_caching=caching),
                                metrics=ServeMetrics("engine-0", MODEL.name))
    return build_app(engine, IngressSettings(model_dir=str(MODEL))), engine


def metric(text: str, name: str) -> float:
    values = [float(m.group(1)) for m in re.finditer(rf"^dsa_serve:{name}\{{[^}}]*\}} (\S+)$", text, re.M)]
    return sum(values)


async def scenario(caching: bool) -> dict:
    app, _ = app_and_engine(caching)
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test", timeout=300)
    client = openai.AsyncOpenAI(api_key="x", base_url="http://test/v1", http_client=http, max_retries=0)
    model, seen = MODEL.name, {}
    first = await client.completions.create(model=model, prompt=DOC + [7, 8], max_tokens=2, temperature=0)
    again = await client.completions.create(model=model, prompt=DOC + [9], max_tokens=2, temperature=0)
    seen["completion"] = tuple(r.usage.prompt_tokens_details.cached_tokens for r in (first, again))
    stream = await client.completions.create(model=model, prompt=DOC + [11, 12], max_tokens=2, temperature=0,
                                             stream=True, stream_options={"include_usage": True})
    seen["streamed"] = [chunk.usage.prompt_tokens_details.cached_tokens async for chunk in stream if chunk.usage][-1]
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "hi"}]
    await client.chat.completions.create(model=model, messages=messages, max_tokens=2, temperature=0)
    messages[1]["content"] = "hello there"
    chat = await client.chat.completions.create(model=model, messages=messages, max_tokens=2, temperature=0)
    seen["chat"] = chat.usage.prompt_tokens_details.cached_tokens
    seen["metrics"] = (await http.get("/metrics")).text
    flushed = await http.post("/flush_cache")
    seen["flush"] = (flushed.status_code, flushed.json())
    after = await client.completions.create(model=model, prompt=DOC + [9], max_tokens=2, temperature=0)
    seen["after_flush"] = after.usage.prompt_tokens_details.cached_tokens
    seen["reset"] = (await http.post("/reset_prefix_cache")).status_code
    await http.aclose()
    return seen


def test_cached_tokens_metrics_and_flush_through_the_openai_client():
    seen = asyncio.run(scenario(caching=True))
    assert seen["completion"] == (0, 192)  # three pages of the 201-token prompt, one token left to prefill
    assert seen["streamed"] == 192 and seen["chat"] >= 128  # the long system message's pages
    text = seen["metrics"]
    assert metric(text, "prefix_cache_hits_total") >= 192 * 2 + 128
    assert metric(text, "prefix_cache_queries_total") > metric(text, "prefix_cache_hits_total")
    assert metric(text, "prefix_cache_pages") > 0
    status, body = seen["flush"]
    assert status == 200 and body["flushed_pages"] > 0
    assert seen["after_flush"] == 0 and seen["reset"] == 200


def test_with_the_cache_off_nothing_is_cached():
    seen = asyncio.run(scenario(caching=False))
    assert seen["completion"] == (0, 0) and seen["streamed"] == 0 and seen["chat"] == 0
    assert metric(seen["metrics"], "prefix_cache_hits_total") == 0
    assert seen["flush"] == (200, {"message": "Cache flushed.", "flushed_pages": 0})
