"""The Triton sparse-MLA kernels (model_workers/kernels/triton/sparse_mla.py) against the torch reference, in
Triton's interpreter on CPU (float32 operands: its bf16 arithmetic is not a GPU's). Every output element is
written (outputs start as NaN), on plain rows and on FP8 rows, with and without key splits."""

from __future__ import annotations

import pytest
import torch

from model_workers.kernels.torch.fp8_rows import Fp8Rows, PlainRows
from model_workers.kernels.torch.sparse_mla import sparse_mla_attention
from model_workers.kernels.triton.launch import row_layout
from model_workers.kernels.triton.sparse_mla import Tiles, sparse_mla, sparse_mla_decode, split_count, tiles_for

# (query rows, heads, latent, rope): a decode row, a k = 2 verify, a prefill chunk; V3.2-like heads scaled down
# (64: one 64-head tile), a latent that is no power of two (48), GLM-5-like and the default model's dims.
SHAPES = [(1, 4, 32, 16), (3, 16, 64, 32), (40, 4, 32, 16), (2, 64, 32, 16), (3, 8, 48, 16)]


def case(rows: int, heads: int, latent: int, rope: int, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    keys, width = 50, 24
    q_latent = torch.randn(rows, heads, latent, generator=generator)
    q_pe = torch.randn(rows, heads, rope, generator=generator)
    values = torch.randn(keys, latent + rope, generator=generator) * 2
    ids = torch.randint(0, keys, (rows, width), generator=generator)
    ids[0, 1:] = -1  # a row with one key
    if rows > 1:
        ids[1, width // 2 :] = -1  # a masked tail
    return q_latent, q_pe, values, ids


def formats(latent: int, rope: int):
    return [PlainRows(latent + rope, torch.float32), Fp8Rows(latent, rope)]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("splits", [None, 3])
def test_sparse_mla_equals_the_torch_reference(shape, splits):
    q_latent, q_pe, values, ids = case(*shape)
    for key_format in formats(shape[2], shape[3]):
        stored = key_format.encode(values)
        expected = sparse_mla_attention(q_latent, q_pe, stored, ids, 0.125, decode=key_format.decode)
        out = torch.full_like(q_latent, float("nan"))
        got = sparse_mla(q_latent, q_pe, stored, ids, 0.125, row_layout(key_format, stored), splits=splits, out=out)
        assert not got.isnan().any()
        torch.testing.assert_close(got, expected, atol=2e-5, rtol=1e-5)


def test_the_decode_path_splits_the_keys_when_programs_are_few_and_equals_one_pass():
    q_latent, q_pe, values, ids = case(2, 4, 32, 16, seed=1)
    tiles = tiles_for(4, 32, fp8=False)
    assert split_count(2, 1, 24, tiles.block_k) > 1 and split_count(64, 1, 24, tiles.block_k) == 1
    stored = PlainRows(48, torch.float32).encode(values)
    layout = row_layout(PlainRows(48, torch.float32), stored)
    torch.testing.assert_close(sparse_mla_decode(q_latent, q_pe, stored, ids, 0.2, layout),
                               sparse_mla(q_latent, q_pe, stored, ids, 0.2, layout), atol=1e-5, rtol=1e-5)


def test_64_head_tiles_and_split_latent_tiles_where_the_model_has_them():
    assert tiles_for(128, 512, fp8=False).block_h == 64 and tiles_for(128, 512, fp8=True).block_c == 256
    assert tiles_for(16, 64, fp8=False).block_h == 16  # the default model: one tile of its 16 heads
    q_latent, q_pe, values, ids = case(2, 64, 32, 16, seed=2)
    key_format = Fp8Rows(32, 16)
    stored = key_format.encode(values)
    got = sparse_mla(q_latent, q_pe, stored, ids, 0.1, row_layout(key_format, stored),
                     tiles=Tiles(64, 16, 16, 16, 8))  # two 16-column latent tiles, each scoring all 32
    torch.testing.assert_close(got, sparse_mla_attention(q_latent, q_pe, stored, ids, 0.1, decode=key_format.decode),
                               atol=2e-5, rtol=1e-5)
