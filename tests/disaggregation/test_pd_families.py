"""Disaggregation for every family (tiny random V3.2, GLM-5 with MTP index sharing, DeepSeek-V4 with its bounded
state): greedy tokens through a prefill engine and a decode engine equal `transformers`, and what a decode rank holds
after the import equals what the prefill rank held, bit for bit, although its pages are others."""

from __future__ import annotations

import asyncio
import json
import shutil

import pytest
import torch

from cluster.engine_spec import EngineOptions
from cp_router.disaggregated import DisaggregatedEngine
from cp_router.handoff import HandoffTicket, ImportItem
from cp_router.plans import StepPlan
from cp_router.protocol import EngineRequest
from cp_router.request_stream import sampling_of
from model_workers.models.common.topk_sharing import slot_positions
from model_workers.page_table import PageTable
from support.cp_cluster import make_prompts
from support.engines import local_engine

PAGE_SIZE, NUM_PAGES = 8, 48


@pytest.fixture(scope="module")
def models(reference_checkpoint, tmp_path_factory):
    from support.v4_checkpoints import v4_checkpoint_with_mtp

    v4_target, _, v4_folder = v4_checkpoint_with_mtp(tmp_path_factory.mktemp("v4_mtp"))
    glm_ref, glm_folder = reference_checkpoint("glm_shared", mtp=True)
    shared = tmp_path_factory.mktemp("glm_mtp_share")  # GLM-5.2: the MTP layer reuses the indexer's top-k
    for path in glm_folder.iterdir():
        shutil.copy(path, shared / path.name)
    config = json.loads((shared / "config.json").read_text())
    (shared / "config.json").write_text(json.dumps({**config, "index_share_for_mtp_iteration": True}))
    return {"v32": reference_checkpoint("v32", mtp=True), "glm": (glm_ref, shared), "v4": (v4_target, v4_folder)}


def options() -> EngineOptions:
    return EngineOptions(num_speculative_steps=2, num_pages=NUM_PAGES, page_size=PAGE_SIZE)


@pytest.mark.parametrize("family", ["v32", "glm", "v4"])
def test_pd_greedy_tokens_equal_transformers(models, family):
    ref, folder = models[family]
    pd = DisaggregatedEngine(local_engine(folder, options()), local_engine(folder, options()))
    prompts = make_prompts([37, 20, 9], seed=5)
    requests = [EngineRequest(f"g{i}", tuple(p), 10, temperature=0.0, ignore_eos=True) for i, p in enumerate(prompts)]

    async def run():
        return await asyncio.gather(*[tokens_of(pd, r) for r in requests])

    for prompt, tokens in zip(prompts, asyncio.run(run())):
        expected = ref.generate(torch.tensor([prompt]), max_new_tokens=10, do_sample=False, pad_token_id=0)
        assert tokens == expected[0, len(prompt):].tolist()
    assert pd.stats["handoffs"] == 3


async def tokens_of(engine, request: EngineRequest) -> list[int]:
    return [t async for chunk in engine.generate(request) for t in chunk.token_ids]


class HeldAfterPrefill:
    """Step observer of a colocated engine: the owner's rows and draft state of a request right after its prefill."""

    def __init__(self, engine):
        self.engine, self.seen = engine, None

    def __call__(self, step, results) -> None:
        if step.prefill is None or self.seen is not None or not step.prefill.pieces[0].final:
            return
        worker, piece = self.engine.workers[0].worker, step.prefill.pieces[0]
        pages = step.plans[0].prefill.page_tables[0]
        held = worker.held[piece.request_id]
        topk = None if held.draft_topk is None else slot_positions(
            PageTable(list(pages)), held.draft_topk, PAGE_SIZE)
        self.seen = (worker.export_kv(list(pages), piece.prefix_len + piece.extend_len, piece.request_id),
                     held.draft_hidden.clone(), topk)


@pytest.mark.parametrize("family", ["v32", "glm", "v4"])
def test_imported_state_equals_the_prefill_ranks(models, family):
    _, folder = models[family]
    request = EngineRequest("s", tuple(make_prompts([29], seed=7)[0]), 3, temperature=0.0, ignore_eos=True)
    colocated = local_engine(folder, options())
    watch = HeldAfterPrefill(colocated)
    colocated.add_step_observer(watch)
    asyncio.run(tokens_of(colocated, request))
    prefill = local_engine(folder, options())

    async def ticket() -> HandoffTicket:
        return [item async for item in prefill.prefill_handoff(request)][-1]

    handed = asyncio.run(ticket())
    decode = local_engine(folder, options())
    pages = tuple(range(NUM_PAGES - 1, NUM_PAGES - 6, -1))  # other pages, in falling order
    item = ImportItem(handed.handoff, pages, sampling_of(request), handed.output_ids)
    worker = decode.workers[0].worker
    worker.step(StepPlan(imports=(item,)))
    rows, hidden, topk = watch.seen
    imported = worker.export_kv(list(pages), len(request.prompt_token_ids), "s")
    assert rows.keys() == imported.keys()
    for name in rows:
        for ours, theirs in zip(imported[name], rows[name], strict=True):
            assert (ours is None and theirs is None) or torch.equal(ours, theirs)
    held = worker.held["s"]
    assert torch.equal(held.draft_hidden, hidden)
    assert (topk is None) == (family != "glm")
    if topk is not None:
        assert torch.equal(slot_positions(PageTable(list(pages)), held.draft_topk, PAGE_SIZE), topk)
