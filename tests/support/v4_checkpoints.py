"""DeepSeek-V4 checkpoints for the tests, written the way the release writes them: release names (`layers.i.attn.wq_a`,
`embed`, `head`, `mtp.0.*`), a release config.json (`compress_ratios` with the trailing MTP entry,
`num_hash_layers`, flat YaRN `rope_scaling`), FP8 e4m3 linears with ue8m0 128×128 scales and FP4 routed experts
(two e2m1 codes per int8, low nibble = even column, a ue8m0 scale per 32 inputs)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from model_workers.checkpoint.quantized import FP4_GROUP, FP4_VALUES
from model_workers.models.deepseek_v4.names import FP8_RELEASE, release_name


def quantize_fp8_ue8m0(weight: torch.Tensor, block: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [out, in] -> (e4m3 [out, in], ue8m0 power-of-two scales [ceil(out/b), ceil(in/b)])."""
    rows, cols = weight.shape
    scales = torch.empty(math.ceil(rows / block), math.ceil(cols / block))
    quantized = torch.empty_like(weight)
    for i in range(scales.shape[0]):
        for j in range(scales.shape[1]):
            tile = weight[i * block:(i + 1) * block, j * block:(j + 1) * block]
            scale = 2.0 ** math.ceil(math.log2(max(float(tile.abs().max()), 1e-30) / 448.0))
            scales[i, j] = scale
            quantized[i * block:(i + 1) * block, j * block:(j + 1) * block] = tile / scale
    return quantized.to(torch.float8_e4m3fn), scales.to(torch.float8_e8m0fnu)


def quantize_fp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [out, in] -> (int8 [out, in/2] two e2m1 codes each, ue8m0 scales [out, in/32])."""
    rows, cols = weight.shape
    groups = weight.view(rows, cols // FP4_GROUP, FP4_GROUP)
    scales = 2.0 ** torch.ceil(torch.log2(groups.abs().amax(-1).clamp_min(1e-30) / 6.0))  # [out, in/32]
    scaled = (groups / scales[..., None]).view(rows, cols)
    codes = (scaled[..., None] - FP4_VALUES).abs().argmin(-1)  # [out, in] nearest e2m1 code
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).to(torch.uint8).view(torch.int8)
    return packed, scales.to(torch.float8_e8m0fnu)


def release_config(raw: dict, quantized: bool, num_mtp: int) -> dict:
    """`raw` (TINY_V4's transformers form) in the release form: compress_ratios with trailing MTP entries (and
    one spare, as later releases carry), num_hash_layers, flat YaRN rope_scaling, qk_rope_head_dim."""
    ratio = {"sliding_attention": 0, "compressed_sparse_attention": 4, "heavily_compressed_attention": 128}
    out = {k: v for k, v in raw.items() if k not in ("layer_types", "compress_rates", "mlp_layer_types")}
    out["compress_ratios"] = [ratio[t] for t in raw["layer_types"]] + [0] * (num_mtp + 1)
    out["compress_rate_hca"] = raw["compress_rates"]["heavily_compressed_attention"]
    out["num_hash_layers"] = sum(t == "hash_moe" for t in raw["mlp_layer_types"])
    out["num_nextn_predict_layers"] = num_mtp
    out["torch_dtype"] = "float32"  # what the unquantized tensors are written in
    if quantized:
        out["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0",
                                      "weight_block_size": [128, 128], "activation_scheme": "dynamic"}
        out["expert_dtype"] = "fp4"
    return out


def write_release_checkpoint(state: dict[str, torch.Tensor], raw: dict, folder: Path, quantized: bool,
                             num_mtp: int = 0) -> dict[str, torch.Tensor]:
    """Writes `state` (our names; stacked experts) under release names, quantized or not; returns `state` with
    every quantized tensor replaced by its dequantized value (the twin the checkpoint must load as)."""
    from safetensors.torch import save_file

    from model_workers.checkpoint.quantized import dequantize_fp8_blocks
    from model_workers.checkpoint.quantized import dequantize_fp4

    layers, tensors, twin = raw["num_hidden_layers"], {}, dict(state)
    for name, value in state.items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            prefix = release_name(name.rsplit(".experts.", 1)[0] + ".x", layers).rsplit(".", 1)[0]
            pieces = {"w1": value[:, : value.shape[1] // 2], "w3": value[:, value.shape[1] // 2:]} \
                if name.endswith("gate_up_proj") else {"w2": value}
            dequantized = []
            for w, stacked in pieces.items():
                for e, weight in enumerate(stacked):
                    key = f"{prefix}.experts.{e}.{w}"
                    if quantized:
                        packed, scale = quantize_fp4(weight)
                        tensors[key + ".weight"], tensors[key + ".scale"] = packed, scale
                        weight = dequantize_fp4(packed, scale)
                    else:
                        tensors[key + ".weight"] = weight.clone()
                    dequantized.append(weight)
            twin[name] = torch.stack(dequantized).view_as(value) if name.endswith("down_proj") else \
                torch.cat([torch.stack(dequantized[: len(value)]), torch.stack(dequantized[len(value):])], dim=1)
            continue
        key = release_name(name, layers)
        if quantized and FP8_RELEASE.search(key):
            q, scale = quantize_fp8_ue8m0(value)
            tensors[key], tensors[key.removesuffix("weight") + "scale"] = q, scale
            twin[name] = dequantize_fp8_blocks(q, scale, (128, 128))
        else:
            tensors[key] = value.clone().contiguous()
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, folder / "model.safetensors")
    (folder / "config.json").write_text(json.dumps(release_config(raw, quantized, num_mtp), indent=1))
    return twin


def v4_checkpoint_with_mtp(folder: Path, seed: int = 11, quantized: bool = False):
    """A tiny V4 (TINY_V4) with an MTP block, written under release names. Returns (transformers target,
    transformers-built MTP reference, folder); quantized: the references hold the dequantized twin."""
    from support.v4_models import TINY_V4, HFMTPReference, hf_v4

    target = hf_v4(TINY_V4, seed)
    mtp = HFMTPReference(target, seed + 1)
    state = {k: v for k, v in target.state_dict().items() if "rotary_emb" not in k}
    state.update(mtp.our_weights(TINY_V4["num_hidden_layers"]))
    twin = write_release_checkpoint(state, TINY_V4, folder, quantized, num_mtp=1)
    target.load_state_dict({k: v for k, v in twin.items() if k in target.state_dict()}, strict=False)
    prefix = f"model.layers.{TINY_V4['num_hidden_layers']}."
    own = {k[len(prefix):]: v for k, v in twin.items() if k.startswith(prefix)}
    mtp.load_state_dict({(k if k.startswith(_MTP_OWN) else "block." + k): v for k, v in own.items()}, strict=False)
    return target, mtp, folder


_MTP_OWN = ("enorm.", "hnorm.", "norm.", "e_proj.", "h_proj.", "hc_head.")
