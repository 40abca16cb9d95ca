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


def mtp_layers(model: nn.Module) -> list[nn.Module]:
    """The model's MTP layers, in order (empty without speculation weights)."""
    return list(model.model.layers[model.config.num_hidden_layers:])


def draft_dtype(model: nn.Module) -> torch.dtype:
    """The dtype the draft computes in: the narrowest floating dtype of its first MTP layer's parameters (a bf16
    layer keeps its router weight in float32), the embedding's when there is no MTP layer."""
    layers = mtp_layers(model)
    source = layers[0] if layers else model.model.embed_tokens
    return min((p.dtype for p in source.parameters() if p.is_floating_point()), key=lambda dtype: dtype.itemsize)


def widen_draft(model: nn.Module, dtype: torch.dtype) -> None:
    """Widens every floating parameter and buffer of the MTP layers narrower than `dtype` (a bf16 weight to float32;
    a float32 router weight stays). The heads the draft reads (its own, the shared LM head, a draft vocabulary's
    rows) keep the target's dtype: one row against a wide head is a read of the whole head, cheaper narrow; the
    draft casts its normed rows to the head's dtype.

    Parameters are replaced by new ones rather than cast in place, so nothing derived from the old tensors (a
    oneDNN-packed or transposed copy hung on a weight: cpu_prepack.hang_copy) stays attached to the new values."""
    for layer in mtp_layers(model):
        for name, module in layer.named_modules():
            if isinstance(module, nn.Linear) and name.split(".")[-1] == "head":
                continue  # the layer's own LM head (`shared_head.head`)
            for name, param in list(module.named_parameters(recurse=False)):
                if _narrower(param, dtype):
                    module._parameters[name] = nn.Parameter(param.detach().to(dtype), requires_grad=param.requires_grad)
            for name, buffer in list(module.named_buffers(recurse=False)):
                if _narrower(buffer, dtype):
                    module._buffers[name] = buffer.to(dtype)


def _narrower(tensor: torch.Tensor, dtype: torch.dtype) -> bool:
    return tensor.is_floating_point() and tensor.dtype.itemsize < dtype.itemsize


def mtp_parameter_count(model: nn.Module) -> int:
    """Parameters of the MTP layers this process holds."""
    return sum(p.numel() for layer in mtp_layers(model) for p in layer.parameters())
