"""DeepSeek-V4's compressors (../shared/deepseek_v4.md sections 2.6, 2.7): HCA and CSA.

Every closed window w of m tokens (positions w·m .. w·m+m-1, aligned to absolute positions) becomes one entry:
a per-channel softmax over its slots of `gate + position_bias` weighting the projected rows, RMS-normed,
RoPE'd (compress table) at position w·m. A query at position p sees entry w iff w < (p+1) // m.
* HCA (rate m'): the slots are the window's own m rows.
* CSA (rate m, overlapping): each row projects to 2W; its first half (Ca) belongs to the next window, its second
  (Cb) to its own, so entry w pools Ca of window w-1 and Cb of window w (2m slots; before window 0: none).
  The lightning indexer's keys come from a CSA compressor of its own width.

A compressor keeps no state of its own: `project` gives each token's (kv, gate) rows, and the caller keeps the
rows of the window still open (fewer than m) until it closes, plus for CSA the Ca half of the last closed
window, so chunked prefill, decode, preemption and speculative rollback only have to keep or drop rows.
"""

from __future__ import annotations

import torch
from torch import nn

from model_workers.model.layers import RMSNorm
from model_workers.model.rope import RotaryTable, rotate_pairs
from model_workers.model.v4_config import CSA, HCA, V4Config


class WindowCompressor(nn.Module):
    """What both compressors share: projections to `slots_per_row` · width, the position bias, the norm and the
    pooling of whole windows into RoPE'd entries."""

    def __init__(self, config: V4Config, rate: int, width: int, halves: int):
        super().__init__()
        self.rate, self.width, self.rope_dim = rate, width, config.qk_rope_head_dim
        self.kv_proj = nn.Linear(config.hidden_size, halves * width, bias=False)
        self.gate_proj = nn.Linear(config.hidden_size, halves * width, bias=False)
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
    def __init__(self, config: V4Config, width: int | None = None):
        """width: Dh for the attention's entries, index_head_dim for the lightning indexer's keys."""
        super().__init__(config, config.compress_rates[CSA], width or config.head_dim, halves=2)

    def entries(self, kv: torch.Tensor, gate: torch.Tensor, first_window: int, table: RotaryTable,
                previous: tuple[torch.Tensor, torch.Tensor] | None = None):
        """Rows of whole windows (kv, gate [n·m, 2W]) and `previous`: the Ca half (kv, gate + bias [m, W]) of
        window first_window - 1, None before window 0 -> (entries [n, W], the Ca half of the last window)."""
        kv, gate = self.windows(kv, gate)  # [n, m, 2W]
        num_windows, width, m = kv.shape[0], self.width, self.rate
        slots_kv = kv.new_zeros((num_windows, 2 * m, width))
        slots_gate = gate.new_full((num_windows, 2 * m, width), float("-inf"))
        slots_kv[:, m:], slots_gate[:, m:] = kv[..., width:], gate[..., width:]  # Cb: its own window
        slots_kv[1:, :m], slots_gate[1:, :m] = kv[:-1, :, :width], gate[:-1, :, :width]  # Ca of the window before
        if previous is not None and num_windows:
            slots_kv[0, :m], slots_gate[0, :m] = previous
        last = (kv[-1, :, :width], gate[-1, :, :width]) if num_windows else previous
        return self.pool(slots_kv, slots_gate, first_window, table), last


def visible_entries(positions: torch.Tensor, num_entries: int, rate: int) -> torch.Tensor:
    """[T, num_entries] bool: query at position p sees compressed entry w iff w < (p + 1) // rate."""
    return torch.arange(num_entries, device=positions.device)[None, :] < ((positions + 1) // rate)[:, None]
