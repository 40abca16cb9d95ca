"""The DeepSeek-V3.2 / GLM-5 mixture of experts: sigmoid scores, grouped top-k routing, shared experts fused."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from model_workers.models.common.layers import MLP, Experts, MoE
from model_workers.models.dsa.config import ModelConfig


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

    def forward(self, x: torch.Tensor, token_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, hidden] -> (expert ids [T, top_k], weights [T, top_k] float32); token ids are not used."""
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


def deepseek_moe(config: ModelConfig, expert_ids: range | None = None) -> MoE:
    """The DeepSeek-V3.2 / GLM-5 MoE layer: grouped sigmoid routing, n_shared_experts fused into one MLP."""
    shared = config.moe_intermediate_size * config.n_shared_experts
    shared_experts = MLP(config.hidden_size, shared) if shared > 0 else None
    return MoE(MoEGate(config), Experts(config, expert_ids), shared_experts)
