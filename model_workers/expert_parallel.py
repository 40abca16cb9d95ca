"""Expert parallelism across the CP group (docs/parallelism.md, 'Expert parallelism and DP-attention decode'): the
exchange behind `routed_experts`.

Every rank holds the attention of the whole model and one contiguous block of every MoE layer's routed
experts. A MoE layer runs in lockstep on all ranks: each rank brings its own rows (its CP shard in prefill,
the requests it owns in decode, none at all when it has nothing to do), the rows reach every rank, each rank
applies the experts it holds, and each row's partial sums come back to its rank and are added up. The shared
experts stay with the caller (added once per row, on its own rank).

One collective shape: an all-to-all of each rank's rows to every rank -> the experts held here -> an all-to-all
of each rank's partial sums back -> summed over ranks in rank order. The rows each rank brings follow the DP
padding mode (docs/parallelism.md, 'Expert parallelism and DP-attention decode'): MAX_LEN pads every rank to the
same P rows (padding rows route to no expert), SUM_LEN sends each rank's own count (zero allowed). A row travels
with its routing (expert ids, weights) packed as raw bytes, so one collective moves all three.

Why this shape (`dsa-serve bench ep-exchange`, gloo, DeepSeek-V3.2 MoE shapes): it moves the same bytes as
all-gather + reduce-scatter but spent 0.4-0.93x its communication time at every row count measured (gloo's
reduce-scatter costs about two all-to-alls); sending each row only to the ranks owning its experts saves
nothing at C = 2 (a row needs both ranks 98% of the time) and costs a count exchange, which loses at small
row counts; it only wins bytes (0.78x) at C = 4 with hundreds of rows per rank.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cp_router.cp.padding import DPPaddingMode, dp_padded_rows, dp_padding_mode, pad_local_rows
from model_workers.comm import LocalComm
from model_workers.kernels.interface import ExpertLoop


@dataclass(frozen=True)
class ForwardRows:
    """The rows every rank brings to the expert exchanges of one forward (equal on every rank)."""

    rows_per_rank: tuple[int, ...]
    mode: DPPaddingMode
    padded_rows: int  # MAX_LEN: rows each rank passes to the all-to-all (>= max rows_per_rank)


def dp_forward_rows(rows_per_rank: list[int], dp_rank: int, is_extend: bool) -> ForwardRows:
    """A forward of DP-attention ranks (decode, verify, draft, a prefill run on one rank): the padding mode
    and buffer rows (docs/parallelism.md: MAX_LEN when 2·sum >= max·dp, extend batches SUM_LEN)."""
    mode = dp_padding_mode(rows_per_rank, is_extend)
    return ForwardRows(tuple(rows_per_rank), mode, dp_padded_rows(rows_per_rank, dp_rank, is_extend))


def cp_forward_rows(rows_per_rank: list[int], collective_rows: int) -> ForwardRows:
    """A CP prefill forward: one batch sharded over the group, every rank padded to the CP collective size."""
    return ForwardRows(tuple(rows_per_rank), DPPaddingMode.MAX_LEN, collective_rows)


def pack_rows(x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """x [T, H], expert_ids [T, k], weights [T, k] float32 -> raw bytes [T, H·size + 8k] uint8."""
    parts = [x.contiguous(), expert_ids.to(torch.int32).contiguous(), weights.float().contiguous()]
    return torch.cat([p.view(torch.uint8) for p in parts], dim=1)  # [T, n·size] each: the last dim re-read


def unpack_rows(packed: torch.Tensor, hidden: int, top_k: int, dtype: torch.dtype):
    """The inverse of `pack_rows`: (x [T, H] dtype, expert_ids [T, k] int64, weights [T, k] float32)."""
    x_bytes = hidden * torch.empty((), dtype=dtype).element_size()
    x = packed[:, :x_bytes].contiguous().view(dtype)
    expert_ids = packed[:, x_bytes : x_bytes + 4 * top_k].contiguous().view(torch.int32).long()
    weights = packed[:, x_bytes + 4 * top_k :].contiguous().view(torch.float32)
    return x, expert_ids, weights


class ExpertExchange:
    """The expert-parallel group of one rank: its comm, and the row counts of the forward now running."""

    def __init__(self, comm: LocalComm, loop: ExpertLoop, deterministic: bool = False):
        """`loop`: the kernel set's expert loop, run on the rows that reach this rank's experts; `deterministic`:
        each row's expert terms come back unsummed and are added on its own rank in expert-id order
        (`loop.add_in_expert_order`), the bits of one rank holding every expert."""
        self.comm, self.loop = comm, loop
        self.deterministic = deterministic
        self.rows: ForwardRows | None = None

    @property
    def ep_rank(self) -> int:
        return self.comm.cp_rank

    @property
    def ep_size(self) -> int:
        return self.comm.cp_size

    def sync_rows(self, num_rows: int) -> list[int]:
        """Every rank's row count for the next forward (one small all-gather); all ranks get the same list."""
        return [counts[0] for counts in self.comm.all_gather_ints([num_rows])]

    def begin_forward(self, rows: ForwardRows) -> None:
        if len(rows.rows_per_rank) != self.ep_size:
            raise ValueError(f"{len(rows.rows_per_rank)} row counts for an expert-parallel group of {self.ep_size}")
        self.rows = rows

    def combine(self, x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor, experts) -> torch.Tensor:
        """This rank's rows x [T, H] routed to every rank's experts -> Σ_k weight · expert(x) [T, H]."""
        rows = self.rows
        if rows is None:
            raise RuntimeError("expert exchange without begin_forward: every rank must agree on the row counts")
        if rows.rows_per_rank[self.ep_rank] != x.shape[0]:
            raise RuntimeError(f"rank {self.ep_rank} brings {x.shape[0]} rows to a forward planned with"
                               f" {rows.rows_per_rank[self.ep_rank]}")
        if rows.mode is DPPaddingMode.MAX_LEN:  # every rank brings `padded_rows` rows; padding routes nowhere
            padded = rows.padded_rows
            out = self._exchange(pad_local_rows(x, padded), pad_local_rows(expert_ids, padded, -1),
                                 pad_local_rows(weights, padded), experts, [padded] * self.ep_size)
            return out[: x.shape[0]]
        return self._exchange(x, expert_ids, weights, experts, list(rows.rows_per_rank))

    def _exchange(self, x, expert_ids, weights, experts, rows_per_rank: list[int]) -> torch.Tensor:
        """All-to-all of this rank's rows to every rank, the experts held here, all-to-all of the partial sums
        back, summed over ranks in rank order. x [T, H] -> [T, H]."""
        num_rows, hidden, top_k, size = x.shape[0], x.shape[1], expert_ids.shape[1], self.ep_size
        packed = pack_rows(x, expert_ids, weights)  # [T, B]
        received = self.comm.all_to_all_rows(packed.repeat(size, 1), [num_rows] * size, rows_per_rank,
                                             "experts")  # [S, B] every rank's rows, rank-major
        rows_in = unpack_rows(received, hidden, top_k, x.dtype)
        if self.deterministic:  # [S, k*H]: one rank holds each slot's expert, the others send exact zeros
            partial = self.loop.slots(experts, *rows_in).reshape(received.shape[0], top_k * hidden)
        else:
            partial = self.loop.sum(experts, *rows_in)  # [S, H]
        returned = self.comm.all_to_all_rows(partial, rows_per_rank, [num_rows] * size, "experts")  # [C*T, H']
        summed = returned.view(size, num_rows, partial.shape[1]).sum(0)  # [T, H']
        if self.deterministic:
            return self.loop.add_in_expert_order(summed.view(num_rows, top_k, hidden), expert_ids)
        return summed  # [T, H]
