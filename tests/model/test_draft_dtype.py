"""The draft's own dtype (models/common/draft_dtype.py, precision.draft_dtype_for): on a CPU a bf16 model drafts with
its MTP layer widened to float32; the target, its heads and its outputs are untouched, and the widened draft computes
what a float32 model computes from the same weights, bit for bit."""

from __future__ import annotations

import torch

from model_workers.checkpoint.loader import load_model
from model_workers.checkpoint.model_dir import resolve_model_dir
from model_workers.kernels.torch.cpu_prepack import bf16_prepack_supported, packed_weight, prepack_linear_weights
from model_workers.models.common.draft_dtype import draft_dtype, mtp_layers, widened_parameter_count, widen_draft
from model_workers.precision import DRAFT_WIDEN_MAX_BYTES, draft_dtype_for
from model_workers.runner import ExtendItem, ModelRunner

FOLDER = resolve_model_dir(None)
PROMPT = [(i * 37) % 6000 + 5 for i in range(90)]  # past index_topk: the MTP layer's indexer selects


def test_float32_drafts_on_a_cpu_only_while_the_copy_is_small():
    small, large = 1000, DRAFT_WIDEN_MAX_BYTES // 4 + 1
    assert draft_dtype_for(torch.bfloat16, "cpu", small) == torch.float32
    assert draft_dtype_for(torch.float32, "cpu", small) == torch.float32
    assert draft_dtype_for(torch.bfloat16, "cpu", large) == torch.bfloat16
    assert draft_dtype_for(torch.bfloat16, "cuda:0", small) == torch.bfloat16


def test_widening_touches_only_the_mtp_layers_and_drops_derived_copies():
    model = load_model(FOLDER, dtype=torch.bfloat16, progress=False)
    prepack_linear_weights(model)
    target = {name: (param, param.detach().clone()) for name, param in model.named_parameters()
              if not name.startswith(f"model.layers.{model.config.num_hidden_layers}.")}
    assert draft_dtype(model) == torch.bfloat16 and widened_parameter_count(model) > 0
    (mtp,) = mtp_layers(model)
    packed_before = packed_weight(mtp.eh_proj.weight)

    widen_draft(model, torch.float32)

    assert draft_dtype(model) == torch.float32
    experts = {id(p) for p in mtp.mlp.experts.parameters()}
    assert experts and all(p.dtype == torch.bfloat16 for p in mtp.mlp.experts.parameters())  # kept narrow
    assert all(p.dtype == torch.float32 for p in mtp.parameters() if id(p) not in experts)
    assert packed_weight(mtp.eh_proj.weight) is None
    if bf16_prepack_supported():  # the bf16 weight had a packed copy; the widened one carries none of it
        assert packed_before is not None
    for name, param in model.named_parameters():
        if name in target:
            same, values = target[name]
            assert param is same and torch.equal(param, values)
    assert model.head_weight().dtype == torch.bfloat16


def test_widened_draft_equals_a_float32_models_mtp_layer():
    """Same inputs (the bf16 target's hidden rows) and a float32 cache on both sides: the widened layer runs the
    ops of a float32 model whose routed MTP experts are bf16, on the same values."""
    narrow = load_model(FOLDER, dtype=torch.bfloat16, progress=False)
    wide = load_model(FOLDER, dtype=torch.float32, progress=False)  # the checkpoint is bf16: the same values
    widen_draft(narrow, torch.float32)
    experts = mtp_layers(wide)[0].mlp.experts
    for name, param in list(experts.named_parameters()):
        experts._parameters[name] = torch.nn.Parameter(param.detach().bfloat16(), requires_grad=False)
    runners = [ModelRunner(m, num_pages=4, page_size=64, kv_dtype=torch.float32) for m in (narrow, wide)]
    tables = [r.standalone_tables([100])[0] for r in runners]
    hidden = runners[0].extend([ExtendItem(tables[0], PROMPT)])  # [90, D] bf16, the target's
    assert hidden.dtype == torch.bfloat16
    drafts = [r.extend_mtp([ExtendItem(t, PROMPT[1:] + [11])], hidden, [0]) for r, t in zip(runners, tables)]
    assert drafts[0].dtype == torch.float32
    assert torch.equal(drafts[0], drafts[1])


def test_a_bf16_draft_over_a_bf16_cache_stays_close_to_the_float32_one():
    """The served arrangement: the MTP layer's keys stored in the bf16 cache, draft logits through the bf16 head."""
    model = load_model(FOLDER, dtype=torch.bfloat16, progress=False)
    runner = ModelRunner(model, num_pages=4, page_size=64)
    (table,) = runner.standalone_tables([100])
    hidden = runner.extend([ExtendItem(table, PROMPT)])
    narrow_logits = model.draft_logits(runner.extend_mtp([ExtendItem(table, PROMPT[1:] + [11])], hidden, [0]))
    widen_draft(model, torch.float32)
    wide_logits = model.draft_logits(runner.extend_mtp([ExtendItem(table, PROMPT[1:] + [11])], hidden, [0]))
    assert wide_logits.dtype == narrow_logits.dtype == torch.float32
    assert (wide_logits - narrow_logits).abs().mean() < 0.05  # bf16 rounding of logits of magnitude ~1-10
    assert (wide_logits.argmax(-1) == narrow_logits.argmax(-1)).float().mean() > 0.9


def test_a_cpu_rank_loading_bf16_weights_drafts_in_float32():
    from model_workers.checkpoint.model_dir import read_model_spec
    from model_workers.cp_worker import CPWorker
    from model_workers.spec import RankSpec

    info = CPWorker(0, 1, num_threads=None).load(RankSpec(read_model_spec(FOLDER), "bfloat16", num_pages=4, page_size=64))
    assert info["draft_dtype"] == "float32" and info["compute_dtype"] in ("bfloat16", "float32")


def test_a_wide_draft_row_reaches_narrow_experts_in_their_dtype():
    """The widened MoE sends its float32 rows to the bf16 routed experts cast (as every rank of an expert exchange
    sends them) and adds the float32 shared expert to their bf16 sum, cast back."""
    model = load_model(FOLDER, dtype=torch.bfloat16, progress=False)
    widen_draft(model, torch.float32)
    (mtp,) = mtp_layers(model)
    moe, layer_id = mtp.mlp, model.config.num_hidden_layers
    backend = ModelRunner(model, num_pages=1, page_size=64).backend
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(0))
    out = moe(x, backend, layer_id)
    ids, weights = moe.gate(x)
    routed = moe.experts(x.bfloat16(), ids, weights)  # [3, hidden] bf16
    assert out.dtype == torch.float32 and routed.dtype == torch.bfloat16
    assert torch.equal(out, routed.float() + moe.shared_experts(x))
