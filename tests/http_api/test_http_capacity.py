"""Capacity and context: the window `/v1/models` reports is what one request can hold, requests past it get
400 context_length_exceeded, and every request inside it runs — a sweep across every boundary, no 5xx."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from cluster import cli
from cluster.engine_limits import EngineLimits, resolve_limits
from cluster.engine_spec import EngineOptions
from cluster.http_api.ingress import build_app
from cluster.http_api.openai_requests import COMPLETIONS_DEFAULT_MAX_TOKENS as DEFAULT_MAX_TOKENS
from cluster.serve_settings import IngressSettings
from model_workers.checkpoint.model_dir import resolve_model_dir
from support.engines import local_engine

PAGES, PAGE_SIZE, K = 4, 8, 2  # 32 slots per rank; a speculative step writes k + 1 = 3 past the last token
ROOM = PAGES * PAGE_SIZE - K - 1  # 29


def test_the_window_is_the_smaller_of_the_model_and_the_kv_room():
    assert resolve_limits(EngineLimits(), 32768, 1280, 0).max_model_len == 256 * 64 - 1  # 16,383: the KV decides
    assert resolve_limits(EngineLimits(num_kv_pages=1024), 32768, 1280, 2).max_model_len == 32768  # the model decides
    assert resolve_limits(EngineLimits(max_model_len=1000), 32768, 1280, 0).max_model_len == 1000
    budget = resolve_limits(EngineLimits(kv_cache_memory_gib=1.0, page_size=16), 32768, 840, 0)
    assert budget.num_pages == 2**30 // (16 * 840) and budget.page_size == 16


@pytest.mark.parametrize("limits, message", [
    (dict(max_model_len=40000), "--max-model-len 40000 exceeds the model's window"),
    (dict(max_model_len=20000), "one request then needs 313 pages of 64 tokens, a rank has 256"),
    (dict(num_kv_pages=8, kv_cache_memory_gib=1.0), "give one of them"),
    (dict(kv_cache_memory_gib=1e-9), "holds no page of 64 tokens"),
])
def test_limits_that_cannot_hold_together_fail_with_the_numbers(limits, message):
    with pytest.raises(ValueError, match=message):
        resolve_limits(EngineLimits(**limits), 32768, 1280, 0)


def test_serve_flags_reach_the_serve_args():
    from cluster.commands.serve import app_args

    parser = cli.build_parser()
    args = parser.parse_args(["serve", "--max-model-len", "1000", "--num-kv-pages", "32", "--page-size", "16",
                              "--max-num-seqs", "8", "--max-num-batched-tokens", "512", "--max-queued-requests", "9"])
    settings = app_args(args)
    assert (settings.max_model_len, settings.num_kv_pages, settings.page_size) == (1000, 32, 16)
    assert (settings.max_num_seqs, settings.max_num_batched_tokens, settings.max_queued_requests) == (8, 512, 9)


def test_cp_min_prefill_tokens_reaches_the_scheduler_from_the_flag_and_the_yaml():
    from cluster.commands.serve import app_args
    from cluster.config import ResolvedCPConfig
    from cluster.engine_spec import scheduler_for
    from cluster.replica_engine import engine_options
    from cluster.serve_app import validate_args
    from model_workers.checkpoint.model_dir import resolve_model_dir

    model_dir, cp = resolve_model_dir(None), ResolvedCPConfig(enabled=True, cp_size=2, strategy="zigzag", impl="legacy")
    flagged = app_args(cli.build_parser().parse_args(["serve", "--cp-min-prefill-tokens", "0"]))
    from_yaml = validate_args({"cp_min_prefill_tokens": 96})
    for settings, expected in [(flagged, 0), (from_yaml, 96), (validate_args({}), 512)]:
        assert scheduler_for(cp, engine_options(settings, model_dir)).config.cp_min_prefill_tokens == expected
    with pytest.raises(ValueError, match="cp_min_prefill_tokens"):
        validate_args({"cp_min_prefill_tokens": -1})


def test_the_prefill_chunk_is_2048_tokens_per_cp_rank_unless_set():
    from cluster.commands.serve import app_args
    from cluster.config import ResolvedCPConfig
    from cluster.engine_spec import scheduler_for
    from cluster.replica_engine import engine_options
    from cluster.serve_app import validate_args

    model_dir = resolve_model_dir(None)
    flagged = app_args(cli.build_parser().parse_args(["serve", "--max-num-batched-tokens", "1024"]))
    for cp_size in (1, 2, 3):
        cp = ResolvedCPConfig(enabled=cp_size > 1, cp_size=cp_size, strategy="zigzag" if cp_size > 1 else None,
                              impl="legacy")
        chunk = {name: scheduler_for(cp, engine_options(settings, model_dir)).config.prefill_token_budget
                 for name, settings in [("default", validate_args({})), ("flag", flagged),
                                        ("yaml", validate_args({"max_num_batched_tokens": 640}))]}
        assert chunk == {"default": 2048 * cp_size, "flag": 1024, "yaml": 640}
    assert scheduler_for(ResolvedCPConfig(enabled=False, cp_size=1, strategy=None, impl="legacy"),
                         EngineOptions()).config.prefill_token_budget == 2048


async def sweep(app, cases: list[tuple[int, int | None]]) -> list[tuple[int, int | None, int, dict]]:
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test", timeout=60) as client:
        window = (await client.get("/v1/models")).json()["data"][0]["max_model_len"]
        assert window == ROOM
        out = []
        for prompt_len, max_tokens in cases:
            body = {"prompt": [1 + i % 500 for i in range(prompt_len)], "temperature": 0, "ignore_eos": True}
            if max_tokens is not None:
                body["max_tokens"] = max_tokens
            response = await client.post("/v1/completions", json=body)
            out.append((prompt_len, max_tokens, response.status_code, response.json()))
        return out


def test_boundary_sweep_never_fails_a_request_that_passed_validation():
    options = EngineOptions(num_pages=PAGES, page_size=PAGE_SIZE, num_speculative_steps=K, prefill_token_budget=16)
    engine = local_engine(resolve_model_dir(None), options)
    app = build_app(engine, IngressSettings(model_dir=str(resolve_model_dir(None))))
    lengths = [1, 2, 15, 16, 17, ROOM - 2, ROOM - 1, ROOM, ROOM + 1, 40, 17000]
    cases = [(n, m) for n in lengths for m in (None, 1, ROOM - n, ROOM - n + 1) if m is None or m >= 1]
    for prompt_len, max_tokens, status, body in asyncio.run(sweep(app, cases)):
        want = DEFAULT_MAX_TOKENS if max_tokens is None else max_tokens  # OpenAI's default for completions
        if prompt_len + want <= ROOM:
            assert status == 200, (prompt_len, max_tokens, body)
            assert body["usage"]["completion_tokens"] == want and body["choices"][0]["finish_reason"] == "length"
        else:
            assert status == 400 and body["error"]["code"] == "context_length_exceeded", (prompt_len, max_tokens)
            assert f"maximum context length is {ROOM} tokens" in body["error"]["message"]
    assert engine.free_pages == [PAGES]
