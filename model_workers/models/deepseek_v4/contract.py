"""DeepSeek-V4's backend contract: the seam between its model and the rows it keeps between forwards.

The model pools windows and attends; a backend (backend.py) keeps every row a request needs later (window tails,
open compressor windows, compressed entries in the request's pages) and, under context parallelism, gathers
every rank's rows into the stream before keeping them, so the model never imports torch.distributed.
"""

from __future__ import annotations

from typing import Protocol

import torch


class V4AttentionBackend(Protocol):
    """DeepSeek-V4's contract (docs/models.md, 'Cache'): per layer, a sliding window of raw K = V rows and, on
    CSA / HCA layers, compressed entries that grow by one per closed window. The backend owns every row a
    request keeps between forwards (window tails, open compressor windows, entries); the model pools windows.

    `request_rows[s]`: this process's query rows of request s (in batch order) into every [T, ...] tensor.
    """

    request_rows: tuple[torch.Tensor, ...]

    def window_rows(self, layer_id: int, kv: torch.Tensor) -> list[tuple[torch.Tensor, int]]:
        """kv [T, Dh] (normed, roped) of this batch's rows -> per request (rows [n, Dh], first): its K = V rows of
        positions first..end-1, where first = start - (W - 1): every key its new queries' windows (p-W, p] hold."""

    def compressed_entries(self, layer_id: int, compressor, table, kv: torch.Tensor,
                           gate: torch.Tensor) -> list[torch.Tensor]:
        """This batch's projected rows kv, gate [T, C] of `compressor` (a `WindowCompressor`; `table` its RoPE)
        -> per request, every entry of its windows closed by the end of this batch [n_s, width]."""

    def routed_experts(self, layer_id: int, x, expert_ids, weights, experts) -> torch.Tensor:
        """Σ_k weights · expert_k(x) over every routed expert, wherever it is held (as the DSA contract's)."""
