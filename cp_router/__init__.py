"""Router side of dsa-serve. The CP math (strategies, metadata, padding, sharding) is pure torch/python."""

from cp_router.metadata import CPMetadata, build_cp_metadata
from cp_router.padding import (
    CP_IMPLS,
    DPPaddingMode,
    cal_padded_tokens,
    ceil_align,
    ceil_div,
    dp_padding_mode,
    pad_local_rows,
)
from cp_router.sharding import gather_rerange, shard, shard_positions
from cp_router.strategies import CP_STRATEGIES, can_split, get_strategy

__all__ = [
    "CPMetadata",
    "build_cp_metadata",
    "CP_IMPLS",
    "CP_STRATEGIES",
    "DPPaddingMode",
    "cal_padded_tokens",
    "can_split",
    "ceil_align",
    "ceil_div",
    "dp_padding_mode",
    "gather_rerange",
    "get_strategy",
    "pad_local_rows",
    "shard",
    "shard_positions",
]
