"""Every worked example of docs/architecture.md, 'CP strategies and their layouts' and
'Two implementations: legacy and v2', plus the padding / DP rules and the error paths."""

import pytest
import torch

from cp_router.cp import (
    DPPaddingMode,
    build_cp_metadata,
    cal_padded_tokens,
    can_split,
    dp_padding_mode,
    gather_rerange,
    pad_local_rows,
    shard,
    shard_positions,
)
from cp_router.cp.strategies import zigzag_block

IMPLS = ["legacy", "v2"]


def local_layout(meta):
    return [idx_global.tolist() for idx_global in meta.local_to_global]


@pytest.mark.parametrize("impl", IMPLS)
def test_zigzag_l10_c2(impl):
    meta = build_cp_metadata([10], [0], 2, "zigzag", impl)
    assert [zigzag_block(10, 4, b) for b in range(4)] == [(0, 3), (3, 6), (6, 8), (8, 10)]  # blocks [3,3,2,2]
    assert local_layout(meta) == [[0, 1, 2, 8, 9], [3, 4, 5, 6, 7]]


@pytest.mark.parametrize("impl", IMPLS)
def test_zigzag_l10_c4_layout_and_block_restore_permutation(impl):
    meta = build_cp_metadata([10], [0], 4, "zigzag", impl)
    blocks = [zigzag_block(10, 8, b) for b in range(8)]
    assert [hi - lo for lo, hi in blocks] == [2, 2, 1, 1, 1, 1, 1, 1]
    assert local_layout(meta) == [[0, 1, 9], [2, 3, 8], [4, 7], [5, 6]]
    # slot of each global block in the rank-major gathered buffer: rank r holds [prev | next] = slots 2r, 2r+1
    slots = []
    for lo, hi in blocks:
        row = int(meta.restore_index[lo])
        cp_rank, row_local = divmod(row, meta.collective_rows)
        prev_len = zigzag_block(10, 8, cp_rank)[1] - zigzag_block(10, 8, cp_rank)[0]
        slots.append(2 * cp_rank + (0 if row_local < prev_len else 1))
    assert slots == [0, 2, 4, 6, 7, 5, 3, 1]


@pytest.mark.parametrize("impl", IMPLS)
def test_interleave_l10_c2(impl):
    meta = build_cp_metadata([10], [0], 2, "interleave", impl)
    assert local_layout(meta) == [[0, 2, 4, 6, 8], [1, 3, 5, 7, 9]]


@pytest.mark.parametrize("impl", IMPLS)
def test_interleave_two_requests_rank3(impl):
    meta = build_cp_metadata([3, 7], [5, 2], 4, "interleave", impl)
    logical = meta.per_rank_logical_token[3]
    assert meta.local_to_global[3].tolist() == [3, 7]
    assert meta.request_index_local[3][:logical].tolist() == [1, 1]  # request 0 contributes nothing
    assert shard_positions(meta, 3)[:logical].tolist() == [2 + 0, 2 + 4]  # sliced, prefix included
    assert meta.key_start_local[3][:logical].tolist() == [8, 8]  # request 0 has 5 + 3 packed keys
    assert meta.key_end_local[3][:logical].tolist() == [8 + 3, 8 + 7]


def test_v2_zigzag_padding_7_6_to_8_8():
    meta = build_cp_metadata([13], [0], 2, "zigzag", "v2")
    assert meta.per_rank_logical_token == (7, 6)
    assert meta.per_rank_actual_token == (8, 8)
    assert meta.collective_rows == 8


def test_v2_interleave_padding_and_gather_indices():
    meta = build_cp_metadata([10], [0], 4, "interleave", "v2")
    assert meta.per_rank_logical_token == (3, 3, 2, 2)
    assert meta.per_rank_actual_token == (4, 4, 4, 4)
    assert meta.cp_size * meta.collective_rows == 16
    p = meta.collective_rows
    assert meta.restore_index.tolist() == [(i % 4) * p + i // 4 for i in range(10)]
    x = torch.arange(10.0) + 1  # [N]
    gathered = torch.cat([pad_local_rows(shard(meta, x, r), p) for r in range(4)])  # [16]
    assert gathered.shape == (16,)
    assert torch.equal(gather_rerange(meta, gathered), x)


def test_legacy_counts_are_real_and_padding_fills_the_shortest_shards():
    meta = build_cp_metadata([10], [0], 4, "zigzag", "legacy")
    assert meta.per_rank_actual_token == (3, 3, 2, 2)  # real counts
    assert meta.per_rank_physical_token == (4, 4, 4, 4)  # batch padded to 16, pads at shard tails
    assert meta.max_rank_len == 3


@pytest.mark.parametrize("extend_lens", [[10], [3, 7], [5, 1, 9], [4, 4]])
def test_legacy_interleave_equals_view_split_of_the_padded_stream(extend_lens):
    """legacy interleave = pad the stream to a multiple of C, then `view(-1, C)[:, cp_rank]`."""
    cp_size = 4
    meta = build_cp_metadata(extend_lens, [3] * len(extend_lens), cp_size, "interleave", "legacy")
    x = torch.randn(meta.num_tokens, 2)  # [N, 2]
    x_padded = pad_local_rows(x, -(-meta.num_tokens // cp_size) * cp_size)  # [N_pad, 2]
    for cp_rank in range(cp_size):
        assert torch.equal(shard(meta, x, cp_rank), x_padded.view(-1, cp_size, 2)[:, cp_rank])


def test_positions_keep_prefix_offset():
    meta = build_cp_metadata([6], [100], 2, "zigzag", "v2")  # blocks [2,2,1,1] -> [0,1,5] / [2,3,4]
    assert shard_positions(meta, 0)[:3].tolist() == [100, 101, 105]
    assert shard_positions(meta, 1)[:3].tolist() == [102, 103, 104]
    assert shard_positions(meta, 0)[3:].tolist() == [0]  # P = ceil_align(3, 4) = 4: one padding row, position 0


def test_padding_rows_metadata_is_harmless():
    meta = build_cp_metadata([10], [4], 4, "zigzag", "v2")
    logical = meta.per_rank_logical_token[2]
    assert meta.request_index_local[2][logical:].eq(-1).all()
    assert meta.key_start_local[2][logical:].eq(0).all()
    assert meta.key_end_local[2][logical:].eq(1).all()


@pytest.mark.parametrize(
    "extend_lens, cp_size, strategy, expected",
    [
        ([3], 2, "zigzag", False),  # fewer than 2C
        ([4], 2, "zigzag", True),
        ([1, 2], 2, "zigzag", False),
        ([1, 3], 2, "zigzag", True),  # the batch counts, not each request
        ([1], 2, "interleave", False),  # fewer than C
        ([2], 2, "interleave", True),
        ([1], 1, "interleave", True),
        ([1], 1, "zigzag", False),
    ],
)
def test_can_split(extend_lens, cp_size, strategy, expected):
    assert can_split(extend_lens, cp_size, strategy) is expected


def test_unsplittable_batch_gets_no_metadata():
    with pytest.raises(ValueError, match="too short"):
        build_cp_metadata([3], [0], 2, "zigzag", "v2")


@pytest.mark.parametrize("strategy", ["zigzag", "interleave"])
def test_cal_padded_tokens_v2_is_the_physical_shard(strategy):
    meta = build_cp_metadata([37], [0], 4, strategy, "v2")
    for cp_rank in range(4):
        assert cal_padded_tokens(meta, cp_rank) == meta.per_rank_actual_token[cp_rank]


@pytest.mark.parametrize(
    "strategy, dp_token_counts, dp_rank, is_extend, expected",
    [
        ("zigzag", None, 0, True, 16),  # dp = 1: ceil_align(10, 8)
        ("interleave", None, 0, True, 3),  # ceil_div(ceil_align(10, 4), 4)
        ("zigzag", [10, 30], 0, False, 32),  # MAX_LEN (2*40 >= 30*2): max(16, 32)
        ("zigzag", [10, 17], 0, False, 24),  # MAX_LEN over aligned counts: max(16, 24)
        ("zigzag", [10, 30], 0, True, 16),  # extend with dp > 1: SUM_LEN, own aligned count
        ("interleave", [10, 30], 0, False, 8),  # MAX_LEN, then ceil_div(32, 4)
        ("interleave", [10, 30], 0, True, 3),  # SUM_LEN, then ceil_div(12, 4)
        ("zigzag", [10, 40, 0, 0], 0, False, 16),  # SUM_LEN: 2*50 < 40*4
        ("interleave", [40, 10, 0, 0], 1, False, 3),  # SUM_LEN on dp_rank 1
    ],
)
def test_cal_padded_tokens_legacy(strategy, dp_token_counts, dp_rank, is_extend, expected):
    meta = build_cp_metadata([10], [0], 4, strategy, "legacy")
    assert cal_padded_tokens(meta, 0, dp_token_counts, dp_rank, is_extend) == expected


@pytest.mark.parametrize(
    "counts, is_extend, mode",
    [
        ([7], True, DPPaddingMode.MAX_LEN),
        ([7], False, DPPaddingMode.MAX_LEN),
        ([10, 10], True, DPPaddingMode.SUM_LEN),
        ([10, 10], False, DPPaddingMode.MAX_LEN),
        ([10, 0], False, DPPaddingMode.MAX_LEN),  # 2*10 >= 10*2, the boundary
        ([10, 0, 0], False, DPPaddingMode.SUM_LEN),  # 20 < 30
    ],
)
def test_dp_padding_mode(counts, is_extend, mode):
    assert dp_padding_mode(counts, is_extend) is mode


def test_cal_padded_tokens_rejects_foreign_dp_count():
    meta = build_cp_metadata([10], [0], 2, "zigzag", "legacy")
    with pytest.raises(ValueError, match="dp_token_counts"):
        cal_padded_tokens(meta, 0, [9, 10], dp_rank=0)


@pytest.mark.parametrize(
    "args, match",
    [
        (([4], [0, 0], 2, "zigzag", "v2"), "one prefix_len"),
        (([4, 0], [0, 0], 2, "zigzag", "v2"), "extend_lens must be >= 1"),
        (([4], [-1], 2, "zigzag", "v2"), "prefix_lens >= 0"),
        (([4], [0], 0, "zigzag", "v2"), "cp_size must be >= 1"),
        (([4], [0], 2, "ring", "v2"), "cp_strategy must be one of"),
        (([4], [0], 2, "zigzag", "auto"), "cp_impl must be one of"),
    ],
)
def test_build_rejects_bad_input(args, match):
    with pytest.raises(ValueError, match=match):
        build_cp_metadata(*args)


def test_shape_errors():
    meta = build_cp_metadata([10], [0], 2, "interleave", "v2")
    with pytest.raises(ValueError, match="batch has 10 tokens"):
        shard(meta, torch.zeros(9), 0)
    with pytest.raises(ValueError, match="expected cp_size"):
        gather_rerange(meta, torch.zeros(10))
    with pytest.raises(ValueError, match="exceed"):
        pad_local_rows(torch.zeros(5), 4)
