"""CP metadata of one prefill batch: everything a rank needs to run its shard.

Built once per batch by the engine's scheduler (`build_cp_metadata`); each rank
receives only its own slice (`CPMetadata.rank_view` -> `RankMetadata`). Row
conventions for a rank's physical shard of
`per_rank_physical_token[cp_rank]` rows: the first `per_rank_logical_token
[cp_rank]` rows are real tokens in local order, the rest are padding rows at
the tail. Padding rows are harmless by construction: data zero, position 0,
request index -1 and key range [0, 1) (one real key, so any softmax over it
stays finite); their outputs are never read back (`gather_rerange` drops them).

Packed key space: each request's keys (its cached prefix followed by its
extend tokens, positions 0 .. prefix+extend-1) laid out request after
request; request s starts at `key_offsets[s]`. A query of request s at global
position p may attend to packed keys [key_offsets[s], key_offsets[s] + p + 1).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from cp_router.cp.padding import (
    CP_IMPLS,
    IMPL_LEGACY,
    IMPL_V2,
    ceil_div,
    dp_padded_rows,
    pad_local_rows,
    physical_token_counts,
    split_rows,
)
from cp_router.cp.strategies import STRATEGY_INTERLEAVE, CPStrategy, can_split, get_strategy, stream_offsets
from cp_router.cp.wire import TensorsAsNumpy


@dataclass(frozen=True, eq=False)
class CPMetadata:
    """Layout of one prefill batch over cp_size ranks; row conventions in the module docstring."""

    cp_size: int
    strategy: str  # "zigzag" | "interleave"
    impl: str  # "legacy" | "v2"
    align: int  # CP alignment: 2C (zigzag) or C (interleave)
    extend_lens: tuple[int, ...]  # [R] new tokens per request
    prefix_lens: tuple[int, ...]  # [R] cached prefix per request
    num_tokens: int  # N = sum(extend_lens)
    stream_offsets: tuple[int, ...]  # [R + 1] start of each request in the token stream, then N
    key_offsets: tuple[int, ...]  # [R + 1] start of each request in packed key space, then its size
    per_rank_logical_token: tuple[int, ...]  # [C] real tokens per rank
    per_rank_actual_token: tuple[int, ...]  # [C] legacy: = logical; v2: padded P, equal on all ranks
    per_rank_physical_token: tuple[int, ...]  # [C] rows `shard` returns per rank (logical + tail padding)
    max_rank_len: int  # max of per_rank_logical_token
    collective_rows: int  # rows every rank passes to an all-gather (max physical), equal on all ranks
    local_to_global: tuple[torch.Tensor, ...]  # C x [T_logical] int64 stream index of each logical row
    positions_local: tuple[torch.Tensor, ...]  # C x [T_physical] int64 global position (padding: 0)
    request_index_local: tuple[torch.Tensor, ...]  # C x [T_physical] int64 request of each row (padding: -1)
    key_start_local: tuple[torch.Tensor, ...]  # C x [T_physical] int64 causal key range start (padding: 0)
    key_end_local: tuple[torch.Tensor, ...]  # C x [T_physical] int64 causal key range end, excl. (padding: 1)
    restore_index: torch.Tensor  # [N] int64 row of each stream token in the rank-major gathered buffer

    def rank_view(self, cp_rank: int) -> RankMetadata:
        """What rank `cp_rank` needs of this batch: its own rows, plus what every rank needs to rerange."""
        return RankMetadata(
            cp_size=self.cp_size, cp_rank=cp_rank, strategy=self.strategy, impl=self.impl,
            extend_lens=self.extend_lens, prefix_lens=self.prefix_lens, num_tokens=self.num_tokens,
            stream_offsets=self.stream_offsets, collective_rows=self.collective_rows,
            num_logical=self.per_rank_logical_token[cp_rank], num_physical=self.per_rank_physical_token[cp_rank],
            positions_local=self.positions_local[cp_rank], request_index_local=self.request_index_local[cp_rank],
            restore_index=self.restore_index,
        )


@dataclass(frozen=True, eq=False)
class RankMetadata(TensorsAsNumpy):
    """One rank's slice of a batch's `CPMetadata` (what a `StepPlan` carries); row conventions as above.

    `cp_rank` is the shard this rank runs: its CP rank, or 0 on the non-CP path (`cp_size == 1`), whichever
    worker runs it.
    """

    cp_size: int
    cp_rank: int
    strategy: str
    impl: str
    extend_lens: tuple[int, ...]  # [R]
    prefix_lens: tuple[int, ...]  # [R]
    num_tokens: int  # N
    stream_offsets: tuple[int, ...]  # [R + 1]
    collective_rows: int  # rows this rank passes to every all-gather, equal on all ranks
    num_logical: int  # real rows of this rank's shard
    num_physical: int  # rows of this rank's shard, tail padding included
    positions_local: torch.Tensor  # [T_physical] int64 global position (padding: 0)
    request_index_local: torch.Tensor  # [T_physical] int64 request of each row (padding: -1)
    restore_index: torch.Tensor  # [N] int64 row of each stream token in the rank-major gathered buffer


def _validate(extend_lens: Sequence[int], prefix_lens: Sequence[int], cp_size: int, impl: str) -> None:
    if len(extend_lens) != len(prefix_lens) or not extend_lens:
        raise ValueError(f"need one prefix_len per extend_len, got {len(extend_lens)} and {len(prefix_lens)}")
    if min(extend_lens) < 1 or min(prefix_lens) < 0:
        raise ValueError(f"extend_lens must be >= 1 and prefix_lens >= 0, got {extend_lens}, {prefix_lens}")
    if cp_size < 1:
        raise ValueError(f"cp_size must be >= 1, got {cp_size}")
    if impl not in CP_IMPLS:
        raise ValueError(f"cp_impl must be one of {CP_IMPLS}, got {impl!r}")


def _stream_labels(extend_lens: Sequence[int], prefix_lens: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """([N] request index, [N] global position) of every stream token."""
    lens = torch.tensor(extend_lens)  # [R]
    request_index = torch.repeat_interleave(torch.arange(len(extend_lens)), lens)  # [N]
    starts_global = torch.tensor(stream_offsets(extend_lens)[:-1])  # [R]
    offset_in_request = torch.arange(int(lens.sum())) - starts_global[request_index]  # [N]
    return request_index, torch.tensor(prefix_lens)[request_index] + offset_in_request


def _restore_index(local_to_global: Sequence[torch.Tensor], num_tokens: int, collective_rows: int) -> torch.Tensor:
    """[N] row of each stream token in the rank-major buffer of C x collective_rows rows."""
    restore = torch.empty(num_tokens, dtype=torch.long)
    for cp_rank, idx_global in enumerate(local_to_global):
        restore[idx_global] = cp_rank * collective_rows + torch.arange(idx_global.numel())
    return restore


def _per_rank(
    values_global: torch.Tensor, local_to_global: Sequence[torch.Tensor], physical: Sequence[int], fill_value: int
) -> tuple[torch.Tensor, ...]:
    """C x [T_physical]: `values_global` [N] split per rank by the data routine, tail filled with `fill_value`."""
    return tuple(
        split_rows(values_global, idx_global, num_rows, fill_value)
        for idx_global, num_rows in zip(local_to_global, physical)
    )


def rope_positions(
    strategy: CPStrategy, impl: str, extend_lens: Sequence[int], prefix_lens: Sequence[int],
    local_to_global: Sequence[torch.Tensor], physical: Sequence[int],
) -> tuple[torch.Tensor, ...]:
    """C x [T_physical]: the global position of every rank's rows (padding rows: 0), the one routine behind the
    model's RoPE positions under CP: queries, latent keys and indexer keys, whatever the KV format (the bf16
    cast and the FP8 quantize step both run after RoPE at these positions).

    legacy: the global positions split by the data's own split-and-rebuild routine (`split_rows`).
    v2: the strategy's own `shard_position_ids`, tail-padded. A path that used the other routine's layout would
    rotate keys at the wrong positions (the seed's FP8 bug; tests/workers/test_cp_fp8.py swaps this function).
    """
    if impl == IMPL_LEGACY:
        _, positions_global = _stream_labels(extend_lens, prefix_lens)
        return _per_rank(positions_global, local_to_global, physical, 0)
    cp_size = len(physical)
    return tuple(
        pad_local_rows(strategy.shard_position_ids(extend_lens, prefix_lens, cp_size, cp_rank), physical[cp_rank])
        for cp_rank in range(cp_size)
    )


def build_cp_metadata(
    extend_lens: Sequence[int], prefix_lens: Sequence[int], cp_size: int, strategy: str, impl: str
) -> CPMetadata:
    """CP metadata of a prefill batch (requests in stream order). The batch must pass `can_split`."""
    _validate(extend_lens, prefix_lens, cp_size, impl)
    extend_lens, prefix_lens = tuple(extend_lens), tuple(prefix_lens)
    cp_strategy = get_strategy(strategy)
    if not can_split(extend_lens, cp_size, strategy):
        raise ValueError(
            f"batch of {sum(extend_lens)} tokens is too short for {strategy} CP with cp_size={cp_size}"
            f" (needs >= {cp_strategy.align(cp_size)}); run it without CP (check can_split first)"
        )
    align = cp_strategy.align(cp_size)
    local_to_global = tuple(cp_strategy.local_to_global(extend_lens, cp_size, cp_rank) for cp_rank in range(cp_size))
    logical = tuple(idx_global.numel() for idx_global in local_to_global)
    physical = tuple(physical_token_counts(logical, impl, align))
    collective_rows = max(physical)
    request_index_global, positions_global = _stream_labels(extend_lens, prefix_lens)
    key_offsets = stream_offsets([p + n for p, n in zip(prefix_lens, extend_lens)])
    key_start_global = torch.tensor(key_offsets[:-1])[request_index_global]  # [N]
    key_end_global = key_start_global + positions_global + 1  # [N]
    positions_local = rope_positions(cp_strategy, impl, extend_lens, prefix_lens, local_to_global, physical)
    return CPMetadata(
        cp_size=cp_size,
        strategy=strategy,
        impl=impl,
        align=align,
        extend_lens=extend_lens,
        prefix_lens=prefix_lens,
        num_tokens=sum(extend_lens),
        stream_offsets=tuple(stream_offsets(extend_lens)),
        key_offsets=tuple(key_offsets),
        per_rank_logical_token=logical,
        per_rank_actual_token=logical if impl == IMPL_LEGACY else physical,
        per_rank_physical_token=physical,
        max_rank_len=max(logical),
        collective_rows=collective_rows,
        local_to_global=local_to_global,
        positions_local=positions_local,
        request_index_local=_per_rank(request_index_global, local_to_global, physical, -1),
        key_start_local=_per_rank(key_start_global, local_to_global, physical, 0),
        key_end_local=_per_rank(key_end_global, local_to_global, physical, 1),
        restore_index=_restore_index(local_to_global, sum(extend_lens), collective_rows),
    )


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
    num_rows = dp_padded_rows(counts, dp_rank, is_extend_batch, meta.align)
    if meta.strategy == STRATEGY_INTERLEAVE:
        return ceil_div(num_rows, meta.cp_size)
    return num_rows
