"""The Triton indexer logits and top-k (model_workers/kernels/triton/indexer.py, topk.py) against the torch
reference, in Triton's interpreter on CPU: logits equal on causal keys and -inf after the query, read through the
slots from plain and FP8 stores, for rows sharing keys (prefill) and for requests of a few rows (decode, verify);
selected sets equal up to ties."""

from __future__ import annotations

import pytest
import torch

from model_workers.kernels.torch.fp8_rows import Fp8Rows, PlainRows
from model_workers.kernels.torch.indexer import indexer_scores
from model_workers.kernels.torch.topk import batched_causal_topk, causal_topk
from model_workers.kernels.triton.indexer import indexer_logits
from model_workers.kernels.triton.launch import row_layout
from model_workers.kernels.triton.topk import batched_topk
from model_workers.kernels.triton.topk import causal_topk as triton_causal_topk

HEADS, DIM, STORE = 4, 32, 300


def store(key_format, seed: int = 0):
    values = torch.randn(STORE, DIM, generator=torch.Generator().manual_seed(seed))
    return key_format.encode(values)


def queries(rows: int, heads: int = HEADS, seed: int = 1):
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(rows, heads, DIM, generator=generator), torch.rand(rows, heads, generator=generator)


def same_sets_up_to_ties(got: torch.Tensor, expected: torch.Tensor, scores: torch.Tensor) -> bool:
    """Each row picks the same keys, or keys whose scores equal (within float noise) the ones it swapped."""
    for row, (a, b) in enumerate(zip(got.tolist(), expected.tolist())):
        mine, theirs = {k for k in a if k >= 0}, {k for k in b if k >= 0}
        if mine != theirs:
            swapped = [float(scores[row, k]) for k in mine ^ theirs]
            if max(swapped) - min(swapped) > 1e-4:
                return False
    return True


@pytest.mark.parametrize("key_format", [PlainRows(DIM, torch.float32), Fp8Rows(DIM)], ids=["plain", "fp8"])
@pytest.mark.parametrize("heads", [HEADS, 64])
def test_logits_of_rows_sharing_keys_equal_the_reference_and_mask_the_future(key_format, heads):
    stored = store(key_format)
    slots = torch.randperm(STORE, generator=torch.Generator().manual_seed(2))[:200]  # 200 keys, paged anywhere
    positions = torch.tensor([0, 1, 63, 64, 65, 130, 199])  # block edges; keys 128..199 lie past the first rows
    q, w = queries(len(positions), heads)
    out = torch.full((len(positions), 200), float("nan"))
    got = indexer_logits(q, w, stored, slots, positions, row_layout(key_format, stored), out=out)
    expected = indexer_scores(q, w, stored[slots], decode=key_format.decode)
    causal = torch.arange(200)[None, :] <= positions[:, None]
    torch.testing.assert_close(got[causal], expected[causal], atol=1e-4, rtol=1e-5)
    assert torch.isneginf(got[~causal]).all()


@pytest.mark.parametrize("key_format", [PlainRows(DIM, torch.float32), Fp8Rows(DIM)], ids=["plain", "fp8"])
def test_causal_topk_picks_the_reference_keys(key_format):
    stored = store(key_format, seed=3)
    slots = torch.randperm(STORE, generator=torch.Generator().manual_seed(4))[:150]
    positions = torch.tensor([3, 7, 8, 90, 149])  # <= 8 causal keys: take them all
    q, w = queries(len(positions), seed=5)
    got = triton_causal_topk(q, w, stored, slots, positions, 8, row_layout(key_format, stored))
    expected = causal_topk(q, w, stored[slots], positions, 8, decode=key_format.decode)
    scores = indexer_scores(q, w, stored[slots], decode=key_format.decode)
    assert got.shape == expected.shape and same_sets_up_to_ties(got, expected, scores)
    assert (got[0] >= 0).sum() == 4 and (got[1:3] >= 0).all()  # positions 3 / 7 / 8: 4, 8 and 8 keys


@pytest.mark.parametrize("key_format", [PlainRows(DIM, torch.float32), Fp8Rows(DIM)], ids=["plain", "fp8"])
@pytest.mark.parametrize("rows", [1, 3])  # a decode step; a k = 2 verify
def test_batched_topk_of_requests_of_a_few_rows_picks_the_reference_keys(key_format, rows):
    stored = store(key_format, seed=6)
    generator = torch.Generator().manual_seed(7)
    requests, keys = 3, 120
    slots = torch.stack([torch.randperm(STORE, generator=generator)[:keys] for _ in range(requests)])  # [B, K]
    starts = torch.tensor([2, 60, keys - rows])
    positions = starts[:, None] + torch.arange(rows)[None, :]  # [B, n]
    if rows > 1:
        positions[1, -1] = -1  # a padding row
    q, w = queries(requests * rows, seed=8)
    got = batched_topk(q.view(requests, rows, HEADS, DIM), w.view(requests, rows, HEADS), stored, slots, positions,
                       8, row_layout(key_format, stored))
    keys_b = stored[slots]  # [B, K, W]
    expected = batched_causal_topk(q.view(requests, rows, HEADS, DIM), w.view(requests, rows, HEADS), keys_b,
                                   positions, 8, decode=key_format.decode)
    scores = torch.stack([indexer_scores(q.view(requests, rows, HEADS, DIM)[b], w.view(requests, rows, HEADS)[b],
                                         keys_b[b], decode=key_format.decode) for b in range(requests)])
    assert got.shape == expected.shape
    assert same_sets_up_to_ties(got.flatten(0, 1), expected.flatten(0, 1), scores.flatten(0, 1))
    if rows > 1:
        assert (got[1, -1] == -1).all()  # a padding row picks nothing
