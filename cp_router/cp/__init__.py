"""The CP math: strategies, padding, metadata, sharding and balance; pure functions over ints and tensors."""

from cp_router.cp.metadata import CPMetadata, build_cp_metadata, cal_padded_tokens
from cp_router.cp.padding import (
    CP_IMPLS,
    DPPaddingMode,
    ceil_align,
    ceil_div,
    dp_padding_mode,
    pad_local_rows,
)
from cp_router.cp.sharding import gather_rerange, shard, shard_positions
from cp_router.cp.strategies import CP_STRATEGIES, can_split, get_strategy

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
