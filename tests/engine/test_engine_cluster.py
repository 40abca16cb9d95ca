"""The engine over a real C = 2 CP group (local Ray + gloo, one group for the module): lossless speculation
with CP prefill and chunked prefill, continuous batching with preemption, pages back to the start count."""

import pytest
import ray
from support.engines import local_engine, make_requests

from cluster.config import ResolvedCPConfig
from cp_router.engine import DSAEngine
from cluster.engine_setup import EngineOptions, run_all, scheduler_for
from cp_router.protocol import ModelInfo
from cluster.launch import engine_cpus, launch_engine, start_ray
from model_workers.checkpoint.model_dir import resolve_model_dir
from model_workers.model.config import load_model_config
from model_workers.checkpoint.tokenizer import load_tokenizer

CP = ResolvedCPConfig(enabled=True, cp_size=2, strategy="zigzag", impl="legacy")
NUM_PAGES, PAGE_SIZE, BUDGET = 96, 8, 24


class Group:
    def __init__(self, folder):
        self.launched = launch_engine(folder, CP, "float32", NUM_PAGES, PAGE_SIZE)
        self.folder = folder

    def engine(self, folder, k: int, num_pages: int = NUM_PAGES) -> DSAEngine:
        """An engine over the group's workers (checkpoint reloaded when another is asked)."""
        if folder != self.folder:
            ray.get([w.load.remote(str(folder), "float32", NUM_PAGES, PAGE_SIZE) for w in self.launched.workers])
            self.folder = folder
        options = EngineOptions(num_speculative_steps=k, num_pages=num_pages, page_size=PAGE_SIZE,
                                prefill_token_budget=BUDGET)
        config = load_model_config(folder)
        info = ModelInfo("test", config.vocab_size, config.max_position_embeddings, False)
        return DSAEngine(self.launched.workers, scheduler_for(CP, options, config.eos_token_ids),
                         load_tokenizer(folder), info)

    def free_pages(self) -> list[int]:
        return ray.get([w.free_pages.remote() for w in self.launched.workers])


@pytest.fixture(scope="module")
def models(reference_checkpoint):
    return {"random_mtp": reference_checkpoint("v32", mtp=True)[1], "default": resolve_model_dir(None)}


@pytest.fixture(scope="module")
def group(models):
    start_ray(min_cpus=engine_cpus(CP.cp_size))
    group = Group(models["random_mtp"])
    yield group
    group.launched.shutdown()
    ray.shutdown()


@pytest.mark.parametrize("model", ["random_mtp", "default"])
def test_greedy_speculation_equals_plain_decoding_on_cp2(group, models, model):
    vocab = load_model_config(models[model]).vocab_size
    requests = make_requests([3, 17, 50], 10, vocab, prompt_seed=7, temperature=0.0, ignore_eos=True)
    plain = run_all(group.engine(models[model], 0), requests)
    for k in (1, 2, 3):
        engine = group.engine(models[model], k)
        assert run_all(engine, requests) == plain, f"k={k}"
        assert engine.stats.drafted > 0 and engine.stats.accepted < engine.stats.drafted
        if model == "default":
            assert engine.stats.accepted > 0
    assert group.free_pages() == [NUM_PAGES, NUM_PAGES]
    alone = run_all(local_engine(models[model], EngineOptions(num_pages=64, page_size=PAGE_SIZE)), requests)
    assert [r["token_ids"] for r in plain] == [r["token_ids"] for r in alone]  # CP prefill: same tokens as C = 1


def test_concurrent_requests_with_preemption_on_cp2(group, models):
    folder = models["default"]
    lens = [1 + (i * 29) % 70 for i in range(24)]
    requests = make_requests(lens, [3 + i % 6 for i in range(24)], 6000, prompt_seed=8, temperature=0.0,
                             ignore_eos=True)
    lone = local_engine(folder, EngineOptions(num_pages=64, page_size=PAGE_SIZE))
    alone = [run_all(lone, [req])[0]["token_ids"] for req in requests]
    engine = group.engine(folder, 2, num_pages=12)  # 96 token slots per rank: preemption
    assert [r["token_ids"] for r in run_all(engine, requests)] == alone
    assert engine.stats.preemptions > 0 and not engine.scheduler.sequences
    assert group.free_pages() == [NUM_PAGES, NUM_PAGES]
