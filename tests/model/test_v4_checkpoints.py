"""DeepSeek-V4 checkpoints load in every spelling `transformers` loads: its module names (`state_dict()`), what its
`save_pretrained` writes, and the release names with a release config.json; a release FP8 + FP4 checkpoint
gives the logits of its dequantized twin; what cannot be loaded fails in one line."""

import json

import pytest
import torch
from safetensors.torch import save_file

from model_workers.checkpoint.loader import CheckpointError, load_model
from model_workers.runner import ExtendItem, ModelRunner
from support.v4_checkpoints import write_release_checkpoint
from support.v4_models import TINY_V4, hf_v4

IDS = torch.randint(2, 128, (29,), generator=torch.Generator().manual_seed(4)).tolist()


@pytest.fixture(scope="module")
def reference():
    return hf_v4(TINY_V4, 2)


def prefill_logits(model) -> torch.Tensor:
    runner = ModelRunner(model, num_pages=4, page_size=16)
    (table,) = runner.standalone_tables([len(IDS)])
    hidden = runner.extend([ExtendItem(table, IDS)])
    with torch.no_grad():
        return model.logits(hidden)


def reference_logits(reference) -> torch.Tensor:
    with torch.no_grad():
        return reference(torch.tensor([IDS])).logits[0]


def test_save_pretrained_and_module_names_load(reference, tmp_path):
    reference.save_pretrained(tmp_path / "saved")
    expected = reference_logits(reference)
    torch.testing.assert_close(prefill_logits(load_model(tmp_path / "saved", progress=False)), expected,
                               atol=1e-4, rtol=0)
    (tmp_path / "plain").mkdir()
    (tmp_path / "plain" / "config.json").write_text((tmp_path / "saved" / "config.json").read_text())
    state = {k: v.contiguous() for k, v in reference.state_dict().items() if "rotary_emb" not in k}
    save_file(state, tmp_path / "plain" / "model.safetensors")
    torch.testing.assert_close(prefill_logits(load_model(tmp_path / "plain", progress=False)), expected,
                               atol=1e-4, rtol=0)


def test_release_names_and_config_load(reference, tmp_path):
    state = {k: v for k, v in reference.state_dict().items() if "rotary_emb" not in k}
    write_release_checkpoint(state, TINY_V4, tmp_path, quantized=False)
    assert len(json.loads((tmp_path / "config.json").read_text())["compress_ratios"]) > TINY_V4["num_hidden_layers"]
    torch.testing.assert_close(prefill_logits(load_model(tmp_path, progress=False)), reference_logits(reference),
                               atol=1e-4, rtol=0)


def test_fp8_and_fp4_release_checkpoint_equals_its_dequantized_twin(reference, tmp_path):
    state = {k: v for k, v in reference.state_dict().items() if "rotary_emb" not in k}
    twin = write_release_checkpoint(state, TINY_V4, tmp_path, quantized=True)
    changed = [k for k in state if not torch.equal(twin[k], state[k])]
    assert any("experts.gate_up_proj" in k for k in changed) and any("q_a_proj" in k for k in changed)
    reference.load_state_dict(twin, strict=False)
    torch.testing.assert_close(prefill_logits(load_model(tmp_path, progress=False)), reference_logits(reference),
                               atol=1e-4, rtol=0)


def test_unloadable_checkpoints_fail_in_one_line(reference, tmp_path):
    state = {k: v for k, v in reference.state_dict().items() if "rotary_emb" not in k}
    write_release_checkpoint(state, TINY_V4, tmp_path, quantized=True)
    from safetensors.torch import load_file

    tensors = load_file(tmp_path / "model.safetensors")
    del tensors["layers.0.attn.wq_a.scale"]
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"^layers\.0\.attn\.wq_a\.weight: FP8 tensor without its scale"):
        load_model(tmp_path, progress=False)
    tensors["layers.0.attn.wq_a.scale"] = torch.ones(1, 1).to(torch.float8_e8m0fnu)
    saved_norm = tensors["layers.0.attn_norm.weight"]
    tensors["layers.0.attn_norm.weight"] = saved_norm.to(torch.int8)
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"^layers\.0\.attn_norm\.weight: torch\.int8 tensor; packed FP4"):
        load_model(tmp_path, progress=False)
    tensors["layers.0.attn_norm.weight"] = saved_norm
    tensors["layers.0.attn.bogus.weight"] = torch.zeros(2)
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(CheckpointError, match="unexpected tensor"):
        load_model(tmp_path, progress=False)
