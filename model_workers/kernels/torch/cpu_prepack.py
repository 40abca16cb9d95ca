"""bf16 weights packed once into oneDNN's blocked layout for CPU matmuls: the same products, fewer microseconds.

On a CPU with native bf16, torch runs a bf16 `F.linear` through oneDNN, which reorders the weight into its
blocked layout on every call. Packing each weight once at load (`torch.ops.mkldnn._reorder_linear_weight`)
and multiplying with `torch.ops.mkldnn._linear_pointwise` gives bit-identical results (`torch.equal` for 1 to
2048 rows on every shape of the default model) and saves the reorder. Measured on one thread (AVX512-BF16):
a 1-row [768, 256] product 30 -> 20 us, the [6144, 256] LM head 136 -> 68 us at 1 row and 146 -> 77 us at 3,
2048 rows about 1-5 % faster.

The packed copy hangs on the weight tensor it was made from (`PACKED_ATTR`: (packed, the weight's version)), so
it is owned with the weight, and an in-place change of the weight (its version moves) retires it (inference
tensors keep no version: packing them assumes they stay as loaded). Stacked expert
weights [E, out, in] hold one packed copy per expert. Only serving packs (the rank's load); a model that trains
never does, and a dispatch mode (deterministic inference) keeps `F.linear` (kernels/torch/linear.py).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

PACKED_ATTR = "onednn_packed"  # on a weight: (packed [out, in] or a tuple per expert, weight._version at packing)


@functools.lru_cache(maxsize=1)
def bf16_prepack_supported() -> bool:
    """oneDNN is built in, this CPU runs its bf16 kernels, and a packed product gives F.linear's bits (the ops
    are torch-internal: a torch that changed them turns packing off instead of failing)."""
    try:
        if not (torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()):
            return False
        weight, x = torch.randn(24, 16).bfloat16(), torch.randn(3, 16).bfloat16()
        return torch.equal(packed_linear(x, _pack(weight), None), F.linear(x, weight))
    except (RuntimeError, AttributeError):
        return False


def packable(weight: torch.Tensor) -> bool:
    return weight.device.type == "cpu" and weight.dtype == torch.bfloat16 and bf16_prepack_supported()


def _pack(weight: torch.Tensor) -> torch.Tensor:
    """[out, in] -> its oneDNN-packed copy (opaque mkldnn layout)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 1)


def pack_weight(weight: torch.Tensor) -> bool:
    """Packs a [out, in] weight, or a stacked [E, out, in] one expert by expert; False if it cannot be."""
    if not packable(weight) or weight.dim() not in (2, 3):
        return False
    hang_copy(weight, PACKED_ATTR, _pack(weight) if weight.dim() == 2 else tuple(_pack(w) for w in weight))
    return True


def weight_version(weight: torch.Tensor) -> int:
    """The weight's in-place change counter (inference tensors keep none: -1)."""
    return -1 if weight.is_inference() else weight._version


def hang_copy(weight: torch.Tensor, attr: str, copy) -> None:
    """Keeps `copy`, something derived from `weight`, on the weight under `attr` with the weight's version."""
    setattr(weight, attr, (copy, weight_version(weight)))


def current_copy(weight: torch.Tensor, attr: str):
    """What `hang_copy` kept under `attr`, or None if nothing or the weight changed in place since."""
    entry = getattr(weight, attr, None)
    return entry[0] if entry is not None and entry[1] == weight_version(weight) else None


def packed_weight(weight: torch.Tensor, expert: int | None = None) -> torch.Tensor | None:
    """The packed copy of `weight` (of stacked weight's `expert`), None if none or the weight changed since."""
    packed = current_copy(weight, PACKED_ATTR)
    return packed if packed is None or expert is None else packed[expert]


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [..., in] @ packed^T (+ bias) -> [..., out], the bits of F.linear with the unpacked weight."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def prepack_linear_weights(model: nn.Module) -> int:
    """Packs the weight of every `nn.Linear` and the weights other modules multiply through `linear` and declare
    (`linear_weights()`: stacked experts, a draft vocabulary's rows, a head tied to the embedding); returns how
    many were packed (0 where bf16 oneDNN is not available)."""
    seen, count = set(), 0
    candidates = [m.weight for m in model.modules() if isinstance(m, nn.Linear)]
    candidates += [w for m in model.modules() if hasattr(m, "linear_weights") for w in m.linear_weights()]
    for weight in candidates:
        if id(weight) not in seen:
            seen.add(id(weight))
            count += pack_weight(weight)
    return count
