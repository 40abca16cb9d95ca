"""A DSA model of random weights at a config's real layer shapes, built in memory on the device (no checkpoint
files, no transformers): parsed by the model registry, built on the meta device as the loader builds it, each
tensor allocated on the device in its load dtype (float32 where the family keeps it), then initialised there by
checkpoint/saver.py `init_weights`'s rule (normal(0, 0.02) matrices, unit norms, zero biases and routing bias) from
a device generator: a CPU generator's copy of 28 GB of V3.2 experts would not fit the check's time."""

from __future__ import annotations

import torch

from model_workers.models.dsa.model import DSAForCausalLM
from model_workers.models.registry import family_of, parse_model_config

INIT_STD = 0.02  # checkpoint/saver.py init_weights


def random_dsa_model(raw: dict, dtype: torch.dtype, device, seed: int = 0) -> DSAForCausalLM:
    config = parse_model_config(raw)
    family = family_of(config)
    with torch.device("meta"):
        model = DSAForCausalLM(config)
    materialize(model, dtype, torch.device(device), family.fp32_param_suffixes)
    init_on_device(model, seed)
    return model.eval().requires_grad_(False)


def materialize(model: torch.nn.Module, dtype: torch.dtype, device: torch.device, fp32_suffixes) -> None:
    """Every meta parameter and buffer replaced by an empty tensor on `device` in its load dtype (shared tensors
    stay shared)."""
    made: dict[int, torch.Tensor] = {}
    for prefix, module in model.named_modules():
        for table, as_param in ((module._parameters, True), (module._buffers, False)):
            for name, tensor in list(table.items()):
                if tensor is None:
                    continue
                if id(tensor) not in made:
                    full = f"{prefix}.{name}" if prefix else name
                    wanted = tensor.dtype if not tensor.is_floating_point() else (
                        torch.float32 if full.endswith(tuple(fp32_suffixes)) else dtype)
                    fresh = torch.empty(tensor.shape, dtype=wanted, device=device)
                    made[id(tensor)] = torch.nn.Parameter(fresh, requires_grad=False) if as_param else fresh
                table[name] = made[id(tensor)]


@torch.no_grad()
def init_on_device(model: torch.nn.Module, seed: int) -> None:
    generator = None
    for name, tensor in list(model.named_parameters()) + list(model.named_buffers()):
        if generator is None:
            generator = torch.Generator(device=tensor.device).manual_seed(seed)
        if not tensor.is_floating_point():
            tensor.zero_()
        elif name.endswith("e_score_correction_bias") or name.endswith(".bias"):
            tensor.zero_()
        elif tensor.dim() == 1:
            tensor.fill_(1.0)
        else:
            tensor.normal_(0.0, INIT_STD, generator=generator)
