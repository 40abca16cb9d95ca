"""When no query has more than index_topk causal keys, every query takes all of them: the backend selects them
without the indexer's scores and the layer skips the indexer's query projections. The outputs are the bits of
the scored path, plain and deterministic, and a request longer than top-k still scores."""

import pytest
import torch

from model_workers.kernels.registry import kernel_set
from model_workers.models.dsa.backend import DSABackend
from model_workers.checkpoint.saver import init_weights
from model_workers.kernels.torch.batch_invariant import BatchInvariantMode
from model_workers.models.registry import parse_model_config
from model_workers.models.dsa.model import DSAForCausalLM
from model_workers.runner import ExtendItem, ModelRunner
from support.tiny_models import BASE

CONFIG = {**BASE, "model_type": "deepseek_v32", "tie_word_embeddings": True}  # index_topk 8
TOPK = CONFIG["index_topk"]


class CountingBackend(DSABackend):
    """Counts selections made with and without scores; `always_score` forces the scored path."""

    def __init__(self, cache, deterministic: bool, always_score: bool):
        super().__init__(cache, kernel_set(), deterministic=deterministic)
        self.always_score = always_score
        self.calls = {"scored": 0, "all_keys": 0}

    def needs_index_scores(self, layer_id: int, topk: int) -> bool:
        return self.always_score or super().needs_index_scores(layer_id, topk)

    def select_topk(self, layer_id, index_q, index_weights, topk):
        self.calls["scored" if index_q is not None else "all_keys"] += 1
        return super().select_topk(layer_id, index_q, index_weights, topk)


def tiny_model() -> DSAForCausalLM:
    model = DSAForCausalLM(parse_model_config(CONFIG), mtp_layout=[(True, False)]).eval()
    init_weights(model, std=0.3, seed=3)
    return model


def run_forwards(model, deterministic: bool, always_score: bool, prompts: list[list[int]], steps: int):
    """Prefill of every prompt, `steps` batched decode steps, one 3-row verify-shaped extend per request, and
    one MTP forward; returns (every logits / hidden output in order, the backend's call counts)."""
    runner = ModelRunner(model, num_pages=16, page_size=4, deterministic=deterministic)
    runner.backend = backend = CountingBackend(runner.cache, deterministic, always_score)
    tables = runner.standalone_tables([len(p) + steps + 4 for p in prompts])
    outputs, last = [], [p[-1] for p in prompts]
    mode = BatchInvariantMode() if deterministic else torch.no_grad()
    with torch.no_grad(), mode:
        for table, prompt in zip(tables, prompts):
            outputs.append(model.logits(runner.extend([ExtendItem(table, prompt)])))
            table.num_tokens = len(prompt)
        for _ in range(steps):
            hidden = runner.extend([ExtendItem(t, [tok]) for t, tok in zip(tables, last)], is_extend=False)
            logits = model.logits(hidden)
            outputs.append(logits)
            last = logits.argmax(-1).tolist()
        starts = [t.num_tokens for t in tables]
        verify = runner.extend([ExtendItem(t, [tok, 5, 6]) for t, tok in zip(tables, last)])  # [B*3, D]
        outputs.append(model.logits(verify))
        for table, start in zip(tables, starts):
            table.num_tokens = start
        mtp_items = [ExtendItem(t, [7]) for t in tables]
        outputs.append(runner.extend_mtp(mtp_items, verify.view(len(tables), 3, -1)[:, 0], starts, is_extend=False))
    return outputs, backend.calls


@pytest.mark.parametrize("deterministic", [False, True])
def test_short_contexts_skip_the_scores_and_keep_every_bit(deterministic):
    model = tiny_model()
    prompts = [[1, 2, 3], [4, 5], [9, 8, 7, 6]]  # all requests stay within top-k = 8 keys
    got, calls = run_forwards(model, deterministic, always_score=False, prompts=prompts, steps=1)
    want, forced = run_forwards(model, deterministic, always_score=True, prompts=prompts, steps=1)
    assert calls["scored"] == 0 and calls["all_keys"] > 0 and forced["all_keys"] == 0
    for a, b in zip(got, want):
        assert torch.equal(a, b)


def test_a_request_past_topk_keys_scores_the_whole_batch_and_keeps_every_bit():
    model = tiny_model()
    prompts = [[1, 2, 3], list(range(1, 12))]  # the second request holds more than 8 keys
    got, calls = run_forwards(model, False, always_score=False, prompts=prompts, steps=2)
    want, _ = run_forwards(model, False, always_score=True, prompts=prompts, steps=2)
    assert calls["scored"] > 0 and calls["all_keys"] > 0  # the short prefill still skips
    for a, b in zip(got, want):
        assert torch.equal(a, b)


def test_the_indexer_query_projection_is_not_run_on_short_contexts():
    model = tiny_model()
    seen = []
    for layer in model.model.layers:
        layer.self_attn.indexer.wq_b.register_forward_hook(lambda module, args, out: seen.append(out.shape))
    run_forwards(model, False, always_score=False, prompts=[[1, 2, 3]], steps=2)
    assert seen == []


def test_selecting_without_scores_past_topk_keys_is_an_error():
    model = tiny_model()
    runner = ModelRunner(model, num_pages=8, page_size=4)
    (table,) = runner.standalone_tables([12])
    backend = runner.bound_backend([ExtendItem(table, list(range(12)))])
    assert backend.needs_index_scores(0, TOPK)
    with pytest.raises(ValueError, match="needs the indexer's queries"):
        backend.select_topk(0, None, None, TOPK)
