"""Write a model as a Hugging Face checkpoint: per-expert tensors, as released checkpoints have them."""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors.torch import save_file

from torch import nn

_STACKED = re.compile(r"^(.*\.mlp\.experts)\.(gate_up_proj|down_proj)$")


def checkpoint_tensors(model: nn.Module, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """Checkpoint name -> tensor; stacked experts are split back into experts.{e}.{gate,up,down}_proj.weight."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in list(model.named_parameters()) + list(model.named_buffers()):
        tensor = tensor.detach()
        keep_fp32 = name.endswith(("mlp.gate.weight", "e_score_correction_bias", "weights_proj.weight"))
        if dtype is not None and not keep_fp32:
            tensor = tensor.to(dtype)
        match = _STACKED.match(name)
        if not match:
            out[name] = tensor.contiguous()
            continue
        prefix, kind = match.groups()
        for expert, weight in enumerate(tensor):
            if kind == "down_proj":
                out[f"{prefix}.{expert}.down_proj.weight"] = weight.contiguous()
            else:
                gate, up = weight.chunk(2, dim=0)
                out[f"{prefix}.{expert}.gate_proj.weight"] = gate.contiguous()
                out[f"{prefix}.{expert}.up_proj.weight"] = up.contiguous()
    return out


def save_checkpoint(model: nn.Module, config_json: dict, out_dir: str | Path, dtype=None) -> Path:
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(checkpoint_tensors(model, dtype), out_dir / "model.safetensors", metadata={"format": "pt"})
    (out_dir / "config.json").write_text(json.dumps(config_json, indent=2, sort_keys=True) + "\n")
    return out_dir


def init_weights(model: nn.Module, std: float = 0.02, seed: int = 0) -> None:
    """Fresh weights for training: normal(0, std) matrices, unit norms, zero biases and routing bias."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, tensor in list(model.named_parameters()) + list(model.named_buffers()):
            if name.endswith("e_score_correction_bias") or name.endswith(".bias"):
                tensor.zero_()
            elif tensor.dim() == 1:
                tensor.fill_(1.0)
            else:
                tensor.copy_(torch.randn(tensor.shape, generator=generator) * std)
