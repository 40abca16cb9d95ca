"""Causal top-k selection: the chunked causal-skipping path and the batched decode path equal a naive scorer."""

import torch

from model_workers.kernels.torch.indexer import indexer_scores
from model_workers.kernels.torch.topk import batched_causal_topk, causal_topk


def naive_topk(index_q, index_w, keys, positions, topk):
    """Scores every key, masks the future, top-k; short queries take keys 0..pos in order. [T, min(topk, K)]"""
    scores = indexer_scores(index_q, index_w, keys)  # [T, K]
    width = min(topk, keys.shape[0])
    out = torch.full((len(positions), width), -1, dtype=torch.long)
    for t, pos in enumerate(positions.tolist()):
        if pos < width:
            out[t, : pos + 1] = torch.arange(pos + 1)
        else:
            out[t] = scores[t, : pos + 1].topk(width).indices
    return out


def random_inputs(num_rows, num_keys, generator, heads=4, dim=8):
    # Positive inputs: no ReLU zeros, so no tied scores whose order top-k may break either way.
    index_q = torch.rand(num_rows, heads, dim, generator=generator)
    index_w = torch.rand(num_rows, heads, generator=generator)
    keys = torch.rand(num_keys, dim, generator=generator)
    return index_q, index_w, keys


def test_chunked_causal_topk_equals_naive_scoring_with_small_chunks():
    generator = torch.Generator().manual_seed(0)
    for num_keys, topk in [(40, 8), (200, 16), (9, 16)]:
        index_q, index_w, keys = random_inputs(num_keys, num_keys, generator)
        positions = torch.arange(num_keys)
        tiny_budget = 4 * 4 * num_keys * 3  # three query rows per chunk: many chunks, each truncated
        got = causal_topk(index_q, index_w, keys, positions, topk, budget_bytes=tiny_budget)
        expected = naive_topk(index_q, index_w, keys, positions, topk)
        assert torch.equal(got.sort(-1).values, expected.sort(-1).values)


def test_batched_topk_equals_per_request_topk():
    generator = torch.Generator().manual_seed(1)
    lengths, new_rows, topk = [3, 70, 17, 130], [1, 3, 2, 3], 16
    longest, most_rows = max(lengths), max(new_rows)
    q_pad = torch.zeros(len(lengths), most_rows, 4, 8)
    w_pad = torch.zeros(len(lengths), most_rows, 4)
    keys_pad = torch.rand(len(lengths), longest, 8, generator=generator)  # rows past a length are garbage
    positions = torch.full((len(lengths), most_rows), -1)
    expected = []
    for b, (length, rows) in enumerate(zip(lengths, new_rows)):
        index_q, index_w, _ = random_inputs(rows, length, generator)
        q_pad[b, :rows], w_pad[b, :rows] = index_q, index_w
        positions[b, :rows] = torch.arange(length - rows, length)
        expected.append(causal_topk(index_q, index_w, keys_pad[b, :length], positions[b, :rows], topk))
    got = batched_causal_topk(q_pad, w_pad, keys_pad, positions, topk)  # [B, n, topk]
    for b, rows in enumerate(new_rows):
        want = expected[b]
        assert torch.equal(got[b, :rows, : want.shape[1]].sort(-1).values, want.sort(-1).values)
        assert (got[b, :rows, want.shape[1]:] == -1).all() and (got[b, rows:] == -1).all()


def test_indexer_scores_over_several_key_tiles_equal_the_formula():
    from model_workers.kernels.torch.indexer import KEY_TILE

    generator = torch.Generator().manual_seed(2)
    index_q, index_w, keys = random_inputs(5, 2 * KEY_TILE + 300, generator)
    index_w[:, 0] = -index_w[:, 0]  # negative head weights are allowed
    expected = (torch.einsum("thd,kd->thk", index_q, keys).clamp_min(0) * index_w[:, :, None]).sum(1)  # [T, K]
    torch.testing.assert_close(indexer_scores(index_q, index_w, keys), expected, rtol=1e-5, atol=1e-5)


def test_score_buffers_reused_across_chunks_and_tiles_keep_the_scores():
    """causal_topk writes every chunk's scores into one buffer and every key tile's products into one workspace:
    a later, shorter chunk must not see an earlier chunk's scores, nor a partial tile a full tile's products."""
    from model_workers.kernels.torch.indexer import KEY_TILE, QUERY_TILE

    generator = torch.Generator().manual_seed(3)
    num_keys = KEY_TILE + 333  # two key tiles, the second partial (and not whole 64-key blocks)
    index_q, index_w, keys = random_inputs(2 * QUERY_TILE + 5, num_keys, generator)
    late = torch.arange(num_keys - QUERY_TILE - 5, num_keys)
    positions = torch.cat([late, torch.arange(QUERY_TILE)])  # long chunks, then short ones
    for deterministic in (False, True):
        got = causal_topk(index_q, index_w, keys, positions, 16, deterministic=deterministic)
        expected = naive_topk(index_q, index_w, keys, positions, 16)
        assert torch.equal(got.sort(-1).values, expected.sort(-1).values)
    into = torch.full((3, num_keys), float("nan"))
    indexer_scores(index_q[:3], index_w[:3], keys, out=into)
    assert torch.equal(into, indexer_scores(index_q[:3], index_w[:3], keys))
