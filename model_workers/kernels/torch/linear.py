"""Linear layers whose product for a few rows streams the weight once (speculative verify on a CPU).

`F.linear(x, W)` computes x @ W^T. On this project's CPU (torch 2.13, MKL, AMD EPYC) one row runs as a
matrix-vector product that reads W once, but 2-4 rows run as a general product that costs about what that many
separate rows cost: with the weights not in cache (as in a decode step, whose weights do not fit the L3), the
6144 x 256 LM head took 788 / 1369 / 1680 / 1597 us for 1 / 2 / 3 / 4 rows on 2 threads. The same product
written W @ x^T (the rows as the narrow right-hand side) took 759 / 516 / 694 / 687 us, and on the expert and
attention shapes (256-768 wide) it was 1.2-2x faster at 2-4 rows. From 6 rows on neither form won everywhere,
so only 2..FEW_ROWS_MAX rows take it. Verifying k = 2 drafts at batch 1 is 3 rows per request: the measured
verify cost fell from 1.43 to 1.21 plain steps (mean of five back-to-back pairs of `bench decode`).

The result is the same product in another summation order (float rounding may differ in the last bits, as it
already does between one row and several). Under a torch dispatch mode (`BatchInvariantMode` of
--enable-deterministic-inference pads every product to fixed rows) and off the CPU, `F.linear` runs as is.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import _get_current_dispatch_mode

from model_workers.kernels.torch.cpu_prepack import packed_linear, packed_weight

FEW_ROWS_MAX = 4  # rows 2..FEW_ROWS_MAX take W @ x^T (measured: see the module docstring)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           packed: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x [..., in], weight [out, in], bias [out]) -> [..., out]; a few float32 CPU rows as W @ x^T; a bf16
    weight with a oneDNN-packed copy (`packed`, else the weight's own: cpu_prepack.py) through that copy."""
    packed = packed if packed is not None else packed_weight(weight)
    if packed is not None and _takes_packed_path(x):
        return packed_linear(x, packed, bias)
    rows = x.numel() // x.shape[-1] if x.dim() and x.shape[-1] else 0
    if not _takes_few_rows_path(x, weight, rows):
        return F.linear(x, weight, bias)
    out = torch.mm(weight, x.reshape(rows, x.shape[-1]).t()).t().contiguous()  # [rows, out]
    if bias is not None:
        out = out + bias
    return out.view(*x.shape[:-1], weight.shape[0])


def _takes_packed_path(x: torch.Tensor) -> bool:
    return x.dtype == torch.bfloat16 and x.device.type == "cpu" and _get_current_dispatch_mode() is None


def _takes_few_rows_path(x: torch.Tensor, weight: torch.Tensor, rows: int) -> bool:
    return (
        2 <= rows <= FEW_ROWS_MAX
        and x.device.type == "cpu"
        and x.dtype == weight.dtype == torch.float32
        and weight.dim() == 2
        and _get_current_dispatch_mode() is None
    )
