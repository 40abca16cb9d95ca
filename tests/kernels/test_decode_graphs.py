"""Decode steps on the fixed buffers CUDA graphs replay (model_workers/decode_graphs.py): a batch padded to its
bucket, with slots computed from the page tables on the device, gives the eager step's hidden states and writes the
same KV rows; a batch above the largest bucket runs eagerly. On a CPU the buffers run without capture (the graph
capture itself needs CUDA)."""

from __future__ import annotations

import pytest
import torch

from model_workers.checkpoint.loader import load_model
from model_workers.decode_graphs import graph_buckets
from model_workers.kernels.registry import kernel_set
from model_workers.runner import ExtendItem, ModelRunner


@pytest.fixture(scope="module")
def model(reference_checkpoint):
    _, folder = reference_checkpoint("v32", mtp=True)  # index_topk 8: decode steps select among the keys
    return load_model(folder, dtype=torch.float32, progress=False)


def test_buckets_are_powers_of_two_then_multiples_of_16_up_to_the_largest_batch():
    assert graph_buckets(5) == (1, 2, 4, 5) and graph_buckets(40) == (1, 2, 4, 8, 16, 32, 40)
    assert graph_buckets(64)[-3:] == (32, 48, 64)


def decode_steps(runner: ModelRunner, prompts: list[list[int]], steps: int) -> tuple[list, list]:
    """Prefills `prompts`, then `steps` plain decode steps of every request; (hidden per step, KV rows)."""
    tables = runner.standalone_tables([len(p) + steps for p in prompts])
    runner.extend([ExtendItem(t, p) for t, p in zip(tables, prompts)])
    outputs, last = [], [p[-1] for p in prompts]
    for step in range(steps):
        hidden = runner.decode([ExtendItem(t, [token]) for t, token in zip(tables, last)])
        outputs.append(hidden)
        last = [(token * 7 + step) % 100 + 1 for token in last]
    return outputs, [runner.cache.rows(t) for t in tables]


@pytest.mark.parametrize("batch", [1, 3, 5])  # bucket 1; bucket 4 with a padding row; above the largest (4)
def test_static_buffer_decode_equals_eager_decode(model, batch):
    kernels = kernel_set("triton")
    prompts = [[(3 * b + i) % 90 + 5 for i in range(12 + 3 * b)] for b in range(batch)]
    eager = ModelRunner(model, num_pages=24, page_size=8, kernels=kernels)
    graphed = ModelRunner(model, num_pages=24, page_size=8, kernels=kernels, graph_shape=(4, 64))
    assert graphed.decode_graphs is not None and graphed.cache.num_pages == 25  # one scratch page
    expected, expected_rows = decode_steps(eager, prompts, 3)
    got, got_rows = decode_steps(graphed, prompts, 3)
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    for a, b in zip(got_rows, expected_rows):
        for layer_a, layer_b in zip(a["latent"], b["latent"]):
            torch.testing.assert_close(layer_a, layer_b, atol=1e-5, rtol=1e-5)


def test_graphs_are_only_for_forwards_without_host_syncs(model):
    assert ModelRunner(model, num_pages=4, page_size=8, graph_shape=(4, 32)).decode_graphs is None  # torch set
    deterministic = ModelRunner(model, num_pages=4, page_size=8, kernels=kernel_set("triton"), deterministic=True,
                                graph_shape=(4, 32))
    assert deterministic.decode_graphs is None and deterministic.cache.num_pages == 4
