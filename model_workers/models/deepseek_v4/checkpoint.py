"""How a DeepSeek-V4 checkpoint maps onto the model: any of its three name spellings onto our module names
(names.py), and its MTP blocks counted from the names present."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from model_workers.models.deepseek_v4.config import V4Config
from model_workers.models.deepseek_v4.model import DeepseekV4ForCausalLM
from model_workers.models.deepseek_v4.names import count_v4_mtp_layers, module_name

FP32_PARAM_SUFFIXES = ("mlp.gate.weight", "mlp.gate.e_score_correction_bias", "indexer.weights_proj.weight",
                       "sinks", "position_bias", "hc.fn", "hc.base", "hc.scale", "hc_fn", "hc_base", "hc_scale")


def checkpoint_entries(config: V4Config, files: dict[str, Path]) -> dict[str, tuple[Path, str]]:
    """Our module name -> (file, stored name) of every tensor the model reads (MTP copies of the shared
    embedding and head are left out)."""
    entries = {}
    for name, file in files.items():
        ours = module_name(name, config.num_hidden_layers)
        if ours is not None:
            entries[ours] = (file, name)
    return entries


def build_model(config: V4Config, names: set[str], expert_ids: range | None) -> tuple[DeepseekV4ForCausalLM, V4Config]:
    """The model a checkpoint with these stored names fills, and its config with the MTP blocks it has."""
    num_mtp = count_v4_mtp_layers(names, config.num_hidden_layers)
    config = dataclasses.replace(config, num_nextn_predict_layers=num_mtp)
    return DeepseekV4ForCausalLM(config, num_mtp, expert_ids=expert_ids), config
