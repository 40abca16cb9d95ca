"""Blocks both families build with: RMSNorm, the dense SwiGLU MLP, stacked routed experts, and the MoE layer."""

from __future__ import annotations

import torch
from torch import nn

from model_workers.kernels.torch.experts import expert_slots, expert_sum, swiglu
from model_workers.models.common.linear import Linear


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
    """down(swiglu(gate(x), up(x)))."""

    timing_phase = "mlp"  # model_workers/phase_clock.py

    def __init__(self, hidden_size: int, intermediate_size: int, swiglu_limit: float | None = None):
        super().__init__()
        self.gate_proj = Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = Linear(intermediate_size, hidden_size, bias=False)
        self.swiglu_limit = swiglu_limit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(swiglu(self.gate_proj(x), self.up_proj(x), self.swiglu_limit))


class Experts(nn.Module):
    """Routed experts stored stacked: gate_up_proj [E_local, 2I, hidden], down_proj [E_local, hidden, I].

    Under expert parallelism a rank holds the contiguous block `expert_ids` (global ids) of the layer's
    n_routed_experts; without it, all of them. A kernel set's expert loop computes with them (kernels/interface.py
    `ExpertLoop`); `forward` and `slot_outputs` are the torch reference loop's (kernels/torch/experts.py).
    """

    def __init__(self, config, expert_ids: range | None = None, swiglu_limit: float | None = None):
        """`config`: hidden_size, moe_intermediate_size and n_routed_experts (either family's config)."""
        super().__init__()
        self.expert_ids = expert_ids if expert_ids is not None else range(config.n_routed_experts)
        self.swiglu_limit = swiglu_limit
        num, hidden, inner = len(self.expert_ids), config.hidden_size, config.moe_intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(num, 2 * inner, hidden))
        self.down_proj = nn.Parameter(torch.empty(num, hidden, inner))

    def linear_weights(self) -> tuple[torch.Tensor, ...]:
        """The stacked weights `linear` multiplies expert by expert (kernels/torch/cpu_prepack.py packs them)."""
        return self.gate_up_proj, self.down_proj

    def forward(self, x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """x [T, hidden]; expert_ids (global, -1 = none), weights [T, k] -> Σ over held experts [T, hidden]."""
        return expert_sum(self, x, expert_ids, weights)

    def slot_outputs(self, x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """The same terms unsummed: [T, k, hidden], slot j = weight_j · expert_j(x) if held here, else 0."""
        return expert_slots(self, x, expert_ids, weights)


class MoE(nn.Module):
    """Gate on this process's rows; the routed experts through `backend.routed_experts` (local, or across an
    expert-parallel group); the shared experts once per row, here.

    `gate(x, token_ids) -> (expert ids [T, k], weights [T, k])` with a `top_k` attribute: `MoEGate` (V3.2 / GLM-5),
    or DeepSeek-V4's learned / hash-routed gate."""

    timing_phase = "mlp"  # model_workers/phase_clock.py (its shared experts counted with it)

    def __init__(self, gate: nn.Module, experts: Experts, shared_experts: MLP | None):
        super().__init__()
        self.gate, self.experts, self.shared_experts = gate, experts, shared_experts

    def forward(self, x: torch.Tensor, backend, layer_id: int, token_ids: torch.Tensor | None = None) -> torch.Tensor:
        """x [T, hidden]; token_ids [T] (hash routing reads them) -> [T, hidden]."""
        expert_ids, weights = self.gate(x, token_ids)
        # rows of a draft wider than its routed experts (models/common/draft_dtype.py) reach them, and every rank of an
        # expert exchange, in the experts' dtype: the one `join` sends
        routed_in = x.to(self.experts.down_proj.dtype)
        out = backend.routed_experts(layer_id, routed_in, expert_ids, weights, self.experts).to(x.dtype)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out

    def join(self, backend, layer_id: int) -> None:
        """Takes part in this layer's expert exchange with no rows of its own (DP-attention lockstep)."""
        weight = self.experts.down_proj
        x = weight.new_zeros((0, weight.shape[1]))  # [0, hidden]
        expert_ids = torch.zeros((0, self.gate.top_k), dtype=torch.long, device=weight.device)
        weights = torch.zeros((0, self.gate.top_k), dtype=torch.float32, device=weight.device)
        backend.routed_experts(layer_id, x, expert_ids, weights, self.experts)
