"""DeepSeek-V4's heavily compressed attention (HCA) compressor (../shared/deepseek_v4.md section 2.6).

Every closed window w of m' tokens (positions w·m' .. w·m'+m'-1, aligned to absolute positions) becomes one
K = V entry: a per-channel softmax over the window of `gate + position_bias` weighting the projected rows,
RMS-normed, RoPE'd (compress table) at position w·m'. A query at position p sees entry w iff w < (p+1) // m'.

The compressor keeps no state of its own: `project` gives each token's (kv, gate) rows, and the caller keeps
the rows of the window still open (fewer than m') until it closes, so chunked prefill, decode, preemption and
speculative rollback only have to keep or drop rows.
"""

from __future__ import annotations

import torch
from torch import nn

from model_workers.model.layers import RMSNorm
from model_workers.model.rope import RotaryTable, rotate_pairs
from model_workers.model.v4_config import HCA, V4Config


class HCACompressor(nn.Module):
    def __init__(self, config: V4Config):
        super().__init__()
        self.rate, self.rope_dim = config.compress_rates[HCA], config.qk_rope_head_dim
        self.kv_proj = nn.Linear(config.hidden_size, config.head_dim, bias=False)
        self.gate_proj = nn.Linear(config.hidden_size, config.head_dim, bias=False)
        self.position_bias = nn.Parameter(torch.empty(self.rate, config.head_dim, dtype=torch.float32))
        self.kv_norm = RMSNorm(config.head_dim, config.rms_norm_eps)

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, D] (the attention input) -> (kv [T, Dh], gate [T, Dh]) rows, one per token."""
        return self.kv_proj(x), self.gate_proj(x)

    def entries(self, kv: torch.Tensor, gate: torch.Tensor, first_window: int, table: RotaryTable) -> torch.Tensor:
        """Rows of whole windows first_window, first_window+1, ... (kv, gate [n·m', Dh]) -> entries [n, Dh]."""
        if kv.shape[0] % self.rate:
            raise ValueError(f"{kv.shape[0]} rows are not whole windows of {self.rate}")
        num_windows, head_dim = kv.shape[0] // self.rate, kv.shape[-1]
        kv = kv.view(num_windows, self.rate, head_dim)
        weights = (gate.view(num_windows, self.rate, head_dim) + self.position_bias).softmax(dim=1, dtype=torch.float32)
        pooled = self.kv_norm((kv * weights.to(kv.dtype)).sum(dim=1))  # [n, Dh]
        positions = (torch.arange(num_windows, device=kv.device) + first_window) * self.rate
        cos, sin = table.for_positions(positions)
        nope, rope = pooled[:, : -self.rope_dim], pooled[:, -self.rope_dim :]
        return torch.cat([nope, rotate_pairs(rope, cos, sin)], dim=-1)


def visible_entries(positions: torch.Tensor, num_entries: int, rate: int) -> torch.Tensor:
    """[T, num_entries] bool: query at position p sees compressed entry w iff w < (p + 1) // rate."""
    return torch.arange(num_entries, device=positions.device)[None, :] < ((positions + 1) // rate)[:, None]
