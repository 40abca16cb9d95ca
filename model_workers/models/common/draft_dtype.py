"""The dtype the MTP draft computes in, which may differ from the target's: drafts only choose what the target
verifies, so their precision moves acceptance and speed, never the output (verification stays in the target's dtype).

A model's MTP layers (`model.model.layers[num_hidden_layers:]`) hold the draft dtype; `mtp_forward` casts what it
takes from the target (token embeddings, hidden rows) into it, and the MTP layer's KV enters and leaves the cache
through the cache's format like every layer's (kv_format.py: encoded from the draft dtype, decoded into it).
Which dtype to pick is the rank's decision at load (precision.set_draft_precision).
"""

from __future__ import annotations

import torch
from torch import nn

from model_workers.models.common.layers import Experts


def mtp_layers(model: nn.Module) -> list[nn.Module]:
    """The model's MTP layers, in order (empty without speculation weights)."""
    return list(model.model.layers[model.config.num_hidden_layers:])


def draft_dtype(model: nn.Module) -> torch.dtype:
    """The dtype the draft computes in: the narrowest floating dtype among the parameters of its first MTP layer
    that `widen_draft` widens (a bf16 layer keeps its router weight in float32), the embedding's without MTP layers."""
    layers = mtp_layers(model)
    if not layers:
        return model.model.embed_tokens.weight.dtype
    return min((p.dtype for p in _widened_parameters(layers[0])), key=lambda dtype: dtype.itemsize)


def widen_draft(model: nn.Module, dtype: torch.dtype) -> None:
    """Widens the MTP layers' floating parameters and buffers narrower than `dtype` (a bf16 weight to float32; a
    float32 router weight stays), all but two kinds of weight, which keep the target's dtype and get their input
    cast to it:
    - the heads (the layer's own, the shared LM head, a draft vocabulary's rows): one row against a wide head reads
      the whole head, cheaper narrow;
    - the routed experts (`Experts`): the small-expert path reads every expert's stacked weights, which in float32
      took longer than the casts save (the default model's MoE: 407 / 550 us for 1 / 3 rows in float32 against 368
      / 426 in bf16), and their float32 copy would crowd the target's weights out of the cache.

    Parameters are replaced by new ones rather than cast in place, so nothing derived from the old tensors (a
    oneDNN-packed or transposed copy hung on a weight: cpu_prepack.hang_copy) stays attached to the new values."""
    for layer in mtp_layers(model):
        for module in _widened_modules(layer):
            for name, param in list(module.named_parameters(recurse=False)):
                if _narrower(param, dtype):
                    module._parameters[name] = nn.Parameter(param.detach().to(dtype), requires_grad=param.requires_grad)
            for name, buffer in list(module.named_buffers(recurse=False)):
                if _narrower(buffer, dtype):
                    module._buffers[name] = buffer.to(dtype)


def widened_parameter_count(model: nn.Module) -> int:
    """Parameters of this process's MTP layers that `widen_draft` widens (its float32 copy is 4 bytes each)."""
    return sum(p.numel() for layer in mtp_layers(model) for p in _widened_parameters(layer))


def _widened_modules(layer: nn.Module):
    """The modules of an MTP layer that take the draft's dtype: all but the routed experts and an own LM head."""
    for name, module in layer.named_modules():
        if not (isinstance(module, Experts) or (isinstance(module, nn.Linear) and name.rsplit(".", 1)[-1] == "head")):
            yield module


def _widened_parameters(layer: nn.Module):
    return (p for m in _widened_modules(layer) for p in m.parameters(recurse=False) if p.is_floating_point())


def _narrower(tensor: torch.Tensor, dtype: torch.dtype) -> bool:
    return tensor.is_floating_point() and tensor.dtype.itemsize < dtype.itemsize
