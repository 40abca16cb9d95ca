"""Checkpoint layouts (sharded, FP8 block-quantized) and one-line errors for malformed checkpoints."""

import json
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from model_workers.checkpoint.loader import CheckpointError, load_model
from model_workers.checkpoint.quantized import dequantize_fp8_blocks
from model_workers.models.dsa.config import ModelConfigError
from model_workers.runner import ExtendItem, ModelRunner
from support.fp8 import quantize_fp8_blocks

IDS = list(range(3, 33))


def logits_of(folder) -> torch.Tensor:
    runner = ModelRunner(load_model(folder, progress=False), num_pages=8, page_size=8)
    (table,) = runner.standalone_tables([len(IDS)])
    hidden = runner.extend([ExtendItem(table, IDS)])
    return runner.model.logits(hidden)


@pytest.fixture
def checkpoint_copy(reference_checkpoint, tmp_path):
    _, folder = reference_checkpoint("v32")
    target = tmp_path / "ckpt"
    shutil.copytree(folder, target)
    return target


def test_sharded_checkpoint_with_index_equals_single_file(checkpoint_copy):
    expected = logits_of(checkpoint_copy)
    tensors = load_file(checkpoint_copy / "model.safetensors")
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for file, part in shards.items():
        save_file({n: tensors[n] for n in part}, checkpoint_copy / file)
    (checkpoint_copy / "model.safetensors").unlink()
    weight_map = {n: f for f, part in shards.items() for n in part}
    (checkpoint_copy / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    torch.testing.assert_close(logits_of(checkpoint_copy), expected, atol=0, rtol=0)


def test_fp8_block_quantized_checkpoint_dequantizes_at_load(checkpoint_copy):
    original = load_file(checkpoint_copy / "model.safetensors")
    expected_unquantized = logits_of(checkpoint_copy)
    quantized_tensors, dequantized_reference = {}, dict(original)
    for name, value in original.items():
        linear = value.dim() == 2 and "proj" in name and "experts" in name or name.endswith(("q_b_proj.weight", "o_proj.weight"))
        if linear:
            q, scale = quantize_fp8_blocks(value, block=16)
            quantized_tensors[name] = q
            quantized_tensors[name.replace(".weight", ".weight_scale_inv")] = scale
            dequantized_reference[name] = dequantize_fp8_blocks(q, scale, (16, 16))
            assert (dequantized_reference[name] - value).abs().max() <= scale.max() * 32  # e4m3 step at 448 is 32
        else:
            quantized_tensors[name] = value
    assert any(t.dtype == torch.float8_e4m3fn for t in quantized_tensors.values())
    save_file(quantized_tensors, checkpoint_copy / "model.safetensors")
    config = json.loads((checkpoint_copy / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [16, 16]}
    (checkpoint_copy / "config.json").write_text(json.dumps(config))
    from_fp8 = logits_of(checkpoint_copy)
    # against the same weights dequantized by the test: exact up to float32 rounding
    save_file(dequantized_reference, checkpoint_copy / "model.safetensors")
    del config["quantization_config"]
    (checkpoint_copy / "config.json").write_text(json.dumps(config))
    torch.testing.assert_close(from_fp8, logits_of(checkpoint_copy), atol=1e-5, rtol=0)
    # against the unquantized model: within the quantization error (e4m3 keeps 3 mantissa bits, ~6% per weight)
    relative = (from_fp8 - expected_unquantized).norm() / expected_unquantized.norm()
    assert 0 < relative < 0.25


def edit_tensors(folder, edit) -> None:
    tensors = load_file(folder / "model.safetensors")
    edit(tensors)
    save_file(tensors, folder / "model.safetensors")


@pytest.mark.parametrize("case, message", [
    ("missing", "missing 1 tensor(s), first: model.layers.0.self_attn.o_proj.weight"),
    ("shape", "model.layers.1.self_attn.kv_b_proj.weight: shape (3, 3) in checkpoint, expected (128, 32)"),
    ("unexpected", "unexpected tensor model.layers.0.self_attn.extra.weight"),
    ("model_type", "model_type='llama' is not supported; allowed: deepseek_v32, glm_moe_dsa, deepseek_v4"),
    ("no_weights", "no *.safetensors files"),
])
def test_malformed_checkpoints_fail_with_one_line(checkpoint_copy, case, message):
    if case == "missing":
        edit_tensors(checkpoint_copy, lambda t: t.pop("model.layers.0.self_attn.o_proj.weight"))
    elif case == "shape":
        edit_tensors(checkpoint_copy, lambda t: t.update({"model.layers.1.self_attn.kv_b_proj.weight": torch.zeros(3, 3)}))
    elif case == "unexpected":
        edit_tensors(checkpoint_copy, lambda t: t.update({"model.layers.0.self_attn.extra.weight": torch.zeros(2)}))
    elif case == "model_type":
        config = json.loads((checkpoint_copy / "config.json").read_text())
        (checkpoint_copy / "config.json").write_text(json.dumps({**config, "model_type": "llama"}))
    else:
        (checkpoint_copy / "model.safetensors").unlink()
    with pytest.raises((CheckpointError, ModelConfigError)) as info:
        load_model(checkpoint_copy, progress=False)
    assert message in str(info.value) and "\n" not in str(info.value)
    cli = subprocess.run([sys.executable, "-m", "cluster.cli", "generate", "--model", str(checkpoint_copy),
                          "--prompt-ids", "1,2"], capture_output=True, text=True)
    assert cli.returncode == 2 and message in cli.stderr and "Traceback" not in cli.stderr


def test_generation_config_eos_ids_join_the_models(tmp_path):
    import json as json_module

    from model_workers.checkpoint.model_dir import load_model_config
    from model_workers.models.dsa.config import ModelConfigError
    from support.tiny_models import BASE

    (tmp_path / "config.json").write_text(json_module.dumps({**BASE, "model_type": "deepseek_v32", "eos_token_id": 1}))
    assert load_model_config(tmp_path).eos_token_ids == (1,)
    (tmp_path / "generation_config.json").write_text(json_module.dumps({"eos_token_id": [1, 7], "temperature": 0.6}))
    assert load_model_config(tmp_path).eos_token_ids == (1, 7)
    (tmp_path / "generation_config.json").write_text("{not json")
    with pytest.raises(ModelConfigError, match="generation_config.json: unreadable eos_token_id"):
        load_model_config(tmp_path)
