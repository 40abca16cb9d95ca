"""Causal-work balance of one request of length L across CP ranks.

Work of a rank = sum over its queries of the length of their causal key range.
zigzag: max - min <= 2L; interleave: <= L; a contiguous split: about L^2 / C.
"""

import pytest

from cp_router.cp import CP_IMPLS, build_cp_metadata, can_split
from cp_router.cp.balance import causal_work_per_rank as rank_work
from cp_router.cp.balance import contiguous_causal_work as contiguous_work

LENGTHS = [2, 7, 16, 17, 25, 63, 100, 255, 256, 299, 300]
BOUND_IN_L = {"zigzag": 2, "interleave": 1}


@pytest.mark.parametrize("impl", CP_IMPLS)
@pytest.mark.parametrize("strategy", ["zigzag", "interleave"])
def test_strategy_balances_causal_work(strategy, impl):
    for cp_size in range(1, 9):
        for extend_len in LENGTHS:
            if not can_split([extend_len], cp_size, strategy):
                continue
            work = rank_work(build_cp_metadata([extend_len], [0], cp_size, strategy, impl))
            assert sum(work) == extend_len * (extend_len + 1) // 2
            assert max(work) - min(work) <= BOUND_IN_L[strategy] * extend_len, (cp_size, extend_len, work)


@pytest.mark.parametrize("cp_size", range(2, 9))
def test_contiguous_split_is_unbalanced_by_about_l_squared_over_c(cp_size):
    extend_len = 256
    contiguous = contiguous_work(extend_len, cp_size)
    spread = max(contiguous) - min(contiguous)
    assert spread >= extend_len**2 / (2 * cp_size)  # (C-1)/C * L^2/C, up to chunk rounding
    for strategy in ("zigzag", "interleave"):
        work = rank_work(build_cp_metadata([extend_len], [0], cp_size, strategy, "v2"))
        assert max(work) - min(work) <= 2 * extend_len < spread
