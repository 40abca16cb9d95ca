"""The engine over a real C = 2 CP group (local Ray + gloo, one group for the module): lossless speculation
with CP prefill and chunked prefill, continuous batching with preemption, pages back to the start count."""

import asyncio

import pytest
import ray

from cluster.config import ResolvedCPConfig
from cluster.engine_setup import engine_over_workers, run_all
from cluster.engine_spec import EngineOptions, resolve_engine_spec
from cluster.launch import engine_cpus, launch_group, start_ray
from cp_router.engine import GenerationEngine
from model_workers.checkpoint.model_dir import load_model_config, read_model_spec, resolve_model_dir
from model_workers.spec import RankSpec
from support.engines import local_engine, make_requests

CP = ResolvedCPConfig(enabled=True, cp_size=2, strategy="zigzag", impl="legacy")
NUM_PAGES, PAGE_SIZE, BUDGET = 96, 8, 24


class Group:
    def __init__(self, folder):
        self.launched = launch_group(folder, CP, "float32", NUM_PAGES, PAGE_SIZE)
        self.folder = folder

    def engine(self, folder, k: int, num_pages: int = NUM_PAGES, cp_min: int = 0) -> GenerationEngine:
        """An engine over the group's workers (checkpoint reloaded when another is asked); its scheduler may
        use fewer pages than the ranks' caches hold."""
        if folder != self.folder:
            rank = RankSpec(read_model_spec(folder), "float32", NUM_PAGES, PAGE_SIZE)
            ray.get([w.load.remote(rank) for w in self.launched.workers])
            self.folder = folder
        options = EngineOptions(num_speculative_steps=k, num_pages=num_pages, page_size=PAGE_SIZE,
                                prefill_token_budget=BUDGET, cp_min_prefill_tokens=cp_min)
        return engine_over_workers(resolve_engine_spec(folder, CP, options), self.launched.workers)

    def held(self) -> list[list[str]]:
        """The requests whose state each rank still keeps."""
        return ray.get([w.held_requests.remote() for w in self.launched.workers])


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
        assert engine.free_pages == [NUM_PAGES, NUM_PAGES]
        asyncio.run(engine.drain())
        assert group.held() == [[], []]
    alone = run_all(local_engine(models[model], EngineOptions(num_pages=64, page_size=PAGE_SIZE)), requests)
    assert [r["token_ids"] for r in plain] == [r["token_ids"] for r in alone]  # CP prefill: same tokens as C = 1


def test_short_prompts_prefilled_by_their_owners_side_by_side_keep_every_token(group, models):
    folder = models["default"]
    requests = make_requests([2, 5, 3, 6, 4, 3], 8, 6000, prompt_seed=9, temperature=0.0,  # 23 tokens: one batch
                             ignore_eos=True)
    lone = local_engine(folder, EngineOptions(num_pages=64, page_size=PAGE_SIZE))
    alone = [run_all(lone, [req])[0]["token_ids"] for req in requests]
    engine = group.engine(folder, 2, cp_min=10_000)
    placements = []
    engine.step_observers.append(lambda step, _: step.prefill and placements.append((step.prefill.cp,
                                                                                      step.prefill.ranks)))
    assert [r["token_ids"] for r in run_all(engine, requests)] == alone
    assert placements and all(not cp for cp, _ in placements) and (False, (0, 1)) in placements
    assert engine.free_pages == [NUM_PAGES, NUM_PAGES]
    asyncio.run(engine.drain())
    assert group.held() == [[], []]


@pytest.mark.parametrize("cp_min", [0, 10_000])  # 10_000: every whole prompt is prefilled by its owner alone
def test_concurrent_requests_with_preemption_on_cp2(group, models, cp_min):
    folder = models["default"]
    lens = [1 + (i * 29) % 70 for i in range(24)]
    requests = make_requests(lens, [3 + i % 6 for i in range(24)], 6000, prompt_seed=8, temperature=0.0,
                             ignore_eos=True)
    lone = local_engine(folder, EngineOptions(num_pages=64, page_size=PAGE_SIZE))
    alone = [run_all(lone, [req])[0]["token_ids"] for req in requests]
    engine = group.engine(folder, 2, num_pages=12, cp_min=cp_min)  # 96 token slots per rank: preemption
    placements = []
    engine.step_observers.append(lambda step, _: step.prefill and placements.append((step.prefill.cp,
                                                                                      step.prefill.ranks)))
    assert [r["token_ids"] for r in run_all(engine, requests)] == alone
    assert engine.stats.preemptions > 0 and not engine.scheduler.requests
    assert any(not cp for cp, _ in placements) if cp_min else all(cp for cp, ranks in placements if len(ranks) > 1)
    assert any(cp for cp, _ in placements)  # chunked prompts still run across the group
    assert engine.free_pages == [12, 12]
    asyncio.run(engine.drain())
    assert group.held() == [[], []]
