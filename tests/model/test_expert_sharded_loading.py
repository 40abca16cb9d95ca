"""Per-rank loading under expert parallelism: a rank reads and holds only its own routed experts (per-expert,
fused and FP8 block layouts), and `dsa-serve plan`'s per-rank bytes are the bytes a rank really reads."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from model_workers.checkpoint.capacity import plan
from model_workers.checkpoint.loader import load_model, load_model_with_report
from model_workers.checkpoint.weight_classes import expert_of, fp8_quantized
from support.fp8 import quantize_fp8_blocks
from support.tiny_models import add_mtp_layer, reference_model, save_reference

BLOCK = 16


@pytest.fixture(scope="module")
def released_layout(tmp_path_factory):
    """The tiny V3.2 shape laid out as released checkpoints are: an MoE MTP layer with its own shared_head.head
    and an embed_tokens copy (which loaders skip)."""
    folder = save_reference(reference_model("v32"), tmp_path_factory.mktemp("released"))
    add_mtp_layer(folder)
    tensors = load_file(folder / "model.safetensors")
    n = json.loads((folder / "config.json").read_text())["num_hidden_layers"]
    tensors[f"model.layers.{n}.shared_head.head.weight"] = tensors["lm_head.weight"] * 0.5
    tensors[f"model.layers.{n}.embed_tokens.weight"] = tensors["model.embed_tokens.weight"].clone()
    save_file(tensors, folder / "model.safetensors")
    return folder


def rewrite(folder, out, convert, config_update: dict):
    out.mkdir()
    tensors = {}
    for name, value in load_file(folder / "model.safetensors").items():
        tensors.update(convert(name, value))
    save_file(tensors, out / "model.safetensors")
    config = json.loads((folder / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, **config_update}))
    return out


def to_bf16(name, value):
    return {name: value if name.endswith("e_score_correction_bias") else value.to(torch.bfloat16)}


def to_fp8(name, value):
    if not fp8_quantized(name):
        return to_bf16(name, value)
    quantized, scale = quantize_fp8_blocks(value.float(), BLOCK)
    return {name: quantized, name.replace(".weight", ".weight_scale_inv"): scale}


@pytest.fixture(scope="module")
def stored(released_layout, tmp_path_factory):
    root = tmp_path_factory.mktemp("stored")
    fp8 = {"quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [BLOCK, BLOCK]}}
    return {
        "bf16": rewrite(released_layout, root / "bf16", to_bf16, {"torch_dtype": "bfloat16"}),
        "fp8": rewrite(released_layout, root / "fp8", to_fp8, {"torch_dtype": "bfloat16", **fp8}),
    }


@pytest.mark.parametrize("layout", ["bf16", "fp8"])
@pytest.mark.parametrize("ep_size", [1, 2, 4])
def test_plan_bytes_are_the_bytes_each_rank_reads(stored, tmp_path, layout, ep_size):
    folder = stored[layout]
    config_only = tmp_path / "config_only"
    config_only.mkdir()
    shutil.copy(folder / "config.json", config_only / "config.json")
    planned = plan(config_only, cp_size=ep_size if ep_size > 1 else 2, ep_size=ep_size)
    for rank in range(ep_size):
        _, report = load_model_with_report(folder, ep_rank=rank, ep_size=ep_size, progress=False)
        assert planned["per_rank_weight_bytes"][rank] == report.total_bytes
        by_class = {k: v for k, v in planned["ranks"][rank]["bytes_by_class"].items() if v}
        assert by_class == report.bytes_by_class()
        read_experts = {expert_of(name) for name in report.bytes_read} - {None}
        assert read_experts == set(range(rank * 8 // ep_size, (rank + 1) * 8 // ep_size))
    if layout == "fp8":
        assert any(name.endswith("weight_scale_inv") for name in report.bytes_read)


@pytest.mark.parametrize("ep_size", [2, 4])
def test_a_rank_holds_only_its_experts_and_they_are_the_right_ones(released_layout, ep_size):
    full = load_model(released_layout, progress=False)
    for rank in range(ep_size):
        part = load_model(released_layout, ep_rank=rank, ep_size=ep_size, progress=False)
        per_rank = 8 // ep_size
        for name, tensor in part.state_dict().items():
            whole = full.state_dict()[name]
            if ".experts." in name:  # [E / ep, ...]: the contiguous block of this rank
                assert tensor.shape[0] == per_rank
                torch.testing.assert_close(tensor, whole[rank * per_rank:(rank + 1) * per_rank], atol=0, rtol=0)
            else:
                torch.testing.assert_close(tensor, whole, atol=0, rtol=0)
        expert_bytes = sum(t.nbytes for n, t in part.state_dict().items() if ".experts." in n)
        assert expert_bytes * ep_size == sum(t.nbytes for n, t in full.state_dict().items() if ".experts." in n)


def test_fused_expert_tensors_are_read_as_the_rank_slice(released_layout, tmp_path):
    """A checkpoint with stacked `mlp.experts.gate_up_proj` [E, 2I, hidden] / `down_proj` [E, hidden, I]."""
    tensors, fused = load_file(released_layout / "model.safetensors"), {}
    for name in sorted(tensors):
        if expert_of(name) is None:
            fused[name] = tensors[name]
    prefixes = sorted({name.split(".experts.")[0] for name in tensors if expert_of(name) is not None})
    for prefix in prefixes:
        def stack(proj):
            return torch.stack([tensors[f"{prefix}.experts.{e}.{proj}.weight"] for e in range(8)])
        fused[f"{prefix}.experts.gate_up_proj"] = torch.cat([stack("gate_proj"), stack("up_proj")], dim=1)
        fused[f"{prefix}.experts.down_proj"] = stack("down_proj")
    folder = tmp_path / "fused"
    folder.mkdir()
    save_file(fused, folder / "model.safetensors")
    shutil.copy(released_layout / "config.json", folder / "config.json")
    per_expert = load_model(released_layout, ep_rank=1, ep_size=2, progress=False).state_dict()
    part, report = load_model_with_report(folder, ep_rank=1, ep_size=2, progress=False)
    for name, tensor in part.state_dict().items():
        torch.testing.assert_close(tensor, per_expert[name], atol=0, rtol=0)
    fused_read = {n: b for n, b in report.bytes_read.items() if n.endswith("experts.down_proj")}
    assert all(b * 2 == fused[n].nbytes for n, b in fused_read.items())  # half of each stacked tensor read


def test_uneven_expert_split_names_the_numbers(released_layout):
    with pytest.raises(ValueError, match=r"n_routed_experts=8 does not split evenly over ep_size=3 \(8 % 3 = 2\)"):
        load_model(released_layout, ep_rank=0, ep_size=3, progress=False)
