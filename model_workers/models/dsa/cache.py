"""The DSA family's paged KV cache on one rank: fixed-size pages addressed through the page tables the engine's
scheduler hands out (model_workers/page_table.py).

Per cache layer (target layers, then MTP layers) the cache holds the MLA latent c_kv ‖ k_pe and, on
layers that run an indexer, the indexer key, each in its storage format (plain bf16 / fp32 rows, or the FP8
layout: docs/kv_cache.md). Every layer uses the same slot for the same token, so one page table serves all.
"""

from __future__ import annotations

import torch

from model_workers.kernels.interface import KeyFormat
from model_workers.kv_format import key_formats
from model_workers.page_table import PageTable, check_page_room


class PagedKVCache:
    """Per cache layer: `latent[layer]` [slots, latent_format.width] and `index_keys[layer]` [slots,
    index_format.width] (None on layers without an indexer), in their formats' storage dtypes (kv_format.py).
    Keys enter encoded (`encode`, on the rank that computed them) and leave decoded, row by gathered row."""

    def __init__(
        self,
        num_pages: int,
        page_size: int,
        latent_format: KeyFormat,
        index_format: KeyFormat,
        indexed_layers: list[bool],
        device: torch.device | str = "cpu",
    ):
        if num_pages <= 0:
            raise ValueError(f"num_pages={num_pages}: must be positive")
        self.num_pages, self.page_size = num_pages, page_size
        self.latent_format, self.index_format = latent_format, index_format
        slots = num_pages * page_size
        self.latent = [self._store(slots, latent_format, device) for _ in indexed_layers]
        self.index_keys = [self._store(slots, index_format, device) if has_index else None
                           for has_index in indexed_layers]

    @staticmethod
    def _store(slots: int, key_format: KeyFormat, device) -> torch.Tensor:
        return torch.zeros(slots, key_format.width, dtype=key_format.store_dtype, device=device)

    @property
    def num_slots(self) -> int:
        return self.latent[0].shape[0]

    def check_room(self, table: PageTable, num_tokens: int) -> None:
        """The plan's contract: `table` has pages (on this cache) for positions 0..num_tokens-1."""
        check_page_room(table, num_tokens, self.page_size, self.num_pages)

    def release(self, key) -> None:
        """Nothing to drop: a request's keys live in its pages only (the scheduler frees them)."""

    def snapshot_state(self, table: PageTable, end: int) -> None:
        """Nothing to keep: a cached page holds everything a later request reads back (prefix caching)."""

    def drop_snapshots(self, pages) -> None:
        """No snapshots are kept."""

    def clear_states(self) -> None:
        """No per-request state is kept."""

    def page_stores(self) -> list[tuple[torch.Tensor, int]]:
        """Every paged store with its rows per page (a prefill/decode hand-off copies a request's pages of each)."""
        return [(t, self.page_size) for t in self.latent + self.index_keys if t is not None]

    def export_state(self, key) -> None:
        """No per-request state besides the pages."""

    def import_state(self, key, state) -> None:
        """No per-request state besides the pages."""

    def encode(self, latent: torch.Tensor, index_key: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Computed keys latent [T, C + R], index_key [T, D_idx] or None -> their stored rows (quantized under FP8)."""
        return self.latent_format.encode(latent), None if index_key is None else self.index_format.encode(index_key)

    def write(self, layer_id: int, slots: torch.Tensor, latent_rows: torch.Tensor, index_rows: torch.Tensor | None):
        """Stores encoded rows [W, width] at `slots` [W]."""
        self.latent[layer_id][slots] = latent_rows
        if index_rows is not None:
            self.index_keys[layer_id][slots] = index_rows

    def rows(self, table: PageTable) -> dict[str, list[torch.Tensor | None]]:
        """The stored rows of positions 0..num_tokens-1 per cache layer, as the cache holds them (FP8: bytes):
        latent [n, latent width] and index key [n, index width] (None on layers without an indexer)."""
        slots = table.slots(0, table.num_tokens, self.page_size).to(self.latent[0].device)  # [n]
        return {
            "latent": [layer[slots].cpu() for layer in self.latent],
            "index_keys": [None if layer is None else layer[slots].cpu() for layer in self.index_keys],
        }

    def bytes_per_token(self) -> int:
        """Bytes one token occupies over every cache layer, read off the allocated stores."""
        stores = [t for t in self.latent + self.index_keys if t is not None]
        return sum(t.shape[1] * t.element_size() for t in stores)


def make_cache(config, num_mtp_layers: int, num_pages: int, page_size: int, weights_dtype: torch.dtype,
               kv_cache_dtype: str, kernels, device) -> PagedKVCache:
    """The DSA cache of one rank: every target layer (an indexer key on 'full' layers) and every MTP layer (which
    always runs its own indexer), in the key formats of `kv_cache_dtype` from the kernel set's row codecs."""
    indexed = [t == "full" for t in config.indexer_types] + [True] * num_mtp_layers
    latent_format, index_format = key_formats(kv_cache_dtype, weights_dtype, config.kv_lora_rank,
                                              config.qk_rope_head_dim, config.index_head_dim, kernels.rows)
    return PagedKVCache(num_pages, page_size, latent_format, index_format, indexed, device)
