"""DeepSeek-V4 attention, the part every layer shares (../shared/deepseek_v4.md section 2.4): the q path
(low rank, weighted then per-head unweighted RMS norm, partial interleaved RoPE), the one shared K = V head,
attention over each query's own key rows with a per-head sink logit, the output's RoPE slice de-rotated at
the query position, and the grouped low-rank output projection.

Which key rows a query sees (its sliding window of raw entries, and the compressed entries of CSA / HCA
layers) is the cache's business; `attend_with_sinks` takes them per query, -padded with a validity mask.
Parameter names follow the checkpoint (`self_attn.q_a_proj`, `self_attn.sinks`, ...).
"""

from __future__ import annotations

import torch
from torch import nn

from model_workers.model.layers import RMSNorm
from model_workers.model.rope import rotate_pairs
from model_workers.model.v4_blocks import unweighted_rms
from model_workers.model.v4_config import V4Config


def attend_with_sinks(q: torch.Tensor, keys: torch.Tensor, valid: torch.Tensor, sinks: torch.Tensor,
                      scale: float) -> torch.Tensor:
    """q [T, H, Dh]; keys [T, K, Dh] each query's key rows (also its values); valid [T, K] bool;
    sinks [H] (a logit per head in the softmax denominator, with no value) -> [T, H, Dh]."""
    logits = torch.einsum("thd,tkd->thk", q.float(), keys.float()) * scale  # [T, H, K]
    logits = logits.masked_fill(~valid[:, None, :], float("-inf"))
    sink = sinks.float()[None, :, None].expand(q.shape[0], -1, 1)  # [T, H, 1]
    combined = torch.cat([logits, sink], dim=-1)
    probs = torch.softmax(combined - combined.max(dim=-1, keepdim=True).values, dim=-1)[..., :-1]  # [T, H, K]
    return torch.einsum("thk,tkd->thd", probs, keys.float()).to(q.dtype)


class V4Attention(nn.Module):
    def __init__(self, config: V4Config):
        super().__init__()
        heads, head_dim, groups = config.num_attention_heads, config.head_dim, config.o_groups
        self.num_heads, self.head_dim, self.rope_dim = heads, head_dim, config.qk_rope_head_dim
        self.o_groups, self.eps, self.scale = groups, config.rms_norm_eps, head_dim**-0.5
        self.q_a_proj = nn.Linear(config.hidden_size, config.q_lora_rank, bias=False)
        self.q_a_norm = RMSNorm(config.q_lora_rank, config.rms_norm_eps)
        self.q_b_proj = nn.Linear(config.q_lora_rank, heads * head_dim, bias=False)
        self.kv_proj = nn.Linear(config.hidden_size, head_dim, bias=False)
        self.kv_norm = RMSNorm(head_dim, config.rms_norm_eps)
        self.o_a_proj = nn.Linear(heads * head_dim // groups, groups * config.o_lora_rank, bias=False)
        self.o_b_proj = nn.Linear(groups * config.o_lora_rank, config.hidden_size, bias=False)
        self.sinks = nn.Parameter(torch.empty(heads, dtype=torch.float32))

    def queries(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, D] (normed) -> (q [T, H, Dh] roped, q_residual [T, Q]: the normed q-lora the indexer reads)."""
        q_residual = self.q_a_norm(self.q_a_proj(x))
        q = unweighted_rms(self.q_b_proj(q_residual).view(x.shape[0], self.num_heads, self.head_dim), self.eps)
        return self._rope(q, cos, sin), q_residual

    def key_values(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [T, D] -> the shared K = V row of each token [T, Dh], normed and roped at its position."""
        return self._rope(self.kv_norm(self.kv_proj(x)), cos, sin)

    def output(self, attended: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """attended [T, H, Dh] -> de-rotate the RoPE slice at the query position -> grouped low-rank -> [T, D]."""
        attended = self._rope(attended, cos, sin, inverse=True)
        num_rows = attended.shape[0]
        grouped = attended.reshape(num_rows, self.o_groups, -1)  # [T, G, (H/G)·Dh]: consecutive heads per group
        weight = self.o_a_proj.weight.view(self.o_groups, -1, grouped.shape[-1])  # [G, R_o, (H/G)·Dh]
        low_rank = torch.einsum("tgi,gri->tgr", grouped, weight).reshape(num_rows, -1)  # [T, G·R_o]
        return self.o_b_proj(low_rank)

    def attend(self, q: torch.Tensor, keys: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        return attend_with_sinks(q, keys, valid, self.sinks, self.scale)

    def _rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False) -> torch.Tensor:
        """RoPE on the trailing `qk_rope_head_dim` channels ([nope | rope]); cos/sin [T, r/2]."""
        nope, rope = x[..., : -self.rope_dim], x[..., -self.rope_dim :]
        return torch.cat([nope, rotate_pairs(rope, cos, sin, inverse)], dim=-1)


def sliding_window_keys(kv: torch.Tensor, positions: torch.Tensor, window: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One request's K = V rows kv [T, Dh] at positions 0..T-1 -> each query's window (p-W, p]:
    keys [T, W, Dh] (slot j = position p-W+1+j) and valid [T, W]."""
    offsets = torch.arange(window, device=kv.device) - (window - 1)  # [W]
    key_positions = positions[:, None] + offsets[None, :]  # [T, W]
    valid = key_positions >= 0
    return kv[key_positions.clamp_min(0)], valid


__all__ = ["V4Attention", "attend_with_sinks", "sliding_window_keys"]
