"""bf16 weights packed once for oneDNN (kernels/torch/cpu_prepack.py) change no bit: a prefill, a decode row, a
3-row verify, the MTP forward and both heads of the default model equal the unpacked model's; a weight changed in
place retires its packed copy; deterministic inference (a dispatch mode) keeps F.linear."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from model_workers.checkpoint.draft_vocab import resolve_token_map
from model_workers.checkpoint.loader import load_model
from model_workers.checkpoint.model_dir import resolve_model_dir
from model_workers.kernels.torch.batch_invariant import BatchInvariantMode
from model_workers.kernels.torch.cpu_prepack import PACKED_ATTR, bf16_prepack_supported, packed_weight, prepack_linear_weights
from model_workers.kernels.torch.linear import linear
from model_workers.runner import ExtendItem, ModelRunner

pytestmark = pytest.mark.skipif(not bf16_prepack_supported(), reason="no bf16 oneDNN kernels on this CPU")


def bf16_runner(packed: bool) -> ModelRunner:
    folder = resolve_model_dir(None)
    model = load_model(folder, dtype=torch.bfloat16, progress=False)
    model.set_draft_vocab(resolve_token_map("auto", folder, model.config.vocab_size))
    if packed:
        assert prepack_linear_weights(model) > 0
    return ModelRunner(model, num_pages=8, page_size=64)


def outputs(runner: ModelRunner) -> list[torch.Tensor]:
    """Hidden states and logits of a 90-token prefill (past index_topk: the indexer scores), one decode row,
    a 3-row verify, the MTP forward over them and the draft head."""
    model, (table,) = runner.model, runner.standalone_tables([100])
    prompt = [(i * 37) % 6000 + 5 for i in range(90)]
    prefill = runner.extend([ExtendItem(table, prompt)])
    decode = runner.extend([ExtendItem(table, [11])], is_extend=False)
    verify = runner.extend([ExtendItem(table, [12, 13, 14])])
    mtp = runner.extend_mtp([ExtendItem(table, prompt[1:] + [11])], prefill, [0])
    return [prefill, model.logits(prefill), decode, model.logits(decode), verify, model.logits(verify), mtp,
            model.draft_logits(mtp)]


def test_packed_weights_change_no_bit_of_the_default_model():
    runners = bf16_runner(False), bf16_runner(True)  # loaded as a rank loads them
    with torch.inference_mode():
        plain, packed = outputs(runners[0]), outputs(runners[1])
    for name, a, b in zip(["prefill", "logits", "decode", "logits", "verify", "logits", "mtp", "draft"], plain, packed):
        assert torch.equal(a, b), name


def test_a_weight_changed_in_place_retires_its_packed_copy():
    layer = torch.nn.Linear(16, 24, bias=False).to(torch.bfloat16)
    x = torch.randn(2, 16).bfloat16()
    assert prepack_linear_weights(layer) == 1 and packed_weight(layer.weight) is not None
    with torch.no_grad():
        layer.weight.mul_(2)
    assert packed_weight(layer.weight) is None
    assert torch.equal(linear(x, layer.weight), F.linear(x, layer.weight))


def test_a_dispatch_mode_keeps_f_linear():
    weight = torch.randn(24, 16).bfloat16()
    zeros = torch.ops.mkldnn._reorder_linear_weight(torch.zeros(24, 16).bfloat16(), 1)
    setattr(weight, PACKED_ATTR, (zeros, weight._version))  # a packed copy that would give zeros
    x = torch.randn(3, 16).bfloat16()
    assert not linear(x, weight).any()  # the packed copy is what runs outside the mode
    with BatchInvariantMode():
        assert torch.equal(linear(x, weight), F.linear(x, weight))
