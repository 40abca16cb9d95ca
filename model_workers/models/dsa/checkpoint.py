"""How a DSA checkpoint maps onto the model: its tensor names are our module names (the Hugging Face layout), and
its MTP (NextN) layers are counted from the names present (`model.layers.{num_hidden_layers + j}.eh_proj`)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from model_workers.models.dsa.config import ModelConfig
from model_workers.models.dsa.model import DSAForCausalLM

FP32_PARAM_SUFFIXES = ("mlp.gate.weight", "mlp.gate.e_score_correction_bias", "indexer.weights_proj.weight")


def checkpoint_entries(config: ModelConfig, files: dict[str, Path]) -> dict[str, tuple[Path, str]]:
    """Stored names are our names."""
    return {name: (file, name) for name, file in files.items()}


def count_mtp_layers(config: ModelConfig, names: set[str]) -> int:
    count = 0
    while f"model.layers.{config.num_hidden_layers + count}.eh_proj.weight" in names:
        count += 1
    return count


def mtp_layout(config: ModelConfig, names: set[str], count: int) -> list[tuple[bool, bool]]:
    """Per MTP layer present: (a MoE MLP?, its own shared_head.head?)."""
    layout = []
    for j in range(count):
        prefix = f"model.layers.{config.num_hidden_layers + j}."
        sparse = any(n.startswith(prefix + "mlp.gate.") for n in names)
        own_head = prefix + "shared_head.head.weight" in names
        layout.append((sparse, own_head))
    return layout


def build_model(config: ModelConfig, names: set[str], expert_ids: range | None) -> tuple[DSAForCausalLM, ModelConfig]:
    """The model a checkpoint with these tensor names fills (on the current default device), and its config with
    the MTP layers it has."""
    num_mtp = count_mtp_layers(config, names)
    config = dataclasses.replace(config, num_nextn_predict_layers=num_mtp)
    return DSAForCausalLM(config, mtp_layout(config, names, num_mtp), expert_ids=expert_ids), config
