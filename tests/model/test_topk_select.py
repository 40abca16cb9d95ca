"""Top-k narrowed by group maxima: the same values as torch.topk on every kind of row, the same keys where no
two keys tie at the k-th value, and the causal selection built on it equals a naive scorer on long prompts."""

import torch

from model_workers.kernels.torch import topk_select
from model_workers.kernels.torch.topk import causal_topk, earliest_topk, tied_earliest
from model_workers.kernels.torch.topk_select import kept_groups, row_topk
from tests.model.test_sparse_topk import naive_topk, random_inputs


def assert_same_selection(scores: torch.Tensor, width: int, distinct: bool) -> None:
    want_values, want_columns = scores.topk(width, dim=-1)
    values, columns = row_topk(scores, width)
    assert torch.equal(values, want_values)  # the same values, largest first
    assert torch.equal(scores.gather(1, columns), values)  # each value is its column's score
    assert all(len(set(row)) == width for row in columns.tolist())  # no key picked twice
    if distinct:
        assert torch.equal(columns, want_columns)


def test_long_rows_with_distinct_scores_pick_the_same_keys_as_torch_topk():
    generator = torch.Generator().manual_seed(0)
    for num_keys, width in [(4096, 64), (8192 + 77, 64), (20000, 64), (3000, 16), (2048, 128)]:
        scores = torch.randn(64, num_keys, generator=generator)
        assert 64 * num_keys >= topk_select.MIN_ELEMENTS  # the narrowed path, not the fallback
        assert_same_selection(scores, width, distinct=True)


def test_ties_masked_keys_and_sorted_rows_keep_the_exact_values():
    generator = torch.Generator().manual_seed(1)
    num_keys = 8192
    relu_sum = (torch.randn(64, 4, num_keys, generator=generator).relu()
                * torch.randn(64, 4, 1, generator=generator)).sum(1)  # the indexer's shape: exact zeros tie
    causal = torch.randn(64, num_keys, generator=generator)
    causal[:, 5000:] = float("-inf")  # keys past the query
    few_finite = torch.full((64, num_keys), float("-inf"))
    few_finite[:, :40] = torch.randn(64, 40, generator=generator)  # fewer finite keys than picks
    rising = torch.arange(num_keys, dtype=torch.float32).repeat(64, 1)  # the top keys all in the tail stride
    coarse = torch.randint(0, 5, (64, num_keys), generator=generator).float()  # almost all tied
    for scores in (relu_sum, causal, few_finite, rising, coarse):
        assert_same_selection(scores, 64, distinct=False)
    assert_same_selection(rising, 64, distinct=True)


def test_kept_groups_hold_every_key_above_the_kth_largest_group_maximum():
    generator = torch.Generator().manual_seed(2)
    scores = torch.randn(8, 5000, generator=generator)
    kept, groups = kept_groups(scores, 16, 64)
    assert kept.shape == (8, 16 * (5000 // 64) + 5000 % 64)
    group_max = scores[:, : 5000 - 5000 % 64].view(8, -1, 64).amax(dim=1)  # [8, 64]
    tau = group_max.topk(16, dim=-1).values[:, -1:]  # [8, 1]
    for row in range(8):
        above = scores[row][scores[row] > tau[row]]
        assert torch.equal(above.sort().values, kept[row][kept[row] > tau[row]].sort().values)


def test_causal_topk_over_a_long_prompt_equals_naive_scoring():
    generator = torch.Generator().manual_seed(3)
    num_keys, topk = 4096 + 50, 32
    index_q, index_w, keys = random_inputs(num_keys, num_keys, generator)
    positions = torch.arange(num_keys)
    got = causal_topk(index_q, index_w, keys, positions, topk)
    expected = naive_topk(index_q, index_w, keys, positions, topk)
    assert torch.equal(got.sort(-1).values, expected.sort(-1).values)


def test_earliest_topk_on_long_tied_rows_takes_the_earliest_keys():
    scores = torch.zeros(64, 8192)
    scores[:, 7000:7010] = 1.0  # ten clear winners, then 8182 keys tied at 0
    picked = earliest_topk(scores, 64)
    expected = torch.cat([torch.arange(54), torch.arange(7000, 7010)])
    assert all(row == expected.tolist() for row in picked.tolist())


def test_earliest_topk_equals_the_tie_rule_on_every_row():
    generator = torch.Generator().manual_seed(4)
    for num_keys in (100, 4096 + 3):
        distinct = torch.randn(64, num_keys, generator=generator)
        coarse = torch.randint(0, 3, (64, num_keys), generator=generator).float()  # every row tied at the k-th
        mixed = torch.where(torch.arange(64)[:, None] % 2 == 0, distinct, coarse)
        for scores in (distinct, coarse, mixed):
            kth = scores.topk(64, dim=-1).values[:, -1:]
            assert torch.equal(earliest_topk(scores, 64), tied_earliest(scores, kth, 64))
