"""CP strategies: which tokens of a batch each CP rank owns (docs/architecture.md, 'CP strategies and their layouts').

A batch is a flattened token stream of N = sum(extend_lens) tokens, request
after request. A strategy describes a rank's share as `Segment`s in local
order; everything else (index maps, positions, request ids) is derived from
them, so the two strategies differ only in `local_segments` and `align`.

* zigzag: each request is cut into 2C blocks, the first `L mod 2C` blocks one
  token longer; rank r owns block r ("prev") and block 2C-1-r ("next"), laid
  out as [all requests' prev blocks | all requests' next blocks].
* interleave: stream token i goes to rank i mod C, the stride running across
  request boundaries.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import torch

STRATEGY_ZIGZAG = "zigzag"
STRATEGY_INTERLEAVE = "interleave"
CP_STRATEGIES = (STRATEGY_ZIGZAG, STRATEGY_INTERLEAVE)


class Segment(NamedTuple):
    """Tokens `range(lo, hi, step)` of request `request_index`, offsets inside the request's extend; lo <= hi."""

    request_index: int
    lo: int
    hi: int
    step: int


def stream_offsets(extend_lens: Sequence[int]) -> list[int]:
    """[R + 1] start of every request in the flattened stream, then N."""
    offsets = [0]
    for extend_len in extend_lens:
        offsets.append(offsets[-1] + extend_len)
    return offsets


def expand_segments(segments: Sequence[Segment], bases: Sequence[int]) -> torch.Tensor:
    """[T_local] int64: `bases[request] + offset` for every token of `segments`, in order."""
    parts = [bases[seg.request_index] + torch.arange(seg.lo, seg.hi, seg.step) for seg in segments]
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long)


class CPStrategy:
    """A layout of the token stream over cp_size ranks."""

    name: str

    def align(self, cp_size: int) -> int:
        """CP alignment: 2C for zigzag, C for interleave; also the minimum splittable N."""
        raise NotImplementedError

    def local_segments(self, extend_lens: Sequence[int], cp_size: int, cp_rank: int) -> list[Segment]:
        """The rank's tokens as segments, in local order."""
        raise NotImplementedError

    def local_to_global(self, extend_lens: Sequence[int], cp_size: int, cp_rank: int) -> torch.Tensor:
        """[T_logical] int64 stream index of each logical local row."""
        segments = self.local_segments(extend_lens, cp_size, cp_rank)
        return expand_segments(segments, stream_offsets(extend_lens)[:-1])

    def shard_position_ids(
        self, extend_lens: Sequence[int], prefix_lens: Sequence[int], cp_size: int, cp_rank: int
    ) -> torch.Tensor:
        """[T_logical] int64 global position (prefix included) of each logical local row.

        Computed from the layout directly, never by indexing a global tensor.
        """
        return expand_segments(self.local_segments(extend_lens, cp_size, cp_rank), prefix_lens)


def zigzag_block(extend_len: int, num_blocks: int, block: int) -> tuple[int, int]:
    """[lo, hi) of `block` when `extend_len` tokens are cut into `num_blocks` blocks, the first ones longer."""
    base, extra = divmod(extend_len, num_blocks)
    lo = block * base + min(block, extra)
    return lo, lo + base + (1 if block < extra else 0)


class ZigzagStrategy(CPStrategy):
    name = STRATEGY_ZIGZAG

    def align(self, cp_size: int) -> int:
        return 2 * cp_size

    def local_segments(self, extend_lens: Sequence[int], cp_size: int, cp_rank: int) -> list[Segment]:
        num_blocks = 2 * cp_size
        prev = [Segment(s, *zigzag_block(n, num_blocks, cp_rank), 1) for s, n in enumerate(extend_lens)]
        next_block = num_blocks - 1 - cp_rank
        nxt = [Segment(s, *zigzag_block(n, num_blocks, next_block), 1) for s, n in enumerate(extend_lens)]
        return prev + nxt


class InterleaveStrategy(CPStrategy):
    name = STRATEGY_INTERLEAVE

    def align(self, cp_size: int) -> int:
        return cp_size

    def local_segments(self, extend_lens: Sequence[int], cp_size: int, cp_rank: int) -> list[Segment]:
        offsets_global = stream_offsets(extend_lens)
        segments = []
        for s, extend_len in enumerate(extend_lens):
            first_local = (cp_rank - offsets_global[s]) % cp_size  # first offset in request s on cp_rank
            segments.append(Segment(s, min(first_local, extend_len), extend_len, cp_size))
        return segments


_STRATEGIES: dict[str, CPStrategy] = {s.name: s for s in (ZigzagStrategy(), InterleaveStrategy())}


def get_strategy(name: str) -> CPStrategy:
    if name not in _STRATEGIES:
        raise ValueError(f"cp_strategy must be one of {CP_STRATEGIES}, got {name!r}")
    return _STRATEGIES[name]


def can_split(extend_lens: Sequence[int], cp_size: int, strategy: str) -> bool:
    """Whether a prefill batch is long enough for CP: N >= C (interleave) or N >= 2C (zigzag).

    A batch that cannot be split runs without CP and without padding.
    """
    return sum(extend_lens) >= get_strategy(strategy).align(cp_size)


def cp_alignment(strategy: str, cp_size: int) -> int:
    """The CP alignment of a group: the strategy's `align` (2C zigzag, C interleave) under CP, 1 without."""
    return get_strategy(strategy).align(cp_size) if cp_size > 1 else 1
