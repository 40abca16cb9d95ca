"""Padding arithmetic of CP prefill (DESIGN.md section 5).

Pure integer/tensor helpers: row padding at a shard's tail, the per-rank
physical row counts of the two implementations, the DP padding mode and
`cal_padded_tokens` (rows the attention metadata of a rank is sized for).
"""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING, Sequence

import torch

from cp_router.strategies import STRATEGY_INTERLEAVE

if TYPE_CHECKING:  # metadata imports this module; the type is only for hints
    from cp_router.metadata import CPMetadata

IMPL_LEGACY = "legacy"
IMPL_V2 = "v2"
CP_IMPLS = (IMPL_LEGACY, IMPL_V2)


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def ceil_align(a: int, align: int) -> int:
    """Smallest multiple of `align` that is >= a."""
    return ceil_div(a, align) * align


def pad_local_rows(x_local: torch.Tensor, num_rows: int, fill_value: int | float = 0) -> torch.Tensor:
    """Append `fill_value` rows at the tail of `x_local` (token dim first) up to `num_rows` rows.

    The one routine that pads a shard: for the physical shard size, and to
    `meta.collective_rows` right before an all-gather.
    """
    num_local = x_local.shape[0]
    if num_local > num_rows:
        raise ValueError(f"pad_local_rows: {num_local} local rows exceed the target of {num_rows} rows")
    if num_local == num_rows:
        return x_local
    tail = x_local.new_full((num_rows - num_local, *x_local.shape[1:]), fill_value)  # [pad, ...]
    return torch.cat([x_local, tail], dim=0)  # [num_rows, ...]


def physical_token_counts(logical: Sequence[int], impl: str, align: int) -> list[int]:
    """Rows of each rank's physical shard (logical rows first, zero rows at the tail).

    v2: every rank pads to P = ceil_align(max logical, align), equal on all ranks.
    legacy: the whole batch is padded to ceil_align(N, align) rows; the
    ceil_align(N, align) - N padding rows go, one by one, to the rank holding
    the fewest rows (lowest cp_rank on ties), always at that shard's tail. For
    interleave this is exactly the round robin continued over the padded
    stream; for a single zigzag request it makes all shards N_pad / C rows.
    """
    if impl == IMPL_V2:
        return [ceil_align(max(logical), align)] * len(logical)
    if impl != IMPL_LEGACY:
        raise ValueError(f"cp_impl must be one of {CP_IMPLS}, got {impl!r}")
    counts = list(logical)
    num_tokens = sum(logical)
    for _ in range(ceil_align(num_tokens, align) - num_tokens):
        counts[counts.index(min(counts))] += 1
    return counts


class DPPaddingMode(enum.Enum):
    MAX_LEN = "max_len"  # every DP rank pads to the longest DP rank
    SUM_LEN = "sum_len"  # every DP rank keeps its own count


def dp_padding_mode(dp_token_counts: Sequence[int], is_extend_batch: bool) -> DPPaddingMode:
    """MAX_LEN when 2*sum >= max*dp (always for dp = 1); extend batches with dp > 1 use SUM_LEN.

    Counts are the raw (unaligned) token counts of the DP ranks.
    """
    dp_size = len(dp_token_counts)
    if dp_size > 1 and is_extend_batch:
        return DPPaddingMode.SUM_LEN
    if 2 * sum(dp_token_counts) >= max(dp_token_counts) * dp_size:
        return DPPaddingMode.MAX_LEN
    return DPPaddingMode.SUM_LEN


def cal_padded_tokens(
    meta: CPMetadata,
    cp_rank: int,
    dp_token_counts: Sequence[int] | None = None,
    dp_rank: int = 0,
    is_extend_batch: bool = True,
) -> int:
    """Rows the attention metadata of `cp_rank` must be sized for.

    v2: `per_rank_actual_token[cp_rank]` (the shard is already padded).
    legacy: align every DP rank's token count up to the CP alignment, pick by
    the DP padding mode (MAX_LEN: max over DP ranks; SUM_LEN: own DP rank's
    count), then for interleave divide by cp_size rounding up.
    `dp_token_counts` defaults to this batch alone (a single DP rank).
    """
    if meta.impl == IMPL_V2:
        return meta.per_rank_actual_token[cp_rank]
    counts = list(dp_token_counts) if dp_token_counts is not None else [meta.num_tokens]
    if counts[dp_rank] != meta.num_tokens:
        raise ValueError(
            f"dp_token_counts[{dp_rank}]={counts[dp_rank]} must equal the batch's num_tokens={meta.num_tokens}"
        )
    aligned = [ceil_align(n, meta.align) for n in counts]
    mode = dp_padding_mode(counts, is_extend_batch)
    num_rows = max(aligned) if mode is DPPaddingMode.MAX_LEN else aligned[dp_rank]
    if meta.strategy == STRATEGY_INTERLEAVE:
        return ceil_div(num_rows, meta.cp_size)
    return num_rows
