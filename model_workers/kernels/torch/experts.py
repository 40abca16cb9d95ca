"""The MoE expert loop (the torch reference): Σ_k weight_k · expert_k(x) over the routed experts a process holds.

Experts arrive stacked (`ExpertWeights`: gate_up_proj [E_local, 2I, hidden], down_proj [E_local, hidden, I], the
global ids `expert_ids` of the block held here). Each row's experts are added in expert-id order.

A batch of up to DENSE_MAX_ROWS rows over experts of at most DENSE_MAX_BYTES in all (a small model's, never a
real one's) runs every held expert on every row as two batched products and keeps the routed slots: one call
per product instead of a gather, two products and a scatter per routed expert. On the default model's MoE
layer (8 experts of 768 x 256, bf16, 2 CPU threads) 1 / 3 / 8 / 32 / 64 rows took 344 / 508 / 599 / 740 / 992
us expert by expert and 234 / 261 / 303 / 503 / 768 us this way, even at 128 rows; the outputs compared equal.
Not under a dispatch mode (deterministic inference keeps one path for every batch) nor in training.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import _get_current_dispatch_mode

from model_workers.kernels.interface import ExpertWeights
from model_workers.kernels.torch.cpu_prepack import current_copy, hang_copy, packed_weight
from model_workers.kernels.torch.linear import linear

DENSE_MAX_ROWS = 64  # rows up to which small experts all run on every row (see the module docstring)
DENSE_MAX_BYTES = 16 * 2**20  # held expert weights of a layer up to which they may (and are kept transposed too)
TRANSPOSED_ATTR = "dense_transposed"  # (contiguous [E, in, out] copy, weight version) on a stacked expert weight


def swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float | None = None) -> torch.Tensor:
    """silu(gate) * up; with a limit L (DeepSeek-V4) gate <= L and -L <= up <= L first."""
    if limit is not None:
        gate, up = gate.clamp(max=limit), up.clamp(min=-limit, max=limit)
    return F.silu(gate) * up


def expert_sum(experts: ExpertWeights, x: torch.Tensor, expert_ids: torch.Tensor,
               weights: torch.Tensor) -> torch.Tensor:
    """x [T, hidden]; expert_ids (global, -1 = none), weights [T, k] -> Σ over held experts [T, hidden], each
    row's experts added in expert-id order."""
    if runs_dense(experts, x):
        return sum_in_expert_order(dense_slots(experts, x, expert_ids, weights), expert_ids)  # slots not held: 0
    out = torch.zeros_like(x)
    for rows, _, y in weighted_outputs(experts, x, expert_ids, weights):
        out.index_add_(0, rows, y)
    return out


def expert_slots(experts: ExpertWeights, x: torch.Tensor, expert_ids: torch.Tensor,
                 weights: torch.Tensor) -> torch.Tensor:
    """The same terms unsummed: [T, k, hidden], slot j = weight_j · expert_j(x) if held here, else 0."""
    if runs_dense(experts, x):
        return dense_slots(experts, x, expert_ids, weights)
    top_k = max(expert_ids.shape[1], 1)
    out = x.new_zeros((x.shape[0] * top_k, x.shape[1]))
    for _, flat_slots, y in weighted_outputs(experts, x, expert_ids, weights):
        out[flat_slots] = y
    return out.view(x.shape[0], top_k, x.shape[1])


def runs_dense(experts: ExpertWeights, x: torch.Tensor) -> bool:
    held_bytes = (experts.gate_up_proj.numel() + experts.down_proj.numel()) * experts.down_proj.element_size()
    return (0 < x.shape[0] <= DENSE_MAX_ROWS and held_bytes <= DENSE_MAX_BYTES and not experts.training
            and _get_current_dispatch_mode() is None)


def dense_slots(experts: ExpertWeights, x: torch.Tensor, expert_ids: torch.Tensor,
                weights: torch.Tensor) -> torch.Tensor:
    """[T, k, hidden] in x's dtype: slot j = weight_j · expert_j(x), 0 where expert_j is not held here; every held
    expert runs on every row (two bmm over the stacked weights)."""
    num_local, num_rows = len(experts.expert_ids), x.shape[0]
    gate_up = torch.bmm(x.expand(num_local, -1, -1), transposed_copy(experts.gate_up_proj))  # [E, T, 2I]
    gate, up = gate_up.chunk(2, dim=-1)
    y = torch.bmm(swiglu(gate, up, experts.swiglu_limit), transposed_copy(experts.down_proj))  # [E, T, hidden]
    local_ids = expert_ids - experts.expert_ids.start  # [T, k]
    held = (local_ids >= 0) & (local_ids < num_local)
    flat = local_ids.clamp(0, num_local - 1) * num_rows + torch.arange(num_rows, device=x.device)[:, None]
    picked = y.reshape(-1, y.shape[-1]).index_select(0, flat.reshape(-1)).view(num_rows, -1, y.shape[-1])
    return torch.where(held[:, :, None], picked * weights[:, :, None], 0).to(x.dtype)


def weighted_outputs(experts: ExpertWeights, x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor):
    """Per held expert, in id order: (its rows [n], their flat slots row·k + j [n], weight · expert(x) [n, hidden]
    in x's dtype)."""
    num_local = len(experts.expert_ids)
    local_ids = expert_ids - experts.expert_ids.start  # [T, k]
    held = (local_ids >= 0) & (local_ids < num_local)
    flat_ids = torch.where(held, local_ids, num_local).reshape(-1)  # [T*k]; num_local = "not held here"
    order = flat_ids.argsort(stable=True)
    counts = torch.bincount(flat_ids, minlength=num_local + 1)[:num_local].tolist()
    token_rows = order // max(expert_ids.shape[1], 1)  # [T*k]
    flat_weights = weights.reshape(-1)[order]
    gate_up_proj, down_proj = experts.gate_up_proj, experts.down_proj
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        rows = token_rows[start : start + count]
        gate_up = linear(x[rows], gate_up_proj[expert], packed=packed_weight(gate_up_proj, expert))
        gate, up = gate_up.chunk(2, dim=-1)
        y = linear(swiglu(gate, up, experts.swiglu_limit), down_proj[expert],
                   packed=packed_weight(down_proj, expert))  # [n, hidden]
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
    """slots [T, k, hidden] (weight_j · expert_j(x)) -> [T, hidden] added up in expert-id order, as `expert_sum`
    adds them: the same bits wherever each expert ran."""
    order = expert_ids.argsort(dim=1, stable=True)  # [T, k]; -1 (no expert) first: its slot is 0
    ordered = slots.gather(1, order[:, :, None].expand_as(slots))
    out = torch.zeros_like(slots[:, 0])
    for j in range(ordered.shape[1]):
        out = out + ordered[:, j]
    return out
