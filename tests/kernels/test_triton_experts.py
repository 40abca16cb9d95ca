"""The Triton MoE expert loop (model_workers/kernels/triton/experts.py) against the torch reference loop, in
Triton's interpreter on CPU (set in tests/conftest.py): slots, sums and the expert-order sum; ids of -1 and
experts held elsewhere (EP); swiglu_limit; sizes that are not multiples of the tiles; FP8 block-quantized
weights against their dequantized copy; outputs poisoned with NaN first; and no host sync in the launch.

Float32 operands throughout: the interpreter's bf16 arithmetic is not the GPU's (tests/conftest.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from model_workers.checkpoint.quantized import dequantize_fp8_blocks
from model_workers.kernels.torch.experts import expert_slots, expert_sum, sum_in_expert_order
from model_workers.kernels.triton.experts import (COMPILE_CONFIGS, QUANT_BLOCK, TILES, Tiles, TritonExperts,
                                                  ordered_sum, route_blocks, routed_slots)
from model_workers.models.common.layers import Experts

HIDDEN, INNER, NUM_EXPERTS = 40, 24, 8  # not multiples of any tile
SMALL_TILES = {(name, m): Tiles(m, 16, 16, 4, 2) for name in ("gate_up", "down") for m in (16, 64)}


def make_experts(held: range, limit: float | None, hidden: int = HIDDEN, inner: int = INNER, seed: int = 0):
    torch.manual_seed(seed)
    config = SimpleNamespace(hidden_size=hidden, moe_intermediate_size=inner, n_routed_experts=NUM_EXPERTS)
    experts = Experts(config, expert_ids=held, swiglu_limit=limit).eval().requires_grad_(False)
    experts.gate_up_proj.copy_(torch.randn_like(experts.gate_up_proj) / hidden**0.5)  # [E, 2I, hidden]
    experts.down_proj.copy_(torch.randn_like(experts.down_proj) / inner**0.5)  # [E, hidden, I]
    return experts


def routing(num_rows: int, top_k: int, hidden: int = HIDDEN, seed: int = 1):
    """x [T, hidden], distinct expert ids [T, k] with one slot of -1, weights [T, k]."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(num_rows, hidden, generator=gen)
    ids = torch.stack([torch.randperm(NUM_EXPERTS, generator=gen)[:top_k] for _ in range(num_rows)])  # [T, k]
    ids[num_rows // 2, top_k - 1] = -1
    weights = torch.rand(num_rows, top_k, generator=gen)  # [T, k]
    return x, ids, weights


def nan_like(shape) -> torch.Tensor:
    return torch.full(shape, float("nan"))


@pytest.mark.parametrize("num_rows,top_k", [(1, 1), (3, 2), (70, 2)])
@pytest.mark.parametrize("limit", [None, 0.5])
@pytest.mark.parametrize("held", [range(8), range(2, 6)], ids=["all", "ep"])
def test_slots_and_sum_equal_the_torch_loop(num_rows, top_k, limit, held):
    experts = make_experts(held, limit)
    x, ids, weights = routing(num_rows, top_k)
    want = expert_slots(experts, x, ids, weights)  # [T, k, hidden]
    for tiles in (None, SMALL_TILES):
        got = routed_slots(x, ids, weights, experts.gate_up_proj, experts.down_proj, held, limit,
                           out=nan_like((num_rows, top_k, HIDDEN)), tiles=tiles)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    local = ids - held.start
    not_held = (local < 0) | (local >= len(held))  # [T, k]
    assert torch.equal(got[not_held], torch.zeros_like(got[not_held]))
    summed = ordered_sum(got, ids, out=nan_like((num_rows, HIDDEN)))
    assert torch.equal(summed, sum_in_expert_order(got, ids))
    torch.testing.assert_close(summed, expert_sum(experts, x, ids, weights), rtol=1e-5, atol=1e-5)


def test_the_expert_loop_interface_equals_the_torch_one():
    experts = make_experts(range(2, 6), 0.5)
    x, ids, weights = routing(5, 2)
    loop = TritonExperts()
    torch.testing.assert_close(loop.slots(experts, x, ids, weights), expert_slots(experts, x, ids, weights),
                               rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(loop.sum(experts, x, ids, weights), expert_sum(experts, x, ids, weights),
                               rtol=1e-5, atol=1e-5)
    slots = torch.randn(5, 2, HIDDEN)
    assert torch.equal(loop.add_in_expert_order(slots, ids), sum_in_expert_order(slots, ids))
    empty = loop.sum(experts, x[:0], ids[:0], weights[:0])
    assert empty.shape == (0, HIDDEN)


def test_ordered_sum_adds_in_expert_id_order_bit_for_bit():
    """Big and small terms in shuffled id order: any other order rounds differently."""
    gen = torch.Generator().manual_seed(3)
    scales = torch.tensor([1e8, 1.0, -1e8, 1e-3])
    slots = torch.randn(6, 4, 50, generator=gen) * scales[:, None]  # [T, k, hidden]
    ids = torch.stack([torch.randperm(4, generator=gen) for _ in range(6)])  # [T, k]
    ids[0, 2] = -1
    assert torch.equal(ordered_sum(slots, ids, out=nan_like((6, 50))), sum_in_expert_order(slots, ids))


def test_route_blocks_puts_each_slot_once_in_blocks_of_one_expert():
    ids = torch.tensor([[3, 5], [-1, 3], [7, 4], [5, 3], [2, 9]])  # [T, k]; held: 2..5
    held, block_m = range(2, 6), 16
    slot_of_pos, block_expert = route_blocks(ids, held, block_m)
    assert sorted(s for s in slot_of_pos.tolist() if s >= 0) == list(range(ids.numel()))
    flat = ids.reshape(-1)
    for block, expert in enumerate(block_expert.tolist()):
        slots = [s for s in slot_of_pos[block * block_m:(block + 1) * block_m].tolist() if s >= 0]
        local = [(int(flat[s]) - held.start) for s in slots]
        groups = {e if 0 <= e < len(held) else len(held) for e in local}
        assert groups <= {expert} and (expert > len(held) or slots), (block, expert, slots)
    taken = [e for e in block_expert.tolist() if e <= len(held)]
    assert taken == sorted(taken)


def fp8_weight(shape, gen) -> tuple[torch.Tensor, torch.Tensor]:
    """A float8_e4m3fn weight [E, N, K] and its scale_inv [E, ceil(N/128), ceil(K/128)]."""
    weight = (torch.randn(shape, generator=gen) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
    blocks = (shape[0], -(-shape[1] // 128), -(-shape[2] // 128))
    return weight, torch.rand(blocks, generator=gen) * 1e-3 + 1e-4


def test_fp8_block_weights_equal_their_dequantized_copy():
    hidden, inner, held = 160, 72, range(2, 6)  # 2I = 144: the up half starts inside a scale block
    gen = torch.Generator().manual_seed(4)
    gate_up, gate_up_scale = fp8_weight((len(held), 2 * inner, hidden), gen)
    down, down_scale = fp8_weight((len(held), hidden, inner), gen)
    experts = make_experts(held, 0.5, hidden, inner)
    with torch.no_grad():
        for e in range(len(held)):
            experts.gate_up_proj[e] = dequantize_fp8_blocks(gate_up[e], gate_up_scale[e], (128, 128))
            experts.down_proj[e] = dequantize_fp8_blocks(down[e], down_scale[e], (128, 128))
    x, ids, weights = routing(3, 2, hidden)
    tiles = {(name, m): Tiles(m, 32, 32, 4, 2) for name in ("gate_up", "down") for m in (16, 64)}
    got = routed_slots(x, ids, weights, gate_up, down, held, 0.5, fp8_scales=(gate_up_scale, down_scale),
                       out=nan_like((3, 2, hidden)), tiles=tiles)
    torch.testing.assert_close(got, expert_slots(experts, x, ids, weights), rtol=1e-5, atol=1e-5)


class SyncOps(TorchDispatchMode):
    """Records the aten ops that read a device value on the host."""

    SYNCING = ("aten._local_scalar_dense", "aten.nonzero", "aten.item", "aten.bincount", "aten.unique")

    def __init__(self):
        super().__init__()
        self.found: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if str(func.overloadpacket).startswith(self.SYNCING) or str(func).startswith(self.SYNCING):
            self.found.append(str(func))
        return func(*args, **(kwargs or {}))


def test_the_launch_makes_no_host_sync(monkeypatch):
    """Every torch op of the launchers (routing, buffers, the expert-order argsort) under a dispatch mode; the
    kernels' launches are replaced by a recorder (the interpreter itself reads tensors into numpy)."""
    import model_workers.kernels.triton.experts as module

    launched = []

    class Recorder:
        def __init__(self, name):
            self.name = name

        def __getitem__(self, grid):
            return lambda *args, **kwargs: launched.append((self.name, grid))

    for name in ("_gate_up_kernel", "_down_kernel", "_ordered_sum_kernel"):
        monkeypatch.setattr(module, name, Recorder(name))
    experts = make_experts(range(2, 6), 0.5)
    x, ids, weights = routing(70, 2)
    with SyncOps() as ops:
        TritonExperts().sum(experts, x, ids, weights)
    assert ops.found == []
    assert [name for name, _ in launched] == ["_gate_up_kernel", "_down_kernel", "_ordered_sum_kernel"]


def test_compile_configs_describe_the_launch_tiles():
    names = {c["name"] for c in COMPILE_CONFIGS}
    assert {"gate_up_m16_bf16", "gate_up_m64_fp8w", "down_m64_bf16", "down_m16_fp8w"} <= names
    for config in COMPILE_CONFIGS:
        assert list(config["signature"]) == list(config["kernel"].arg_names)
        assert {k for k, v in config["signature"].items() if v == "constexpr"} == set(config["constexprs"])
        if "BLOCK_M" in config["constexprs"]:
            name = config["name"].split("_m")[0]
            tiles = TILES[(name, config["constexprs"]["BLOCK_M"])]
            assert (config["constexprs"]["BLOCK_N"], config["constexprs"]["BLOCK_K"]) == (tiles.block_n, tiles.block_k)
            assert QUANT_BLOCK % tiles.block_k == 0  # one FP8 scale per row per step
