"""Padding arithmetic of CP prefill (docs/architecture.md, 'Two implementations: legacy and v2').

Pure integer/tensor helpers: row padding at a shard's tail, the per-rank
physical row counts of the two implementations, the DP padding mode and
the padding-mode rule that `cal_padded_tokens` (metadata.py) applies.
"""

from __future__ import annotations

import enum
from typing import Sequence

import torch

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


def split_rows(
    x_global: torch.Tensor, local_to_global: torch.Tensor, num_rows: int, fill_value: int | float = 0
) -> torch.Tensor:
    """The split-and-rebuild routine: rows `local_to_global` of `x_global`, tail-padded to `num_rows`."""
    x_local = x_global.index_select(0, local_to_global.to(x_global.device))  # [T_logical, ...]
    return pad_local_rows(x_local, num_rows, fill_value)  # [num_rows, ...]


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


def dp_padded_rows(dp_token_counts: Sequence[int], dp_rank: int, is_extend_batch: bool, align: int = 1) -> int:
    """Rows DP rank `dp_rank` sizes its buffers for: every DP rank's count aligned up to `align`, then the max
    over DP ranks (MAX_LEN) or its own (SUM_LEN). The legacy branch of `cal_padded_tokens`, and the buffer size
    of the expert exchange in DP-attention decode."""
    aligned = [ceil_align(n, align) for n in dp_token_counts]
    if dp_padding_mode(dp_token_counts, is_extend_batch) is DPPaddingMode.MAX_LEN:
        return max(aligned)
    return aligned[dp_rank]
