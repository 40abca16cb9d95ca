"""Disaggregation on Ray Serve: the app of cluster/serve_app.py with --pd-disaggregation on a local Ray (CPU, the
default model, deterministic inference, MTP k = 2): a DSAPrefill replica of C = 2 ranks prefills (CP) and hands off
to a DSAEngine decode replica of D = 1 rank. Over HTTP every request's tokens and logprobs, streamed or not, are
bit-identical to a colocated C = 1 engine's in this process; a prompt below pd_min_prefill_tokens is prefilled by
the decode group itself; the ingress and both kinds of replica report on /metrics."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from cluster.engine_spec import EngineOptions
from cp_router.protocol import EngineRequest
from model_workers.checkpoint.model_dir import resolve_model_dir
from support.engines import local_engine
from support.serve_process import serve_app_in_process

pytestmark = pytest.mark.slow  # Ray groups / a Serve app on a local Ray: `make test-slow`
SETTINGS = dict(cp_size=2, engine_placement="separate", pd_disaggregation=True, prefill_cp_size=2, decode_dp_size=1,
                enable_deterministic_inference=True, speculative_num_steps=2, dtype="bfloat16", page_size=32,
                num_kv_pages=96, pd_min_prefill_tokens=8)
PROMPTS = [[(17 * i + 5 * j) % 6000 + 3 for j in range(n)] for i, n in enumerate([300, 75, 40, 5])]


@pytest.fixture(scope="module")
def base_url():
    with serve_app_in_process(SETTINGS, num_cpus=6) as url:
        yield url


def colocated() -> dict[int, tuple]:
    """(tokens, logprobs) per prompt from one C = 1 engine with the app's settings, all prompts at once."""
    engine = local_engine(resolve_model_dir(None), EngineOptions(
        dtype="bfloat16", page_size=32, num_pages=96, deterministic=True, num_speculative_steps=2))

    async def one(i, prompt):
        request = EngineRequest(f"c{i}", tuple(prompt), 10, temperature=0.0 if i % 2 else 0.8, seed=i, logprobs=1,
                                ignore_eos=True)
        chunks = [c async for c in engine.generate(request)]
        return "".join(c.text for c in chunks), [lp.logprob for c in chunks for lp in c.logprobs]

    async def main():
        return await asyncio.gather(*[one(i, p) for i, p in enumerate(PROMPTS)])

    return dict(enumerate(asyncio.run(main())))


def completion(base_url: str, i: int, stream: bool) -> tuple[str, list[float]]:
    """(text, token logprobs) of prompt i over HTTP, whole or streamed."""
    body = {"model": "default_model", "prompt": PROMPTS[i], "max_tokens": 10, "temperature": 0.0 if i % 2 else 0.8,
            "seed": i, "logprobs": 1, "ignore_eos": True, "stream": stream}
    with httpx.Client(base_url=base_url, timeout=300) as client:
        if not stream:
            response = client.post("/v1/completions", json=body)
            assert response.status_code == 200, response.text
            choice = response.json()["choices"][0]
            return choice["text"], choice["logprobs"]["token_logprobs"]
        text, logprobs = "", []
        with client.stream("POST", "/v1/completions", json=body) as response:
            for line in response.iter_lines():
                if line.startswith("data: {"):
                    choice = json.loads(line[6:])["choices"][0]
                    text += choice["text"]
                    logprobs += (choice.get("logprobs") or {}).get("token_logprobs") or []
        return text, logprobs


def test_pd_over_serve_is_bit_identical_to_colocated(base_url):
    expected = colocated()
    for stream in (False, True):
        for i in range(len(PROMPTS)):
            assert completion(base_url, i, stream) == expected[i], (i, stream)
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for family in text_string_to_metric_families(httpx.get(f"{base_url}/metrics").text)
               for s in family.samples}
    handoffs = sum(v for (name, _), v in samples.items() if name == "dsa_serve:pd_handoffs_total")
    assert handoffs == 2 * 3  # prompt 3 (5 tokens) is prefilled by its decode group: below pd_min_prefill_tokens
    assert sum(v for (name, _), v in samples.items() if name == "dsa_serve:pd_handoff_bytes_total") > 0
    prefill_ranks = {labels for (name, labels), _ in samples.items() if name == "dsa_serve:kv_pages_total"}
    assert len(prefill_ranks) == 3  # the decode replica's rank and the prefill replica's two
