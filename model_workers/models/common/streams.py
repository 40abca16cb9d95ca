"""How a backend reaches the rows of a whole batch, and where a MoE layer's routed experts run: the two parts a
backend composes with, so one backend class per family serves one rank, a CP rank and an expert-parallel rank.

* rows: `stream(rows_local, tag)` turns this process's rows [T, ...] into the batch's stream in global order
  [N, ...]. One process: they are the stream (`LOCAL_ROWS`). A CP rank: an all-gather and a rerange
  (model_workers/cp_rows.py `CPRows`), which the model never sees.
* experts: `combine(x, expert_ids, weights, experts)` -> Σ_k weight · expert_k(x) [T, hidden]. This process holds
  them all: the kernel set's expert loop (`LocalExperts`). Expert parallelism: the exchange across the group
  (model_workers/expert_parallel.py `ExpertExchange`).
"""

from __future__ import annotations

from typing import Protocol

import torch

from model_workers.kernels.interface import ExpertLoop


class RowStream(Protocol):
    def stream(self, rows_local: torch.Tensor, tag: str) -> torch.Tensor:
        """[T, ...] rows of this process -> [N, ...] rows of the batch in stream order; `tag` names the traffic."""


class LocalRows:
    """One process holds the whole batch: its rows are the stream."""

    def stream(self, rows_local: torch.Tensor, tag: str) -> torch.Tensor:
        return rows_local


LOCAL_ROWS = LocalRows()


class LocalExperts:
    """Every routed expert held by this process: the kernel set's expert loop."""

    def __init__(self, loop: ExpertLoop):
        self.loop = loop

    def combine(self, x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor, experts) -> torch.Tensor:
        return self.loop.sum(experts, x, expert_ids, weights)
