"""Norms, the dense SwiGLU MLP, and the DeepSeek mixture of experts (sigmoid routing, grouped top-k)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from model_workers.model.config import ModelConfig


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x_fp32 = x.float()
        normed = x_fp32 * torch.rsqrt(x_fp32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * normed.to(x.dtype)


class MLP(nn.Module):
    """down(silu(gate(x)) * up(x))."""

    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class MoEGate(nn.Module):
    """Sigmoid scores; choice adds `e_score_correction_bias`; groups ranked by their top-2 sum."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(config.n_routed_experts, config.hidden_size, dtype=torch.float32))
        self.register_buffer("e_score_correction_bias", torch.zeros(config.n_routed_experts, dtype=torch.float32))
        self.top_k = config.num_experts_per_tok
        self.n_group, self.topk_group = config.n_group, config.topk_group
        self.norm_topk_prob = config.norm_topk_prob
        self.routed_scaling_factor = config.routed_scaling_factor

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, hidden] -> (expert ids [T, top_k], weights [T, top_k] float32)."""
        scores = F.linear(x.float(), self.weight.float()).sigmoid()  # [T, E]
        choice = scores + self.e_score_correction_bias.float()
        num_tokens, num_experts = choice.shape
        grouped = choice.view(num_tokens, self.n_group, num_experts // self.n_group)
        group_scores = grouped.topk(min(2, grouped.shape[-1]), dim=-1).values.sum(-1)  # [T, G]
        kept_groups = group_scores.topk(self.topk_group, dim=-1, sorted=False).indices
        group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, kept_groups, True)
        expert_mask = group_mask.repeat_interleave(num_experts // self.n_group, dim=1)  # [T, E]
        choice = choice.masked_fill(~expert_mask, float("-inf"))
        expert_ids = choice.topk(self.top_k, dim=-1, sorted=False).indices  # [T, k]
        weights = scores.gather(1, expert_ids)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return expert_ids, weights * self.routed_scaling_factor


class Experts(nn.Module):
    """Routed experts stored stacked: gate_up_proj [E, 2I, hidden], down_proj [E, hidden, I]."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        num, hidden, inner = config.n_routed_experts, config.hidden_size, config.moe_intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(num, 2 * inner, hidden))
        self.down_proj = nn.Parameter(torch.empty(num, hidden, inner))

    def forward(self, x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """x [T, hidden]; expert_ids, weights [T, k] -> Σ_k weight · expert(x) [T, hidden]."""
        out = torch.zeros_like(x)
        flat_ids = expert_ids.reshape(-1)  # [T*k]
        order = flat_ids.argsort(stable=True)
        counts = torch.bincount(flat_ids, minlength=self.gate_up_proj.shape[0]).tolist()
        token_rows = order // expert_ids.shape[1]  # [T*k]
        flat_weights = weights.reshape(-1)[order]
        start = 0
        for expert, count in enumerate(counts):
            if count == 0:
                continue
            rows = token_rows[start : start + count]
            gate, up = F.linear(x[rows], self.gate_up_proj[expert]).chunk(2, dim=-1)
            y = F.linear(F.silu(gate) * up, self.down_proj[expert])  # [n, hidden]
            y = y * flat_weights[start : start + count, None]
            out.index_add_(0, rows, y.to(out.dtype))
            start += count
        return out


class MoE(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.gate = MoEGate(config)
        self.experts = Experts(config)
        shared = config.moe_intermediate_size * config.n_shared_experts
        self.shared_experts = MLP(config.hidden_size, shared) if shared > 0 else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        expert_ids, weights = self.gate(x)
        out = self.experts(x, expert_ids, weights)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out
