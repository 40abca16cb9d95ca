"""The FP8 KV format (docs/kv_cache.md, 'FP8 layout'): the byte layout and its formula, per-token quantization, and readers that
decode only what they gathered (attention: the top-k rows; the indexer: one key tile at a time)."""

import pytest
import torch

from model_workers.models.dsa.cache import PagedKVCache
from model_workers.kernels.torch.fp8_rows import FP8_BLOCK, Fp8Rows, PlainRows, e4m3_over_256, power_of_two_scales
from model_workers.kv_format import key_formats
from model_workers.kernels.torch.indexer import KEY_TILE
from model_workers.kernels.torch.sparse_mla import sparse_mla_attention
from model_workers.kernels.torch.topk import batched_causal_topk, causal_topk


def test_deepseek_v32_shapes_give_flashmla_656_byte_tokens_and_132_byte_index_keys():
    latent, index = key_formats("fp8_e4m3", torch.bfloat16, kv_lora_rank=512, rope_dim=64, index_dim=128)
    assert (latent.width, index.width) == (512 + 4 * 4 + 64 * 2, 128 + 4) == (656, 132)
    cache = PagedKVCache(2, 64, latent, index, indexed_layers=[True, True, False])  # 3 layers, 2 with an indexer
    assert cache.bytes_per_token() == 3 * 656 + 2 * 132
    assert all(t.dtype == torch.uint8 and t.shape == (128, 656) for t in cache.latent)
    bf16_latent, bf16_index = key_formats("bfloat16", torch.float32, 512, 64, 128)
    assert (bf16_latent.bytes_per_token, bf16_index.bytes_per_token) == (1152, 256)


def test_row_layout_is_fp8_values_then_fp32_scales_then_bf16_rope():
    fmt = Fp8Rows(256, 4)
    rows = torch.randn(3, 260) * torch.tensor([0.01, 1.0, 300.0])[:, None]  # very different magnitudes per token
    stored = fmt.encode(rows)  # [3, 256 + 8 + 8]
    scales = stored[:, 256:264].view(torch.float32)  # [3, 2]: one per 128 values
    for b in range(2):
        block = rows[:, b * FP8_BLOCK : (b + 1) * FP8_BLOCK]
        assert torch.equal(scales[:, b], power_of_two_scales(block.abs().amax(-1)))
        fp8 = stored[:, b * FP8_BLOCK : (b + 1) * FP8_BLOCK].view(torch.float8_e4m3fn)
        assert torch.equal(fp8, (block / scales[:, b : b + 1]).to(torch.float8_e4m3fn))
    assert torch.equal(stored[:, 264:].view(torch.bfloat16), rows[:, 256:].to(torch.bfloat16))


def test_scales_are_the_smallest_powers_of_two_that_fit_and_round_trip_is_within_one_fp8_step():
    amax = torch.tensor([448.0, 449.0, 1.0, 0.0, 3e-30])
    scales = power_of_two_scales(amax)
    assert scales.tolist()[:4] == [1.0, 2.0, 2.0**-8, 1.0]
    assert bool(((amax / scales) <= 448).all()) and bool(((amax / scales)[:3] > 224).all())
    fmt = Fp8Rows(200, 0)  # a partial last block
    rows = torch.randn(64, 200) * 5
    values = fmt.decode(fmt.encode(rows), torch.float32)
    scale = power_of_two_scales(fmt._blocks(rows).abs().amax(-1)).repeat_interleave(FP8_BLOCK, -1)[:, :200]
    assert bool(((values - rows).abs() <= 16 * scale).all())  # half an e4m3 step (2^-4 relative) at <= 448
    assert bool(((values - rows).abs() <= rows.abs() / 16 + scale * 2.0**-9).all())


def test_encoding_is_per_token_whatever_shares_the_batch():
    fmt = Fp8Rows(64, 16)
    rows = torch.randn(40, 80)
    together = fmt.encode(rows)
    assert torch.equal(torch.cat([fmt.encode(rows[i : i + 1]) for i in range(40)]), together)
    assert torch.equal(fmt.encode(rows.flip(0)).flip(0), together)


@pytest.mark.parametrize("bad", [dict(quantized_dim=30, plain_dim=16), dict(quantized_dim=32, plain_dim=15)])
def test_shapes_the_byte_layout_cannot_hold_are_refused(bad):
    with pytest.raises(ValueError, match="fp8_e4m3 KV cache needs"):
        Fp8Rows(**bad)


def test_attention_decodes_only_the_gathered_rows_and_then_is_the_plain_path():
    torch.manual_seed(0)
    fmt = Fp8Rows(32, 16)
    stored = fmt.encode(torch.randn(50, 48))  # [S, 68] bytes
    q_latent, q_pe = torch.randn(7, 4, 32), torch.randn(7, 4, 16)
    ids = torch.randint(-1, 50, (7, 9))
    seen = []

    def spy(rows, dtype):
        seen.append(rows.shape)
        return fmt.decode(rows, dtype)

    got = sparse_mla_attention(q_latent, q_pe, stored, ids, 0.1, decode=spy)
    want = sparse_mla_attention(q_latent, q_pe, fmt.decode(stored, torch.float32), ids, 0.1)  # plain rows
    assert torch.equal(got, want)
    assert all(shape[-2:] == (9, 68) for shape in seen)  # [rows, top-k, bytes]: never the whole store


def test_indexer_decodes_key_tiles_and_picks_what_decoded_keys_pick():
    torch.manual_seed(1)
    fmt = Fp8Rows(32)
    num_keys = 2 * KEY_TILE + 100
    keys = fmt.encode(torch.randn(num_keys, 32))  # [K, 36] bytes
    index_q, index_w = torch.randn(5, 4, 32), torch.rand(5, 4)
    positions = torch.tensor([3, 700, 1500, num_keys - 2, num_keys - 1])
    seen = []

    def spy(rows, dtype):
        seen.append(rows.shape[-2])
        return fmt.decode(rows, dtype)

    got = causal_topk(index_q, index_w, keys, positions, topk=16, decode=spy)
    want = causal_topk(index_q, index_w, fmt.decode(keys, torch.float32), positions, topk=16)
    assert torch.equal(got, want) and max(seen) <= KEY_TILE
    batched = batched_causal_topk(index_q[None], index_w[None], keys[None], positions[None], 16, decode=fmt.decode)
    assert torch.equal(batched[0], want)


def test_plain_formats_store_the_rows_as_they_are():
    fmt = PlainRows(8, torch.bfloat16)
    rows = torch.randn(4, 8)
    assert torch.equal(fmt.encode(rows), rows.to(torch.bfloat16))
    assert fmt.decode(fmt.encode(rows), torch.float32).dtype == torch.float32


def test_fast_e4m3_decode_is_exact_for_every_finite_byte():
    raw = torch.arange(256, dtype=torch.uint8)
    finite = ~torch.isnan(raw.view(torch.float8_e4m3fn).float())  # 0x7f and 0xff are NaN, never stored
    assert int(finite.sum()) == 254
    assert torch.equal(e4m3_over_256(raw)[finite] * 256, raw.view(torch.float8_e4m3fn).float()[finite])
