"""`model.linear`: the few-row product is F.linear's result, taken only where it is meant to be."""

import pytest
import torch
import torch.nn.functional as F

from model_workers.kernels.torch import linear as linear_module
from model_workers.kernels.torch.batch_invariant import BatchInvariantMode
from model_workers.kernels.torch.linear import FEW_ROWS_MAX, linear
from model_workers.models.common.linear import Linear


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 33])
@pytest.mark.parametrize("with_bias", [False, True])
def test_linear_equals_f_linear(rows, with_bias):
    torch.manual_seed(rows)
    x = torch.randn(rows, 96)
    weight = torch.randn(640, 96)
    bias = torch.randn(640) if with_bias else None
    got = linear(x, weight, bias)
    assert got.shape == (rows, 640) and got.is_contiguous()
    torch.testing.assert_close(got, F.linear(x, weight, bias), rtol=1e-5, atol=1e-4)


def test_leading_dims_are_kept():
    x = torch.randn(1, 3, 64)  # 3 rows in a [B, T, D] layout
    weight = torch.randn(128, 64)
    got = linear(x, weight)
    assert got.shape == (1, 3, 128)
    torch.testing.assert_close(got, F.linear(x, weight), rtol=1e-5, atol=1e-4)


def test_empty_rows():
    assert linear(torch.randn(0, 16), torch.randn(8, 16)).shape == (0, 8)


def test_path_taken_only_for_few_float32_cpu_rows():
    weight = torch.randn(32, 16)
    takes = linear_module._takes_few_rows_path
    assert [takes(torch.randn(r, 16), weight, r) for r in range(1, FEW_ROWS_MAX + 2)] == (
        [False] + [True] * (FEW_ROWS_MAX - 1) + [False])
    bf16 = torch.randn(3, 16, dtype=torch.bfloat16)
    assert not takes(bf16, weight.bfloat16(), 3)


def test_deterministic_mode_keeps_its_padded_product():
    """Under BatchInvariantMode the product is the mode's (padded rows): the same bits as F.linear there."""
    torch.manual_seed(0)
    x, weight = torch.randn(3, 256), torch.randn(512, 256)
    with BatchInvariantMode():
        got, expected = linear(x, weight), F.linear(x, weight)
    assert torch.equal(got, expected)


def test_module_matches_nn_linear_and_its_state_dict():
    torch.manual_seed(1)
    plain = torch.nn.Linear(48, 80)
    ours = Linear(48, 80)
    ours.load_state_dict(plain.state_dict())
    x = torch.randn(2, 48)
    torch.testing.assert_close(ours(x), plain(x), rtol=1e-5, atol=1e-4)
    assert set(ours.state_dict()) == {"weight", "bias"}
