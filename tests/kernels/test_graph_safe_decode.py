"""Graph-safe decode: on the Triton kernel set a decode step, a speculative verify and an MTP draft forward make
no host sync (no .item / .tolist / bool(tensor) / nonzero / boolean-mask indexing in the project's code), so the
step can be captured in a CUDA graph; the counter sees the syncs the torch reference makes (it is not blind)."""

from __future__ import annotations

import pytest
import torch

from model_workers.checkpoint.loader import load_model
from model_workers.kernels.registry import kernel_set
from model_workers.runner import ExtendItem, ModelRunner
from support.host_syncs import HostSyncs


@pytest.fixture(scope="module")
def model(reference_checkpoint):
    _, folder = reference_checkpoint("v32", mtp=True)  # a tiny V3.2 with an MTP layer: index_topk 8
    return load_model(folder, dtype=torch.float32, progress=False)


def forwards(model, backend: str, prompt_lens: list[int], kv_cache_dtype: str = "auto") -> list:
    """Prefills, then under the counter: a decode step, a k = 2 verify, one MTP draft step; the syncs found."""
    runner = ModelRunner(model, num_pages=32, page_size=16, kernels=kernel_set(backend),
                         kv_cache_dtype=kv_cache_dtype)
    tables = runner.standalone_tables([n + 8 for n in prompt_lens])  # room for the 1 + 3 + 1 rows below
    runner.extend([ExtendItem(t, list(range(1, n + 1))) for t, n in zip(tables, prompt_lens)])
    with HostSyncs() as syncs:
        hidden = runner.extend([ExtendItem(t, [5]) for t in tables], is_extend=False)
        runner.extend([ExtendItem(t, [5, 6, 7]) for t in tables])
        runner.extend_mtp([ExtendItem(t, [9]) for t in tables], hidden, [t.num_tokens - 1 for t in tables],
                          is_extend=False)
    return syncs.found


@pytest.mark.parametrize("prompt_lens", [[20, 11], [3, 5]], ids=["scored", "all-keys"])
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8_e4m3"])
def test_triton_decode_verify_and_draft_make_no_host_sync(model, prompt_lens, kv_cache_dtype):
    assert forwards(model, "triton", prompt_lens, kv_cache_dtype) == []


def test_the_counter_sees_the_torch_references_syncs(model):
    found = forwards(model, "torch", [20, 11])
    assert any(call in ("__int__", "__bool__") and "kernels/torch" in where for call, where in found)
