"""The FP8 KV cache in the served engine (C = 1, in process): greedy speculation equals plain decoding with the
same cache, preemption and chunked prefill on FP8 pages change no token, and bad format choices fail at the edge."""

import pytest

from cluster.engine_setup import run_all, start_local_engine
from cluster.engine_spec import EngineOptions
from model_workers.checkpoint.model_dir import resolve_model_dir
from support.engines import local_engine, make_requests

PAGE_SIZE = 8
FP8 = "fp8_e4m3"


def options(k: int = 0, num_pages: int = 128, **kwargs) -> EngineOptions:
    return EngineOptions(num_speculative_steps=k, num_pages=num_pages, page_size=PAGE_SIZE, prefill_token_budget=32,
                         kv_cache_dtype=FP8, **kwargs)


@pytest.fixture(scope="module")
def models(reference_checkpoint):
    return {"random_mtp": reference_checkpoint("v32", mtp=True)[1], "default": resolve_model_dir(None)}


@pytest.mark.parametrize("model", ["random_mtp", "default"])
def test_greedy_speculation_with_fp8_equals_plain_decoding_with_fp8(models, model):
    requests = make_requests([3, 17, 45], 14, 120, prompt_seed=1, temperature=0.0, ignore_eos=True)
    engine = local_engine(models[model], options(0))
    assert engine.workers[0].worker.runner.cache.latent[0].dtype.itemsize == 1  # the cache really holds FP8 bytes
    plain = run_all(engine, requests)
    for k in (1, 3):
        engine = local_engine(models[model], options(k))
        assert run_all(engine, requests) == plain, f"k={k}"
        assert engine.stats.drafted > 0 and engine.stats.accepted < engine.stats.drafted  # rollbacks happened
        assert engine.free_pages == [128]


def test_preemption_on_fp8_pages_changes_no_token(models):
    lens = [1 + (i * 37) % 60 for i in range(16)]  # chunked prefills (budget 32) among them
    requests = make_requests(lens, [4 + i % 6 for i in range(16)], 6000, prompt_seed=2, temperature=0.0,
                             ignore_eos=True)
    lone = local_engine(models["default"], options(0))
    alone = [run_all(lone, [req])[0]["token_ids"] for req in requests]
    small = local_engine(models["default"], options(2, num_pages=12))  # 96 token slots: forces preemption
    assert [r["token_ids"] for r in run_all(small, requests)] == alone
    assert small.stats.preemptions > 0 and small.free_pages == [12]


def test_fp8_for_deepseek_v4_fails_before_any_worker_starts(tmp_path):
    from support.v4_checkpoints import v4_checkpoint_with_mtp

    _, _, folder = v4_checkpoint_with_mtp(tmp_path)
    with pytest.raises(ValueError, match="kv_cache_dtype='fp8_e4m3' is not available for deepseek_v4 yet; "
                                         "allowed values: auto, bfloat16"):
        start_local_engine(folder, options(0))


def test_unknown_kv_cache_dtype_is_refused_with_the_allowed_values():
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of auto, bfloat16, fp8_e4m3, got 'int8'"):
        EngineOptions(kv_cache_dtype="int8")
