"""The MoE experts as a grouped GEMM (kernels/triton/experts.py) against the torch reference `expert_sum` on the same
device: dense weights, and DeepSeek's block-quantized FP8 weights (float8_e4m3fn with a float32 scale_inv per
128 x 128 block) against `expert_sum` over their dequantized copy. Useful work: 2·hidden·2I + 2·I·hidden FLOPs
per routed slot; bytes: the weights of the experts the batch routes to (+ their scales), x read, out written."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from gpu_check import data
from gpu_check.measure import compare
from model_workers.checkpoint.quantized import dequantize_fp8_blocks
from model_workers.kernels.torch.experts import expert_sum
from model_workers.kernels.triton.experts import QUANT_BLOCK, TritonExperts, ordered_sum, routed_slots

FP8_SPREAD = 64.0  # stored FP8 values ~ N(0, 64^2): well inside e4m3's range, most of its precision used


def fp8_weight(shape, gen, device) -> tuple[torch.Tensor, torch.Tensor]:
    """A float8_e4m3fn weight [E, N, K] and its scale_inv [E, ceil(N/128), ceil(K/128)] (dequantized ~ N(0, 1/K))."""
    experts, rows, cols = shape
    values = torch.randn(shape, generator=gen, device=device, dtype=torch.bfloat16)  # no float32 copy of them all
    weight = values.mul_(FP8_SPREAD).clamp_(-448, 448).to(torch.float8_e4m3fn)
    blocks = (experts, -(-rows // QUANT_BLOCK), -(-cols // QUANT_BLOCK))
    scale = (torch.rand(blocks, generator=gen, device=device) * 0.5 + 0.75) / (FP8_SPREAD * cols**0.5)
    return weight, scale


def dequantized(weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[E, N, K] in `dtype`, expert by expert (no float32 copy of every expert at once)."""
    out = torch.empty(weight.shape, dtype=dtype, device=weight.device)
    for e in range(weight.shape[0]):
        out[e] = dequantize_fp8_blocks(weight[e], scale[e], (QUANT_BLOCK, QUANT_BLOCK)).to(dtype)
    return out


def expert_inputs(case, dtype: torch.dtype, device, seed: int = 3) -> dict:
    gen = data.generator(device, seed)
    shape_up, shape_down = (case.experts, 2 * case.inner, case.hidden), (case.experts, case.hidden, case.inner)
    if case.fp8:
        up8, up_scale = fp8_weight(shape_up, gen, device)
        down8, down_scale = fp8_weight(shape_down, gen, device)
        gate_up, down = dequantized(up8, up_scale, dtype), dequantized(down8, down_scale, dtype)
        quantized = (up8, down8, up_scale, down_scale)
    else:
        gate_up = torch.randn(shape_up, generator=gen, device=device, dtype=dtype) * case.hidden**-0.5
        down = torch.randn(shape_down, generator=gen, device=device, dtype=dtype) * case.inner**-0.5
        quantized = None
    experts = SimpleNamespace(gate_up_proj=gate_up, down_proj=down, expert_ids=range(case.experts),
                              swiglu_limit=None, training=False)
    x = torch.randn(case.rows, case.hidden, generator=gen, device=device, dtype=dtype)
    ids, weights = data.random_routing(case.rows, case.experts, case.top_k, device, gen)
    return dict(experts=experts, quantized=quantized, x=x, ids=ids, weights=weights)


def run_experts(case, plan, timer) -> dict:
    inputs = expert_inputs(case, plan.dtype, timer.device)
    experts, quantized, x, ids, weights = (inputs[k] for k in ("experts", "quantized", "x", "ids", "weights"))
    if quantized is None:
        def triton_call():
            return TritonExperts().sum(experts, x, ids, weights)
    else:
        up8, down8, up_scale, down_scale = quantized

        def triton_call():
            slots = routed_slots(x, ids, weights, up8, down8, experts.expert_ids, None,
                                 fp8_scales=(up_scale, down_scale))
            return ordered_sum(slots, ids)

    def torch_call():
        return expert_sum(experts, x, ids, weights)

    expected = torch_call()
    check = compare(triton_call(), expected, plan.rel_tol)
    del expected
    touched = int(torch.unique(ids).numel())
    per_expert = 3 * case.hidden * case.inner
    weight_bytes = touched * per_expert * (1 if quantized else x.element_size())
    if quantized is not None:
        weight_bytes += touched * (up_scale[0].numel() + down_scale[0].numel()) * 4
    flops = ids.numel() * 2 * per_expert
    nbytes = weight_bytes + 2 * x.numel() * x.element_size()
    record = {"kind": case.kind, "check": check, "passed": check["passed"], "experts_touched": touched}
    if plan.mode != "sanitizer":
        record["timing"] = timer.kernel(triton_call, torch_call, flops, nbytes)
        record["timing"]["counted"] = ("bytes = weights of the routed experts (+ FP8 scales), x read, out written; "
                                       "the torch path runs on the dequantized weights")
    return record
