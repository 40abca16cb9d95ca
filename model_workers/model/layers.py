"""Norms, the dense SwiGLU MLP, and the DeepSeek mixture of experts (sigmoid routing, grouped top-k)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import _get_current_dispatch_mode

from model_workers.model.config import ModelConfig
from model_workers.model.cpu_prepack import current_copy, hang_copy, packed_weight
from model_workers.model.linear import Linear, linear


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x_fp32 = x.float()
        normed = x_fp32 * torch.rsqrt(x_fp32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * normed.to(x.dtype)


def swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float | None = None) -> torch.Tensor:
    """silu(gate) * up; with a limit L (DeepSeek-V4) gate <= L and -L <= up <= L first."""
    if limit is not None:
        gate, up = gate.clamp(max=limit), up.clamp(min=-limit, max=limit)
    return F.silu(gate) * up


class MLP(nn.Module):
    """down(swiglu(gate(x), up(x)))."""

    def __init__(self, hidden_size: int, intermediate_size: int, swiglu_limit: float | None = None):
        super().__init__()
        self.gate_proj = Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = Linear(intermediate_size, hidden_size, bias=False)
        self.swiglu_limit = swiglu_limit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(swiglu(self.gate_proj(x), self.up_proj(x), self.swiglu_limit))


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


DENSE_MAX_ROWS = 64  # rows up to which small experts all run on every row (see `Experts`)
DENSE_MAX_BYTES = 16 * 2**20  # held expert weights of a layer up to which they may (and are kept transposed too)
TRANSPOSED_ATTR = "dense_transposed"  # (contiguous [E, in, out] copy, weight version) on a stacked expert weight


class Experts(nn.Module):
    """Routed experts stored stacked: gate_up_proj [E_local, 2I, hidden], down_proj [E_local, hidden, I].

    Under expert parallelism a rank holds the contiguous block `expert_ids` (global ids) of the layer's
    n_routed_experts; without it, all of them. The forward sums only the experts held here.

    A batch of up to DENSE_MAX_ROWS rows over experts of at most DENSE_MAX_BYTES in all (a small model's, never a
    real one's) runs every held expert on every row as two batched products and keeps the routed slots: one call
    per product instead of a gather, two products and a scatter per routed expert. On the default model's MoE
    layer (8 experts of 768 x 256, bf16, 2 CPU threads) 1 / 3 / 8 / 32 / 64 rows took 344 / 508 / 599 / 740 / 992
    us expert by expert and 234 / 261 / 303 / 503 / 768 us this way, even at 128 rows; the outputs compared equal.
    Not under a dispatch mode (deterministic inference keeps one path for every batch) nor in training.
    """

    def __init__(self, config: ModelConfig, expert_ids: range | None = None, swiglu_limit: float | None = None):
        super().__init__()
        self.expert_ids = expert_ids if expert_ids is not None else range(config.n_routed_experts)
        self.swiglu_limit = swiglu_limit
        num, hidden, inner = len(self.expert_ids), config.hidden_size, config.moe_intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(num, 2 * inner, hidden))
        self.down_proj = nn.Parameter(torch.empty(num, hidden, inner))

    def linear_weights(self) -> tuple[torch.Tensor, ...]:
        """The stacked weights `linear` multiplies expert by expert (model/cpu_prepack.py packs them)."""
        return self.gate_up_proj, self.down_proj

    def forward(self, x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """x [T, hidden]; expert_ids (global, -1 = none), weights [T, k] -> Σ over held experts [T, hidden], each
        row's experts added in expert-id order."""
        if self._runs_dense(x):
            return sum_in_expert_order(self._dense_slots(x, expert_ids, weights), expert_ids)  # slots not held: 0
        out = torch.zeros_like(x)
        for rows, _, y in self._weighted_outputs(x, expert_ids, weights):
            out.index_add_(0, rows, y)
        return out

    def slot_outputs(self, x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """The same terms unsummed: [T, k, hidden], slot j = weight_j · expert_j(x) if held here, else 0."""
        if self._runs_dense(x):
            return self._dense_slots(x, expert_ids, weights)
        top_k = max(expert_ids.shape[1], 1)
        out = x.new_zeros((x.shape[0] * top_k, x.shape[1]))
        for _, flat_slots, y in self._weighted_outputs(x, expert_ids, weights):
            out[flat_slots] = y
        return out.view(x.shape[0], top_k, x.shape[1])

    def _runs_dense(self, x: torch.Tensor) -> bool:
        held_bytes = (self.gate_up_proj.numel() + self.down_proj.numel()) * self.down_proj.element_size()
        return (0 < x.shape[0] <= DENSE_MAX_ROWS and held_bytes <= DENSE_MAX_BYTES and not self.training
                and _get_current_dispatch_mode() is None)

    def _dense_slots(self, x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """[T, k, hidden] in x's dtype: slot j = weight_j · expert_j(x), 0 where expert_j is not held here; every held
        expert runs on every row (two bmm over the stacked weights)."""
        num_local, num_rows = len(self.expert_ids), x.shape[0]
        gate_up = torch.bmm(x.expand(num_local, -1, -1), transposed_copy(self.gate_up_proj))  # [E, T, 2I]
        gate, up = gate_up.chunk(2, dim=-1)
        y = torch.bmm(swiglu(gate, up, self.swiglu_limit), transposed_copy(self.down_proj))  # [E, T, hidden]
        local_ids = expert_ids - self.expert_ids.start  # [T, k]
        held = (local_ids >= 0) & (local_ids < num_local)
        flat = local_ids.clamp(0, num_local - 1) * num_rows + torch.arange(num_rows, device=x.device)[:, None]
        picked = y.reshape(-1, y.shape[-1]).index_select(0, flat.reshape(-1)).view(num_rows, -1, y.shape[-1])
        return torch.where(held[:, :, None], picked * weights[:, :, None], 0).to(x.dtype)

    def _weighted_outputs(self, x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor):
        """Per held expert, in id order: (its rows [n], their flat slots row·k + j [n], weight · expert(x) [n, hidden]
        in x's dtype)."""
        num_local = len(self.expert_ids)
        local_ids = expert_ids - self.expert_ids.start  # [T, k]
        held = (local_ids >= 0) & (local_ids < num_local)
        flat_ids = torch.where(held, local_ids, num_local).reshape(-1)  # [T*k]; num_local = "not held here"
        order = flat_ids.argsort(stable=True)
        counts = torch.bincount(flat_ids, minlength=num_local + 1)[:num_local].tolist()
        token_rows = order // max(expert_ids.shape[1], 1)  # [T*k]
        flat_weights = weights.reshape(-1)[order]
        start = 0
        for expert, count in enumerate(counts):
            if count == 0:
                continue
            rows = token_rows[start : start + count]
            gate_up = linear(x[rows], self.gate_up_proj[expert], packed=packed_weight(self.gate_up_proj, expert))
            gate, up = gate_up.chunk(2, dim=-1)
            y = linear(swiglu(gate, up, self.swiglu_limit), self.down_proj[expert],
                       packed=packed_weight(self.down_proj, expert))  # [n, hidden]
            yield rows, order[start : start + count], (y * flat_weights[start : start + count, None]).to(x.dtype)
            start += count


def transposed_copy(weight: torch.Tensor) -> torch.Tensor:
    """A stacked weight [E, out, in] as a contiguous [E, in, out] copy, made once per version of the weight: the
    dense path's bmm over a transposed view reordered every expert on every call (a verify step of 3 rows took
    8.0 ms with views, 6.9 with copies, 7.9 expert by expert)."""
    copy = current_copy(weight, TRANSPOSED_ATTR)
    if copy is None:
        copy = weight.detach().transpose(1, 2).contiguous()
        hang_copy(weight, TRANSPOSED_ATTR, copy)
    return copy


def sum_in_expert_order(slots: torch.Tensor, expert_ids: torch.Tensor) -> torch.Tensor:
    """slots [T, k, hidden] (weight_j · expert_j(x)) -> [T, hidden] added up in expert-id order, as
    `Experts.forward` adds them: the same bits wherever each expert ran."""
    order = expert_ids.argsort(dim=1, stable=True)  # [T, k]; -1 (no expert) first: its slot is 0
    ordered = slots.gather(1, order[:, :, None].expand_as(slots))
    out = torch.zeros_like(slots[:, 0])
    for j in range(ordered.shape[1]):
        out = out + ordered[:, j]
    return out


class MoE(nn.Module):
    """Gate on this process's rows; the routed experts through `backend.routed_experts` (local, or across an
    expert-parallel group); the shared experts once per row, here.

    `gate(x, token_ids) -> (expert ids [T, k], weights [T, k])` with a `top_k` attribute: `MoEGate` (V3.2 / GLM-5),
    or DeepSeek-V4's learned / hash-routed gate."""

    def __init__(self, gate: nn.Module, experts: Experts, shared_experts: MLP | None):
        super().__init__()
        self.gate, self.experts, self.shared_experts = gate, experts, shared_experts

    def forward(self, x: torch.Tensor, backend, layer_id: int, token_ids: torch.Tensor | None = None) -> torch.Tensor:
        """x [T, hidden]; token_ids [T] (hash routing reads them) -> [T, hidden]."""
        expert_ids, weights = self.gate(x, token_ids)
        # rows of a draft wider than its routed experts (model/draft_dtype.py) reach them, and every rank of an
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


def deepseek_moe(config: ModelConfig, expert_ids: range | None = None) -> MoE:
    """The DeepSeek-V3.2 / GLM-5 MoE layer: grouped sigmoid routing, n_shared_experts fused into one MLP."""
    shared = config.moe_intermediate_size * config.n_shared_experts
    shared_experts = MLP(config.hidden_size, shared) if shared > 0 else None
    return MoE(MoEGate(config), Experts(config, expert_ids), shared_experts)
