"""Small experts on few rows run all at once (`Experts` dense path): the same terms as expert by expert."""

from types import SimpleNamespace

import pytest
import torch

from model_workers.kernels.torch import experts as expert_loop
from model_workers.models.common.layers import Experts


def small_experts(dtype: torch.dtype, expert_ids: range | None = None, swiglu_limit: float | None = None) -> Experts:
    config = SimpleNamespace(hidden_size=32, moe_intermediate_size=24, n_routed_experts=8)  # what Experts reads
    experts = Experts(config, expert_ids, swiglu_limit).eval()
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for weight in (experts.gate_up_proj, experts.down_proj):
            weight.copy_(torch.randn(weight.shape, generator=generator) * 0.2)
    return experts.to(dtype)


def routes(num_rows: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    expert_ids = torch.stack([torch.randperm(8, generator=generator)[:3] for _ in range(num_rows)])  # [T, 3]
    expert_ids[0, 1] = -1  # a slot with no expert
    return expert_ids, torch.rand(num_rows, 3, generator=generator)


def expert_by_expert(monkeypatch, call):
    with monkeypatch.context() as patched:
        patched.setattr(expert_loop, "DENSE_MAX_ROWS", 0)
        return call()


@pytest.mark.parametrize("dtype,tolerance", [(torch.float32, 1e-6), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("held", [None, range(2, 6)])  # all experts, or an expert-parallel rank's block
@pytest.mark.parametrize("swiglu_limit", [None, 0.5])
def test_dense_path_equals_expert_by_expert(monkeypatch, dtype, tolerance, held, swiglu_limit):
    experts = small_experts(dtype, held, swiglu_limit)
    generator = torch.Generator().manual_seed(1)
    for num_rows in (1, 3, expert_loop.DENSE_MAX_ROWS):
        x = torch.randn(num_rows, 32, generator=generator).to(dtype)
        expert_ids, weights = routes(num_rows, generator)
        assert expert_loop.runs_dense(experts, x)
        dense_sum, dense_slots = experts(x, expert_ids, weights), experts.slot_outputs(x, expert_ids, weights)
        looped_sum = expert_by_expert(monkeypatch, lambda: experts(x, expert_ids, weights))
        looped_slots = expert_by_expert(monkeypatch, lambda: experts.slot_outputs(x, expert_ids, weights))
        torch.testing.assert_close(dense_sum, looped_sum, rtol=tolerance, atol=tolerance)
        torch.testing.assert_close(dense_slots, looped_slots, rtol=tolerance, atol=tolerance)
        unheld = (expert_ids < experts.expert_ids.start) | (expert_ids >= experts.expert_ids.stop)
        assert (dense_slots[unheld] == 0).all()


def test_dense_path_only_for_few_rows_of_small_experts_outside_training():
    experts = small_experts(torch.float32)
    assert expert_loop.runs_dense(experts, torch.zeros(expert_loop.DENSE_MAX_ROWS, 32))
    assert not expert_loop.runs_dense(experts, torch.zeros(expert_loop.DENSE_MAX_ROWS + 1, 32))
    assert not expert_loop.runs_dense(experts, torch.zeros(0, 32))
    assert not expert_loop.runs_dense(experts.train(), torch.zeros(1, 32))
    config = SimpleNamespace(hidden_size=1024, moe_intermediate_size=1024, n_routed_experts=8)
    assert not expert_loop.runs_dense(Experts(config).eval(), torch.zeros(1, 1024))  # 8 x 3 MiB x 4 bytes: too large


def test_dense_path_follows_an_in_place_change_of_the_weights(monkeypatch):
    """The transposed copies the dense path multiplies are retired when a weight changes in place (a reload)."""
    experts = small_experts(torch.float32)
    generator = torch.Generator().manual_seed(2)
    x = torch.randn(3, 32, generator=generator)
    expert_ids, weights = routes(3, generator)
    before = experts(x, expert_ids, weights)
    with torch.no_grad():
        experts.down_proj.mul_(2.0)
    after = experts(x, expert_ids, weights)
    torch.testing.assert_close(after, 2 * before)
    torch.testing.assert_close(after, expert_by_expert(monkeypatch, lambda: experts(x, expert_ids, weights)))
