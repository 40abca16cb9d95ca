"""DeepSeek-V4 building blocks (docs/models.md, 'Hyper-connections'): the mHC residual streams
(`HyperConnection`, `HyperHead`) and the MoE layer (sqrt-softplus learned routing, or hash routing through
`tid2eid` on the first layers; clamped SwiGLU experts). Rows are this process's tokens: streams [T, N, D].

The MoE layer is the family's `MoE` (layers.py) with a V4 gate, so expert parallelism reaches it unchanged;
hash routing reads the token id of every row, which the caller passes with the rows.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from model_workers.models.common.layers import MLP, Experts, MoE
from model_workers.models.deepseek_v4.config import HASH_MOE, V4Config


def unweighted_rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x · rsqrt(mean(x²) + eps) over the last dim, the statistic in float32."""
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)


class HyperConnection(nn.Module):
    """One mHC site (`attn_hc` / `ffn_hc`): collapse the N streams into a block's input, and the weights that
    expand the block's output back (`post`) and mix the residual streams (`comb`, doubly stochastic)."""

    def __init__(self, config: V4Config):
        super().__init__()
        n = config.hc_mult
        self.hc_mult, self.iters = n, config.hc_sinkhorn_iters
        self.hc_eps, self.rms_eps = config.hc_eps, config.rms_norm_eps
        self.fn = nn.Parameter(torch.empty((2 + n) * n, n * config.hidden_size, dtype=torch.float32))
        self.base = nn.Parameter(torch.empty((2 + n) * n, dtype=torch.float32))
        self.scale = nn.Parameter(torch.empty(3, dtype=torch.float32))

    def forward(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """streams [T, N, D] -> (post [T, N] fp32, comb [T, N, N] fp32, collapsed [T, D])."""
        n = self.hc_mult
        mix = F.linear(unweighted_rms(streams.flatten(1).float(), self.rms_eps), self.fn.float())  # [T, (2+N)N]
        pre_w, post_w, comb_w = mix.split([n, n, n * n], dim=-1)
        pre_b, post_b, comb_b = self.base.split([n, n, n * n])
        pre = torch.sigmoid(pre_w * self.scale[0] + pre_b) + self.hc_eps  # [T, N]
        post = 2 * torch.sigmoid(post_w * self.scale[1] + post_b)  # [T, N]
        comb = torch.softmax(comb_w.view(-1, n, n) * self.scale[2] + comb_b.view(n, n), dim=-1) + self.hc_eps
        comb = comb / (comb.sum(dim=-2, keepdim=True) + self.hc_eps)  # columns first
        for _ in range(self.iters - 1):
            comb = comb / (comb.sum(dim=-1, keepdim=True) + self.hc_eps)
            comb = comb / (comb.sum(dim=-2, keepdim=True) + self.hc_eps)
        collapsed = (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)  # [T, D]
        return post, comb, collapsed


def expand_streams(post: torch.Tensor, comb: torch.Tensor, block_out: torch.Tensor,
                   streams: torch.Tensor) -> torch.Tensor:
    """X'_k = post_k · y + Σ_j comb[j, k] · X_j: post [T, N], comb [T, N, N], y [T, D], X [T, N, D] -> [T, N, D]."""
    dtype = streams.dtype
    return post.to(dtype).unsqueeze(-1) * block_out.unsqueeze(-2) + comb.to(dtype).transpose(-1, -2) @ streams


class HyperHead(nn.Module):
    """The final collapse of the N streams (`hc_head`): sigmoid weights, no Sinkhorn. [T, N, D] -> [T, D]."""

    def __init__(self, config: V4Config):
        super().__init__()
        n = config.hc_mult
        self.hc_eps, self.rms_eps = config.hc_eps, config.rms_norm_eps
        self.hc_fn = nn.Parameter(torch.empty(n, n * config.hidden_size, dtype=torch.float32))
        self.hc_base = nn.Parameter(torch.empty(n, dtype=torch.float32))
        self.hc_scale = nn.Parameter(torch.empty(1, dtype=torch.float32))

    def forward(self, streams: torch.Tensor) -> torch.Tensor:
        mix = F.linear(unweighted_rms(streams.flatten(1).float(), self.rms_eps), self.hc_fn.float())  # [T, N]
        pre = torch.sigmoid(mix * self.hc_scale.float() + self.hc_base.float()) + self.hc_eps
        return (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)


class V4Gate(nn.Module):
    """Scores sqrt(softplus(x · W)); experts by top-k of scores + e_score_correction_bias (learned layers) or
    `tid2eid[token_id]` (hash layers); weights = the chosen scores renormalised, × routed_scaling_factor."""

    def __init__(self, config: V4Config, hashed: bool):
        super().__init__()
        self.top_k, self.hashed = config.num_experts_per_tok, hashed
        self.routed_scaling_factor = config.routed_scaling_factor
        self.weight = nn.Parameter(torch.empty(config.n_routed_experts, config.hidden_size))
        if hashed:
            self.register_buffer("tid2eid", torch.zeros(config.vocab_size, self.top_k, dtype=torch.long))
        else:
            self.register_buffer("e_score_correction_bias", torch.zeros(config.n_routed_experts, dtype=torch.float32))

    def forward(self, x: torch.Tensor, token_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, hidden], token_ids [T] -> (expert ids [T, k], weights [T, k] float32)."""
        scores = F.softplus(F.linear(x.float(), self.weight.float())).sqrt()  # [T, E]
        if self.hashed:
            if token_ids is None or token_ids.shape[0] != x.shape[0]:
                raise ValueError("a hash-routed MoE layer needs the token id of every row")
            expert_ids = self.tid2eid[token_ids].long()  # [T, k]
        else:
            expert_ids = (scores + self.e_score_correction_bias.float()).topk(self.top_k, dim=-1, sorted=False).indices
        weights = scores.gather(1, expert_ids)
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return expert_ids, weights * self.routed_scaling_factor


def v4_moe(config: V4Config, layer_id: int, expert_ids: range | None = None) -> MoE:
    """The MoE of main layer `layer_id` (hash-routed per `mlp_layer_types`; MTP layers, `layer_id` >= the main
    stack, are never hash-routed): routed experts and the one shared expert with the SwiGLU clamp."""
    hashed = layer_id < config.num_hidden_layers and config.mlp_layer_types[layer_id] == HASH_MOE
    limit = config.swiglu_limit
    shared = MLP(config.hidden_size, config.moe_intermediate_size, swiglu_limit=limit)
    return MoE(V4Gate(config, hashed), Experts(config, expert_ids, swiglu_limit=limit), shared)
