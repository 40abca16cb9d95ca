"""DeepSeek-V4's cache on one rank (docs/models.md, 'Cache'), in two parts.

* Paged, in the request's pages (what grows with the context): per CSA / HCA layer the compressed entries
  (and the CSA indexer's keys). Entry w of a layer with rate m lives in the page holding position w·m, at
  index (w·m mod page_size) // m of that page's ceil(page_size / m) entry rows, so the scheduler's pages
  account for it and page_size and m must divide one another.
* Per request (bounded, like SGLang's SWA and compressor-state rings): per layer the tail of raw K = V rows
  its sliding window still needs, and per compressor the projected rows of the windows not yet closed (CSA:
  also of the last closed window, whose Ca half the next entry pools). It is filed under the page table's
  `state_key` (the request id on a rank; its first page where a table names none).
* Snapshots for prefix caching: after a prefill chunk the plan marks (`PrefillRequest.snapshot_state`), a copy
  of the request's state is filed under the page that ends there; a later request whose cached prefix ends at that
  page starts from a copy of it (`request`). The engine's scheduler says when a snapshot's page is evicted
  (`drop_snapshots`).

Everything is addressed by absolute position, never by "what came last", so a forward that starts at
position n reads rows before n only: chunked prefill at any boundary, decode, and speculative rollback (the
plan's `num_cached` moves back) are one code path, and rows or entries that rejected drafts wrote are
overwritten. Each tail keeps ROLLBACK_TOKENS positions more than the next forward needs, which bounds how far
a step may roll back. Preemption frees the pages and the next prefill starts at position 0, reading nothing old.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from model_workers.kv_format import plain_kv_dtype
from model_workers.page_table import PageTable, check_page_room
from model_workers.models.deepseek_v4.config import CSA, HCA, V4Config

ROLLBACK_TOKENS = 16  # a step may restart this many positions before the end of what it wrote


class StateLost(RuntimeError):
    """A forward starts at a position whose earlier rows this rank no longer keeps."""


@dataclass
class RowsTail:
    """Rows of consecutive positions start, start + 1, ... (one row per position)."""

    start: int = 0
    rows: torch.Tensor | None = None

    def view(self, first: int, end: int) -> torch.Tensor | None:
        """The kept rows of positions first..end-1 (read only), or None if they are not all kept."""
        kept_end = self.start + (0 if self.rows is None else self.rows.shape[0])
        if self.rows is None or first < self.start or end > kept_end:
            return None
        return self.rows[first - self.start : end - self.start]

    def extend(self, needed_from: int, start: int, new_rows: torch.Tensor, keep_from: int) -> torch.Tensor:
        """Appends new_rows [n, C] of positions start.. (dropping kept rows from start on: rolled back) and
        returns the rows of positions needed_from..start+n-1; afterwards the tail keeps positions from
        max(0, keep_from) on (or from what it has, if later)."""
        kept_end = self.start + (0 if self.rows is None else self.rows.shape[0])
        if needed_from < start and (needed_from < self.start or start > kept_end):
            raise StateLost(f"rows of positions {needed_from}..{start - 1} are needed; this rank keeps "
                            f"{self.start}..{kept_end - 1} (a rollback deeper than {ROLLBACK_TOKENS} tokens?)")
        contiguous = self.rows is not None and self.start <= start <= kept_end  # kept rows run up to `start`
        read_from = min(needed_from, max(keep_from, self.start)) if contiguous else needed_from
        history = self.rows[read_from - self.start : start - self.start] if read_from < start else new_rows[:0]
        rows = torch.cat([history, new_rows])  # positions read_from .. start + n - 1
        drop = max(0, keep_from - read_from)
        self.start, self.rows = read_from + drop, rows[drop:].clone()
        return rows[needed_from - read_from :]


@dataclass
class CompressedState:
    rows: RowsTail = field(default_factory=RowsTail)  # projected kv ‖ gate [n, 2C] of recent positions


class V4Cache:
    def __init__(self, config: V4Config, num_pages: int, page_size: int, num_mtp_layers: int = 0,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"):
        if num_pages <= 0:
            raise ValueError(f"num_pages={num_pages}: must be positive")
        self.config, self.num_pages, self.page_size = config, num_pages, page_size
        self.num_mtp_layers, self.dtype, self.device = num_mtp_layers, dtype, torch.device(device)
        self.states: dict = {}  # state key -> {(layer_id, name): RowsTail | CompressedState}
        self.snapshots: dict[int, dict] = {}  # page -> a request's state at that page's end (prefix caching)
        self.entries: dict[tuple[int, str], torch.Tensor] = {}  # (layer, "compressor" | "indexer") -> rows
        for layer_id, layer_type in enumerate(config.layer_types):
            if layer_type in (CSA, HCA):
                rate = config.compress_rates[layer_type]
                if page_size % rate and rate % page_size:
                    raise ValueError(f"page_size={page_size} and the {layer_type} rate {rate} must divide one "
                                     f"another (the compressed entries are paged)")
                rows = num_pages * max(1, page_size // rate)
                self.entries[(layer_id, "compressor")] = torch.zeros(rows, config.head_dim, dtype=dtype, device=device)
                if layer_type == CSA:
                    self.entries[(layer_id, "indexer")] = torch.zeros(rows, config.index_head_dim, dtype=dtype,
                                                                      device=device)

    def entry_slots(self, table: PageTable, rate: int, first: int, count: int) -> torch.Tensor:
        """Rows of entries first..first+count-1 (of a layer with this rate) in the entry store, [count] int64."""
        starts = (torch.arange(first, first + count) * rate)  # the window's first position
        pages = torch.tensor(table.pages, dtype=torch.long)[starts // self.page_size]
        slots = pages * max(1, self.page_size // rate) + (starts % self.page_size) // rate
        return slots.to(next(iter(self.entries.values())).device)

    def write_entries(self, table: PageTable, layer_id: int, name: str, first: int, rows: torch.Tensor) -> None:
        store = self.entries[(layer_id, name)]
        store[self.entry_slots(table, self.config.compress_rate(layer_id), first, rows.shape[0])] = rows.to(store.dtype)

    def read_entries(self, table: PageTable, layer_id: int, name: str, count: int) -> torch.Tensor:
        """Entries 0..count-1 of the request [count, width] (gathered from its pages)."""
        store = self.entries[(layer_id, name)]
        return store[self.entry_slots(table, self.config.compress_rate(layer_id), 0, count)]

    def check_room(self, table: PageTable, num_tokens: int) -> None:
        """The plan's contract, as for the paged cache: `table` has pages for positions 0..num_tokens-1."""
        check_page_room(table, num_tokens, self.page_size, self.num_pages)

    def request(self, table: PageTable) -> dict:
        """The state of the request whose page table this is: kept from its earlier forwards, else a copy of the
        snapshot at the end of its cached prefix (a prefix-cache hit), else empty (its first forward)."""
        if not table.pages:
            raise ValueError("a V4 request needs at least one page")
        key = state_key(table)
        if key not in self.states:
            done = table.num_tokens // self.page_size
            snapshot = self.snapshots.get(table.pages[done - 1]) if done and not table.num_tokens % self.page_size \
                else None
            self.states[key] = {} if snapshot is None else copy_state(snapshot)
        return self.states[key]

    def release(self, key) -> None:
        """Drops the state kept under `key` (a request id; no-op if none is kept)."""
        self.states.pop(key, None)

    def snapshot_state(self, table: PageTable, end: int) -> None:
        """Files a copy of the request's state (its last forward ended at `end`, a page boundary) under the page
        that ends there."""
        self.snapshots[table.pages[end // self.page_size - 1]] = copy_state(self.states.get(state_key(table), {}))

    def drop_snapshots(self, pages) -> None:
        for page in pages:
            self.snapshots.pop(page, None)

    def clear_states(self) -> None:
        """Every request's state and every snapshot (the engine restarted its requests)."""
        self.states.clear()
        self.snapshots.clear()

    def page_stores(self) -> list[tuple[torch.Tensor, int]]:
        """Every paged store (the compressed entries and indexer keys) with its rows per page."""
        return [(store, max(1, self.page_size // self.config.compress_rate(layer_id)))
                for (layer_id, _), store in self.entries.items()]

    def export_state(self, key) -> dict:
        """A copy of the bounded state kept under `key` (window tails, open compressor windows): a hand-off."""
        return copy_state(self.states.get(key, {}), "cpu")

    def import_state(self, key, state: dict) -> None:
        """Files `state` (from `export_state` on another rank) as the state of `key`."""
        self.states[key] = copy_state(state, self.device)

    def rows(self, table: PageTable) -> dict[str, list[torch.Tensor | None]]:
        """What the request keeps for positions 0..num_tokens-1, per layer (MTP layers last in `window`): the
        window's K = V rows of its last W - 1 positions, the compressed entries and the CSA indexer keys (None
        where a layer has none)."""
        state, n = self.states.get(state_key(table), {}), table.num_tokens
        out = {"window": [], "entries": [], "index_keys": []}
        for layer_id in range(self.config.num_hidden_layers + self.num_mtp_layers):
            tail = state.get((layer_id, "window"))
            first = max(0, n - (self.config.sliding_window - 1))
            out["window"].append(None if tail is None else tail.view(first, n).cpu())
            if layer_id >= self.config.num_hidden_layers:
                continue
            rate = self.config.compress_rate(layer_id)
            for name, key in (("compressor", "entries"), ("indexer", "index_keys")):
                has = (layer_id, name) in self.entries
                out[key].append(self.read_entries(table, layer_id, name, n // rate).cpu() if has else None)
        return out

    def stored_bytes(self, table: PageTable) -> dict[str, dict[str, int]]:
        """Bytes this rank keeps for the request, per layer type ("mtp" for MTP layers): `entries` (compressed
        entries and indexer keys valid for its num_tokens positions: what grows with the context) and `state`
        (window tails and compressor rows: bounded)."""
        state, n = self.states.get(state_key(table), {}), table.num_tokens
        out: dict[str, dict[str, int]] = {}
        for (layer_id, name), kept in state.items():
            kind = self.config.layer_types[layer_id] if layer_id < self.config.num_hidden_layers else "mtp"
            part = out.setdefault(kind, {"entries": 0, "state": 0})
            part["state"] += _nbytes(kept.rows if isinstance(kept, RowsTail) else kept.rows.rows)
            store = self.entries.get((layer_id, name))
            if store is not None:  # the valid entries' rows
                part["entries"] += n // self.config.compress_rate(layer_id) * store.shape[1] * store.element_size()
        return out

    def bytes_per_token(self) -> float:
        """Amortised bytes one more token of context costs (the growing compressed entries); the bounded
        per-request part is `request_bytes`."""
        return bytes_per_token(self.config, self.dtype.itemsize)

    def request_bytes(self) -> int:
        """Bytes of the bounded per-request state: window tails and open-window rows, at most."""
        return request_bytes(self.config, self.num_mtp_layers, self.dtype.itemsize)


def state_key(table: PageTable):
    return table.state_key if table.state_key is not None else table.pages[0]


def copy_state(state: dict, device: torch.device | str | None = None) -> dict:
    """A copy of a request's state that later forwards of either may change without touching the other (on
    `device`, else where it is)."""
    out = {}
    for name, kept in state.items():
        tail = kept if isinstance(kept, RowsTail) else kept.rows
        copied = RowsTail(tail.start, None if tail.rows is None else tail.rows.to(device, copy=True))
        out[name] = copied if isinstance(kept, RowsTail) else CompressedState(copied)
    return out


def _nbytes(tensor: torch.Tensor | None) -> int:
    return 0 if tensor is None else tensor.numel() * tensor.element_size()


def bytes_per_token(config: V4Config, element_size: int) -> float:
    """Σ over CSA layers of (Dh + d_I) / m, plus Σ over HCA layers of Dh / m', times the element size."""
    per_token = 0.0
    for layer_type in config.layer_types:
        if layer_type == CSA:
            per_token += (config.head_dim + config.index_head_dim) / config.compress_rates[CSA]
        elif layer_type == HCA:
            per_token += config.head_dim / config.compress_rates[HCA]
    return per_token * element_size


def gather_bytes_per_token(config: V4Config, num_mtp_layers: int, element_size: int) -> int:
    """What CP prefill all-gathers per token: every layer's K = V row (Dh, MTP layers included) and the
    compressors' projected kv ‖ gate rows (CSA: 2·2·Dh + 2·2·d_I with its indexer; HCA: 2·Dh)."""
    values = (config.num_hidden_layers + num_mtp_layers) * config.head_dim
    for layer_type in config.layer_types:
        if layer_type == CSA:
            values += 4 * (config.head_dim + config.index_head_dim)
        elif layer_type == HCA:
            values += 2 * config.head_dim
    return values * element_size


def request_bytes(config: V4Config, num_mtp_layers: int, element_size: int) -> int:
    """Window tails (W - 1 + rollback rows of Dh per layer, MTP included) and compressor rows (CSA: two windows
    of 2·(2·Dh) and 2·(2·d_I); HCA: one window of 2·Dh, each plus the rollback rows)."""
    window = config.sliding_window - 1 + ROLLBACK_TOKENS
    values = (config.num_hidden_layers + num_mtp_layers) * window * config.head_dim
    for layer_type in config.layer_types:
        if layer_type == CSA:
            rows = 2 * config.compress_rates[CSA] + ROLLBACK_TOKENS
            values += rows * 4 * (config.head_dim + config.index_head_dim)
        elif layer_type == HCA:
            values += (config.compress_rates[HCA] + ROLLBACK_TOKENS) * 2 * config.head_dim
    return values * element_size



def prefix_hit_rule(config: V4Config, page_size: int) -> tuple[int, bool]:
    """Prefix-cache hits end where every compressed window is closed and the entry rows of a page are the page's
    own (a multiple of the page size and of every compress rate), and only where the ranks snapshotted the bounded
    per-request state (module docstring)."""
    return math.lcm(page_size, *config.compress_rates.values()), True


def make_cache(config: V4Config, num_mtp_layers: int, num_pages: int, page_size: int, weights_dtype: torch.dtype,
               kv_cache_dtype: str, kernels, device) -> V4Cache:
    """V4's cache of one rank, its entries and rows in the float dtype of `kv_cache_dtype` (no FP8 layout yet)."""
    return V4Cache(config, num_pages, page_size, num_mtp_layers, plain_kv_dtype(kv_cache_dtype, weights_dtype), device)
