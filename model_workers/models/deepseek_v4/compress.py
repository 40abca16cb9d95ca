"""DeepSeek-V4's compressors (docs/models.md, 'Attention and compressors'): HCA, CSA and the lightning indexer.

Every closed window w of m tokens (positions w·m .. w·m+m-1, aligned to absolute positions) becomes one entry:
a per-channel softmax over its slots of `gate + position_bias` weighting the projected rows, RMS-normed,
RoPE'd (compress table) at position w·m. A query at position p sees entry w iff w < (p+1) // m.
* HCA (rate m'): the slots are the window's own m rows.
* CSA (rate m, overlapping): each row projects to 2W; its first half (Ca) belongs to the next window, its second
  (Cb) to its own, so entry w pools Ca of window w-1 and Cb of window w (2m slots; before window 0: none).
  The lightning indexer's keys come from a CSA compressor of its own width.

A compressor keeps no state of its own: `project` gives each token's (kv, gate) rows and `entries` pools whole
windows. The caller keeps the rows of the window still open until it closes and, for CSA, the rows of the
last closed window (`lookback_windows`): it passes them again with the next rows and drops the entries it
already has. Chunked prefill, decode, preemption and speculative rollback only have to keep or drop rows.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from model_workers.models.common.layers import RMSNorm
from model_workers.models.common.linear import Linear
from model_workers.models.common.rope import RotaryTable, rotate_pairs
from model_workers.models.deepseek_v4.config import CSA, HCA, V4Config


class WindowCompressor(nn.Module):
    """What both compressors share: projections to `halves` · width, the position bias, the norm and the
    pooling of whole windows into RoPE'd entries."""

    lookback_windows = 0  # closed windows before the first new one whose rows `entries` must see again
    state_name = "compressor"  # what the backend files this compressor's rows and entries under

    def __init__(self, config: V4Config, rate: int, width: int, halves: int):
        super().__init__()
        self.rate, self.width, self.rope_dim = rate, width, config.qk_rope_head_dim
        self.kv_proj = Linear(config.hidden_size, halves * width, bias=False)
        self.gate_proj = Linear(config.hidden_size, halves * width, bias=False)
        self.position_bias = nn.Parameter(torch.empty(rate, halves * width, dtype=torch.float32))
        self.kv_norm = RMSNorm(width, config.rms_norm_eps)

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, D] (the attention input) -> (kv, gate [T, halves·width]) rows, one per token."""
        return self.kv_proj(x), self.gate_proj(x)

    def windows(self, kv: torch.Tensor, gate: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Whole windows' rows [n·m, C] -> (kv [n, m, C], gate + position bias [n, m, C])."""
        if kv.shape[0] % self.rate:
            raise ValueError(f"{kv.shape[0]} rows are not whole windows of {self.rate}")
        num_windows, channels = kv.shape[0] // self.rate, kv.shape[-1]
        kv = kv.view(num_windows, self.rate, channels)
        return kv, gate.view(num_windows, self.rate, channels) + self.position_bias

    def pool(self, kv: torch.Tensor, gate: torch.Tensor, first_window: int, table: RotaryTable) -> torch.Tensor:
        """Slots kv, gate [n, S, width] of windows first_window.. -> entries [n, width]."""
        weights = gate.softmax(dim=1, dtype=torch.float32)  # per channel over the slots
        pooled = self.kv_norm((kv * weights.to(kv.dtype)).sum(dim=1))  # [n, width]
        positions = (torch.arange(kv.shape[0], device=kv.device) + first_window) * self.rate
        cos, sin = table.for_positions(positions)
        nope, rope = pooled[:, : -self.rope_dim], pooled[:, -self.rope_dim :]
        return torch.cat([nope, rotate_pairs(rope, cos, sin)], dim=-1)


class HCACompressor(WindowCompressor):
    def __init__(self, config: V4Config):
        super().__init__(config, config.compress_rates[HCA], config.head_dim, halves=1)

    def entries(self, kv: torch.Tensor, gate: torch.Tensor, first_window: int, table: RotaryTable) -> torch.Tensor:
        """Rows of whole windows first_window, first_window+1, ... (kv, gate [n·m', Dh]) -> entries [n, Dh]."""
        return self.pool(*self.windows(kv, gate), first_window, table)


class CSACompressor(WindowCompressor):
    lookback_windows = 1  # entry w reads the Ca half of window w-1

    def __init__(self, config: V4Config, width: int | None = None, with_indexer: bool = False):
        """width: Dh for the attention's entries, index_head_dim for the lightning indexer's keys; the attention's
        compressor owns the indexer (`compressor.indexer`, as the checkpoint names it)."""
        super().__init__(config, config.compress_rates[CSA], width or config.head_dim, halves=2)
        if with_indexer:
            self.indexer = LightningIndexer(config)

    def entries(self, kv: torch.Tensor, gate: torch.Tensor, first_window: int, table: RotaryTable) -> torch.Tensor:
        """Rows of whole windows (kv, gate [n·m, 2W]) -> entries [n, W]; window first_window's Ca slots are empty
        (pass the rows from one window earlier and drop the first entry to fill them)."""
        kv, gate = self.windows(kv, gate)  # [n, m, 2W]
        num_windows, width, m = kv.shape[0], self.width, self.rate
        slots_kv = kv.new_zeros((num_windows, 2 * m, width))
        slots_gate = gate.new_full((num_windows, 2 * m, width), float("-inf"))
        slots_kv[:, m:], slots_gate[:, m:] = kv[..., width:], gate[..., width:]  # Cb: its own window
        slots_kv[1:, :m], slots_gate[1:, :m] = kv[:-1, :, :width], gate[:-1, :, :width]  # Ca of the window before
        return self.pool(slots_kv, slots_gate, first_window, table)


class IndexerScorer(nn.Module):
    def __init__(self, config: V4Config):
        super().__init__()
        self.weights_proj = Linear(config.hidden_size, config.index_n_heads, bias=False)


class LightningIndexer(CSACompressor):
    """The CSA layer's lightning indexer: a CSA compressor at index_head_dim (its keys) plus the query side.
    Score I(p, w) = Σ_h w_h · ReLU(q_h · K_w) · d^-½, with w = weights_proj(x) · H^-½ and q from the normed
    q-lora."""

    timed_methods = {"select": "indexer", "queries": "indexer"}  # model_workers/phase_clock.py
    state_name = "indexer"

    def __init__(self, config: V4Config):
        super().__init__(config, width=config.index_head_dim)
        self.num_heads, self.topk = config.index_n_heads, config.index_topk
        self.q_b_proj = Linear(config.q_lora_rank, self.num_heads * self.width, bias=False)
        self.scorer = IndexerScorer(config)

    def queries(self, x: torch.Tensor, q_residual: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """x [T, D], q_residual [T, Q] -> (q [T, H_I, d_I] roped at the query positions, weights [T, H_I] fp32)."""
        q = self.q_b_proj(q_residual).view(x.shape[0], self.num_heads, self.width)
        q = torch.cat([q[..., : -self.rope_dim], rotate_pairs(q[..., -self.rope_dim :], cos, sin)], dim=-1)
        return q, self.scorer.weights_proj(x).float() * self.num_heads**-0.5

    def select(self, q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, positions: torch.Tensor):
        """One request's queries (q [t, H_I, d_I], weights [t, H_I], positions [t]) over its keys [n, d_I] ->
        entry ids [t, min(topk, n)] by score, -1 where the pick is not yet visible."""
        scores = F.relu(torch.einsum("thd,nd->thn", q.float(), keys.float())) * self.width**-0.5  # [t, H_I, n]
        scores = (scores * weights.unsqueeze(-1)).sum(dim=1)  # [t, n]
        visible = visible_entries(positions, keys.shape[0], self.rate)
        picked = scores.masked_fill(~visible, float("-inf")).topk(min(self.topk, keys.shape[0]), dim=-1).indices
        threshold = ((positions + 1) // self.rate)[:, None]
        return torch.where(picked < threshold, picked, -1)


def visible_entries(positions: torch.Tensor, num_entries: int, rate: int) -> torch.Tensor:
    """[T, num_entries] bool: query at position p sees compressed entry w iff w < (p + 1) // rate."""
    return torch.arange(num_entries, device=positions.device)[None, :] < ((positions + 1) // rate)[:, None]
