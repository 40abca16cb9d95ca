"""`--enable-deterministic-inference`: torch ops whose results for a row do not depend on the rows beside it.

Measured with torch 2.13 on this CPU, 1 and 2 threads alike:
- A float32 `linear` of one row gives other bits alone (M = 1) than beside one to three rows (M = 2, 3), and
  those differ from M >= 4. From 32 rows on, a row's bits are the same in every batch size up to 4,096, and
  rows deep in a large batch equal the same rows in a 32-row call. Padding to 4 rows only was not enough for a
  whole model run (some product still moved), so the rule is MIN_ROWS = 32: every linear / mm / addmm / matmul
  with fewer rows runs on MIN_ROWS, the extra rows zero (then dropped). A bmm applies it per product (the
  einsum of MLA's absorption "thn,hnc->thc" is a bmm over heads whose products have T rows).
- Transcendental elementwise ops (sigmoid, exp, silu, cos, ...) differ by position: ATen runs whole SIMD chunks
  through the vector function and a loop's tail through the scalar libm one, and the two differ in the last
  bit. A MoE gate's sigmoid over [T, 8] scores gave an element other bits at T = 1 (all tail) than at T = 4.
  They run contiguous, in blocks that are whole chunks and that no thread split cuts.
- Row-wise reductions (RMSNorm's mean, softmax, log-softmax, layer norm), bmm over fixed-shape products, and
  exact ops (add, mul, div, sqrt, gather, sort) gave the same bits at every row count.

`BatchInvariantMode` (a torch dispatch mode) applies the rules to every call made under it: each worker step
runs under it. What depends on the data (how many keys a request has, how many it selects) the backend makes
fixed itself (`deterministic` on the DSA backend); its top-k and attention then run outside the mode
(`outside_mode`), which costs about 10 us per op it sees.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

MIN_ROWS = 32  # from here on a product's rows are batch-invariant (measured: see the module docstring)

aten = torch.ops.aten


def padded_rows(x: torch.Tensor) -> tuple[torch.Tensor, int]:
    """x [..., K] -> (x as [max(M, MIN_ROWS), K], M) where M is the number of rows."""
    flat = x.reshape(-1, x.shape[-1])
    rows = flat.shape[0]
    if rows >= MIN_ROWS:
        return flat, rows
    return torch.cat([flat, flat.new_zeros(MIN_ROWS - rows, flat.shape[1])]), rows


def _linear(func, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None):
    flat, rows = padded_rows(x)
    out = func(flat, weight, bias)[:rows]
    return out.reshape(*x.shape[:-1], out.shape[-1])


def _mm(func, a: torch.Tensor, b: torch.Tensor):
    flat, rows = padded_rows(a)
    return func(flat, b)[:rows]


def _matmul(func, a: torch.Tensor, b: torch.Tensor):
    if b.dim() != 2:  # batched products: each of fixed shape (batch-invariant as they are)
        return func(a, b)
    flat, rows = padded_rows(a)  # a 1-D `a` is one row
    out = func(flat, b)[:rows]
    return out.reshape(*a.shape[:-1], out.shape[-1])


def _bmm(func, a: torch.Tensor, b: torch.Tensor):
    """a [B, M, K] @ b [B, K, N] with M < MIN_ROWS: each product on MIN_ROWS rows."""
    rows = a.shape[1]
    if rows >= MIN_ROWS:
        return func(a, b)
    padded = torch.cat([a, a.new_zeros(a.shape[0], MIN_ROWS - rows, a.shape[2])], dim=1)
    return func(padded, b)[:, :rows]


def _addmm(func, bias: torch.Tensor, a: torch.Tensor, b: torch.Tensor, *, beta=1, alpha=1):
    flat, rows = padded_rows(a)
    if bias.dim() == 2 and bias.shape[0] == rows and rows < MIN_ROWS:
        bias = torch.cat([bias, bias.new_zeros(MIN_ROWS - rows, bias.shape[1])])
    return func(bias, flat, b, beta=beta, alpha=alpha)[:rows]


VECTOR_BLOCK = 64  # elements: a whole number of the widest SIMD chunk ATen's elementwise loops take at once
ELEMENTWISE_BLOCK = 16384  # elements per call: under ATen's parallel grain (32,768), so no thread splits a call


def _elementwise(func, x: torch.Tensor, *args, **kwargs):
    """A transcendental elementwise op on every element through the vectorized path: contiguous, in calls of
    ELEMENTWISE_BLOCK elements, the last one padded to a multiple of VECTOR_BLOCK (ATen computes the tail of a
    loop that is not a whole SIMD chunk with the scalar libm function, whose bits differ from the vector one)."""
    if x.numel() == 0:
        return func(x, *args, **kwargs)
    flat = x.contiguous().reshape(-1)
    pieces = []
    for start in range(0, flat.numel(), ELEMENTWISE_BLOCK):
        block = flat[start : start + ELEMENTWISE_BLOCK]
        count = block.numel()
        if count % VECTOR_BLOCK:
            block = torch.cat([block, block.new_zeros(VECTOR_BLOCK - count % VECTOR_BLOCK)])
        pieces.append(func(block, *args, **kwargs)[:count])
    out = torch.cat(pieces) if len(pieces) != 1 else pieces[0]
    return out.reshape(x.shape)


def _elementwise_(func, x: torch.Tensor, *args, **kwargs):
    """The in-place form: computed as `_elementwise` of the out-of-place op, written back into x."""
    return x.copy_(_elementwise(_OUT_OF_PLACE[func], x, *args, **kwargs))


_OUT_OF_PLACE = {aten.sigmoid_.default: aten.sigmoid.default, aten.exp_.default: aten.exp.default,
                 aten.tanh_.default: aten.tanh.default, aten.silu_.default: aten.silu.default}
_TRANSCENDENTAL = (aten.sigmoid.default, aten.silu.default, aten.exp.default, aten.exp2.default, aten.log.default,
                   aten.log2.default, aten.log1p.default, aten.expm1.default, aten.tanh.default, aten.sin.default,
                   aten.cos.default, aten.erf.default, aten.gelu.default, aten.softplus.default,
                   aten.pow.Tensor_Scalar)

_HANDLERS = {**{op: _elementwise for op in _TRANSCENDENTAL}, **{op: _elementwise_ for op in _OUT_OF_PLACE},
             aten.linear.default: _linear, aten.mm.default: _mm, aten.matmul.default: _matmul,
             aten.addmm.default: _addmm, aten.bmm.default: _bmm}
_DECOMPOSED = frozenset({aten.einsum.default})  # run as the products they are made of, each through a handler


class BatchInvariantMode(TorchDispatchMode):
    """Under it, every linear / mm / addmm / matmul (with a 2-D right side) and every product of a bmm runs on at
    least MIN_ROWS rows; einsum runs as the bmm / mm calls it is made of."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in _DECOMPOSED:
            with self:
                return func.decompose(*args, **(kwargs or {}))
        handler = _HANDLERS.get(func)
        if handler is None or not args[0].is_floating_point():
            return func(*args, **(kwargs or {}))
        return handler(func, *args, **(kwargs or {}))


def outside_mode(deterministic: bool):
    """Code that is batch-invariant by construction in deterministic mode (the backend's fixed-shape top-k and
    attention) runs outside `BatchInvariantMode`, sparing it the mode's per-op cost (about 10 us an op here)."""
    return _disable_current_modes() if deterministic else nullcontext()
