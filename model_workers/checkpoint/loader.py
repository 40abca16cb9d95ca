"""Load a Hugging Face checkpoint (config.json + safetensors, sharded or not) into its family's model: the family
builds the model and maps the stored names onto it (model_workers/models/); this module streams the tensors.

Streams tensor by tensor (never unpickles), stacks per-expert weights, dequantizes DeepSeek FP8
block-quantized weights to the compute dtype, and fails with one line naming any missing, unexpected
or mis-shaped tensor. Under expert parallelism (`ep_size` > 1) a rank reads only the routed experts it owns:
other experts' tensors are never read, and a fused expert tensor is read as the slice of its own experts.
`LoadReport` counts the bytes read per tensor as stored (FP8 weights with their scales).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
from safetensors import safe_open
from tqdm import tqdm

from model_workers.checkpoint.model_dir import as_model_spec
from model_workers.checkpoint.quantized import dequantize_fp4, dequantize_fp8_blocks
from model_workers.checkpoint.weight_classes import expert_of, is_fused_experts, owned_experts, weight_class
from model_workers.spec import ModelSpec

Entries = dict  # our tensor name -> (safetensors file, the name stored there)
_EXPERT_KEY = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


class CheckpointError(ValueError):
    """The checkpoint folder cannot be loaded; the message names the file or tensor."""


def checkpoint_files(model_dir: Path) -> dict[str, Path]:
    """tensor name -> safetensors file holding it."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: model_dir / file for name, file in weight_map.items()}
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{model_dir}: no *.safetensors files (only safetensors checkpoints are supported)")
    mapping: dict[str, Path] = {}
    for file in files:
        with safe_open(file, "pt") as handle:
            mapping.update({name: file for name in handle.keys()})
    return mapping


@dataclass
class LoadReport:
    """What one process read from the checkpoint: stored bytes per checkpoint tensor (scales included)."""

    num_hidden_layers: int
    bytes_read: dict[str, int] = field(default_factory=dict)

    @property
    def total_bytes(self) -> int:
        return sum(self.bytes_read.values())

    def bytes_by_class(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for name, size in self.bytes_read.items():
            cls = weight_class(name, self.num_hidden_layers)
            out[cls] = out.get(cls, 0) + size
        return out


def load_model(
    model: ModelSpec | str | Path, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
    progress: bool = True, ep_rank: int = 0, ep_size: int = 1,
):
    return load_model_with_report(model, dtype, device, progress, ep_rank, ep_size)[0]


def load_model_with_report(
    model: ModelSpec | str | Path, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
    progress: bool = True, ep_rank: int = 0, ep_size: int = 1, on_read: Callable[[int], None] | None = None,
):
    """The model of expert-parallel rank `ep_rank` of `ep_size` (all experts when ep_size = 1), and what it read;
    `model`: a `ModelSpec` (a rank: config.json already read at the edge) or a checkpoint folder (read here);
    `on_read(nbytes)` after each checkpoint tensor read (load progress)."""
    spec = as_model_spec(model)
    family, config = spec.family, spec.config
    experts = owned_experts(config.n_routed_experts, ep_rank, ep_size)
    files = checkpoint_files(spec.path)
    entries = family.checkpoint_entries(config, files)
    with torch.device("meta"):
        built, config = family.build_model(config, set(files), experts)
    built.to_empty(device=device)
    params = _target_tensors(built, dtype, family.fp32_param_suffixes)
    report = LoadReport(config.num_hidden_layers)
    _fill(params, entries, config, experts, report, progress, on_read)
    built.eval().requires_grad_(False)
    return built, report


def _target_tensors(model: torch.nn.Module, dtype: torch.dtype, fp32_suffixes: tuple[str, ...]) -> dict:
    """Every parameter and buffer by checkpoint name, cast to its load dtype (fp32 where the reference keeps it)."""
    targets = {}
    for name, tensor in list(model.named_parameters()) + list(model.named_buffers()):
        if not tensor.is_floating_point():  # tid2eid
            targets[name] = tensor
            continue
        wanted = torch.float32 if name.endswith(fp32_suffixes) else dtype
        if tensor.dtype != wanted:
            tensor.data = tensor.data.to(wanted)
        targets[name] = tensor
    return targets


def _fill(targets, entries: Entries, config, experts: range, report: LoadReport,
          progress: bool, on_read: Callable[[int], None] | None = None) -> None:
    loaded: set[str] = set()
    skip = _ignorable(config, set(entries))
    by_file: dict[Path, list[str]] = {}
    for name, (file, _) in entries.items():
        expert = expert_of(name)
        if expert is not None and expert >= config.n_routed_experts:
            raise CheckpointError(f"{name}: expert {expert} >= n_routed_experts={config.n_routed_experts}")
        if name in skip or name.endswith("weight_scale_inv") or (expert is not None and expert not in experts):
            continue  # another rank's expert: never read
        by_file.setdefault(file, []).append(name)
    bar = tqdm(total=sum(len(v) for v in by_file.values()), desc="loading weights", disable=not progress, unit="t")
    for file, names in by_file.items():
        if not file.is_file():
            raise CheckpointError(f"{file}: listed in the index but missing")
        with safe_open(file, "pt") as handle:
            for name in names:
                tensor = _read(handle, name, entries, config, experts, report)
                loaded |= _copy_into(targets, name, tensor, experts)
                bar.update(1)
                if on_read is not None:
                    on_read(report.bytes_read[name])
    bar.close()
    missing = sorted(set().union(*(_pieces(name, t) for name, t in targets.items())) - loaded)
    if missing:
        raise CheckpointError(f"checkpoint is missing {len(missing)} tensor(s), first: {missing[0]}")


def _ignorable(config, names: set[str]) -> set[str]:
    """Tensors that are legitimately redundant: a tied lm_head, MTP copies of the shared embedding/head."""
    skip = {n for n in names if re.fullmatch(r"model\.layers\.\d+\.embed_tokens\.weight", n)}
    if config.tie_word_embeddings:
        skip.add("lm_head.weight")
    return skip & names


def _read(handle, name: str, entries: Entries, config, experts: range, report: LoadReport) -> torch.Tensor:
    """One checkpoint tensor (a fused expert tensor: only the rows of `experts`), FP8 / FP4 dequantized."""
    fused, stored = is_fused_experts(name), entries[name][1]
    tensor = handle.get_slice(stored)[experts.start : experts.stop] if fused else handle.get_tensor(stored)
    report.bytes_read[name] = tensor.nbytes
    fp4 = tensor.dtype == torch.int8 and expert_of(name) is not None
    if tensor.dtype in (torch.int8, torch.uint8) and not fp4:
        raise CheckpointError(f"{stored}: {tensor.dtype} tensor; packed FP4 (int8) is only read for routed experts")
    if tensor.dtype not in (torch.float8_e4m3fn, torch.float8_e5m2) and not fp4:
        return tensor
    scale_name = name.replace(".weight", ".weight_scale_inv") if name.endswith(".weight") else name + "_scale_inv"
    if scale_name not in entries or (config.fp8_block_size is None and not fp4):
        raise CheckpointError(f"{stored}: {'FP4' if fp4 else 'FP8'} tensor without its scale "
                              f"({scale_name}) / quantization_config in config.json")
    scale_file, scale_stored = entries[scale_name]
    with safe_open(scale_file, "pt") as scale_handle:
        scale = scale_handle.get_slice(scale_stored)[experts.start : experts.stop] if fused else \
            scale_handle.get_tensor(scale_stored)
    report.bytes_read[scale_name] = scale.nbytes
    if fp4:
        return dequantize_fp4(tensor, scale)
    if fused:  # [E_local, out, in] with scales [E_local, out/b0, in/b1]
        return torch.stack([dequantize_fp8_blocks(w, s, config.fp8_block_size) for w, s in zip(tensor, scale)])
    return dequantize_fp8_blocks(tensor, scale, config.fp8_block_size)


def _pieces(target_name: str, target: torch.Tensor) -> set[str]:
    """What must be loaded for a target: stacked experts need every expert's projections."""
    if target_name.endswith("experts.gate_up_proj"):
        return {f"{target_name}#{e}.{p}" for e in range(target.shape[0]) for p in ("gate_proj", "up_proj")}
    if target_name.endswith("experts.down_proj"):
        return {f"{target_name}#{e}.down_proj" for e in range(target.shape[0])}
    return {target_name}


def _copy_into(targets: dict[str, torch.Tensor], name: str, tensor: torch.Tensor, experts: range) -> set[str]:
    """Copies a checkpoint tensor into its parameter; returns the pieces (see `_pieces`) it completed."""
    match = _EXPERT_KEY.match(name)
    if match:
        prefix, expert, proj = match.group(1), int(match.group(2)), match.group(3)
        if proj == "down_proj":
            target_name, rows = prefix + ".down_proj", slice(None)
        else:
            target_name = prefix + ".gate_up_proj"
            inner = targets.get(target_name, torch.empty(0, 2)).shape[1] // 2
            rows = slice(0, inner) if proj == "gate_proj" else slice(inner, 2 * inner)
        target = _lookup(targets, target_name, name)
        local = expert - experts.start
        _checked_copy(target[local][rows], tensor, name)
        return {f"{target_name}#{local}.{proj}"}
    target = _lookup(targets, name, name)
    _checked_copy(target, tensor, name)
    return _pieces(name, target)


def _lookup(targets: dict[str, torch.Tensor], target_name: str, name: str) -> torch.Tensor:
    if target_name not in targets:
        raise CheckpointError(f"unexpected tensor {name} (no such weight in a {len(targets)}-tensor DSA model)")
    return targets[target_name]


def _checked_copy(target: torch.Tensor, tensor: torch.Tensor, name: str) -> None:
    if tuple(target.shape) != tuple(tensor.shape):
        raise CheckpointError(f"{name}: shape {tuple(tensor.shape)} in checkpoint, expected {tuple(target.shape)}")
    with torch.no_grad():
        target.copy_(tensor.to(target.dtype))
