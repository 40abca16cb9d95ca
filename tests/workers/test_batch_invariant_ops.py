"""BatchInvariantMode's rules, op by op: under it a row's result has the same bits alone and beside any other rows
(linear, mm, addmm, matmul, bmm per product, einsum through its bmm, transcendental elementwise ops), and the
results equal the ops' values within float tolerance."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from model_workers.kernels.torch.batch_invariant import BatchInvariantMode, outside_mode

BATCHES = (1, 2, 3, 7, 33, 100)


def rows_alone_and_batched(fn, x: torch.Tensor) -> list[torch.Tensor]:
    """fn on the first row alone, then on batches of each size whose first row it is."""
    with BatchInvariantMode():
        return [fn(x[:n])[:1] for n in BATCHES]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_products_give_a_row_the_same_bits_in_every_batch(dtype):
    torch.manual_seed(0)
    x, weight = torch.randn(100, 256, dtype=dtype), torch.randn(768, 256, dtype=dtype)
    bias = torch.randn(768, dtype=dtype)
    for fn in (lambda a: F.linear(a, weight), lambda a: F.linear(a, weight, bias), lambda a: a @ weight.t(),
               lambda a: torch.mm(a, weight.t()), lambda a: torch.addmm(bias, a, weight.t())):
        first, *others = rows_alone_and_batched(fn, x)
        assert all(torch.equal(first, other) for other in others)
        torch.testing.assert_close(first.float(), fn(x[:1]).float(), rtol=1e-2, atol=1e-2)


def test_batched_and_einsum_products_pad_each_product():
    torch.manual_seed(1)
    q_nope, w_uk = torch.randn(100, 4, 32), torch.randn(4, 32, 64)  # MLA's absorption: T rows per head
    first, *others = rows_alone_and_batched(lambda a: torch.einsum("thn,hnc->thc", a, w_uk), q_nope)
    assert all(torch.equal(first, other) for other in others)
    torch.testing.assert_close(first, torch.einsum("thn,hnc->thc", q_nope[:1], w_uk))
    a, b = torch.randn(4, 100, 64), torch.randn(4, 64, 48)
    with BatchInvariantMode():
        alone = torch.bmm(a[:, :1], b)
        assert all(torch.equal(alone, torch.bmm(a[:, :n], b)[:, :1]) for n in BATCHES)


@pytest.mark.parametrize("op", [torch.sigmoid, torch.exp, F.silu, torch.cos, torch.tanh])
def test_transcendental_elementwise_ops_do_not_depend_on_the_position(op):
    torch.manual_seed(2)
    scores = torch.randn(100, 8)  # a MoE gate's [T, experts]: at T = 1 every element is a loop tail
    first, *others = rows_alone_and_batched(op, scores)
    assert all(torch.equal(first, other) for other in others)
    torch.testing.assert_close(first, op(scores[:1]))
    with BatchInvariantMode():
        assert op(torch.zeros(0, 8)).shape == (0, 8)  # a rank with no rows still runs its layers (EP)
    big = torch.randn(70_001)  # more than one block, with a tail
    with BatchInvariantMode():
        assert torch.equal(op(big)[-5:], op(big[-5:]))
        inplace = big.clone().sigmoid_() if op is torch.sigmoid else None
    if inplace is not None:
        with BatchInvariantMode():
            assert torch.equal(inplace, torch.sigmoid(big))


def test_outside_mode_runs_ops_as_they_are():
    torch.manual_seed(3)
    x, weight = torch.randn(1, 256), torch.randn(768, 256)
    plain = F.linear(x, weight)  # one row: the GEMV path, whose bits differ from a padded product's here
    with BatchInvariantMode():
        with outside_mode(True):
            assert torch.equal(F.linear(x, weight), plain)
        with outside_mode(False):
            padded = F.linear(x, weight)
    assert torch.equal(padded, F.linear(torch.cat([x, x.new_zeros(31, 256)]), weight)[:1])
