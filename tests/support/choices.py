"""The discrete choices of one prefill — the indexer's top-k key set and the MoE's expert set of every row in
every layer — and which rows they set apart between two runs of the same prompt (bf16 against fp32)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from model_workers.kernels.registry import kernel_set
from model_workers.models.dsa.backend import DSABackend
from model_workers.models.dsa.moe import MoEGate
from model_workers.runner import ExtendItem, ModelRunner


class RecordingBackend(DSABackend):
    """The DSA backend that keeps each layer's top-k selection (slots = positions on a standalone table)."""

    def __init__(self, cache):
        super().__init__(cache, kernel_set())
        self.picked: dict[int, torch.Tensor] = {}

    def select_topk(self, layer_id: int, index_q, index_weights, topk: int) -> torch.Tensor:
        out = super().select_topk(layer_id, index_q, index_weights, topk)  # [T, k]
        self.picked[layer_id] = out.clone()
        return out


@dataclass
class PrefillChoices:
    logits: torch.Tensor  # [T, V] float32
    num_layers: int
    topk: dict[int, torch.Tensor]  # layer -> [T, k] picked key positions, sorted per row
    experts: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> [T, top_k] expert ids, sorted


def prefill_with_choices(model, ids: list[int]) -> PrefillChoices:
    runner = ModelRunner(model, num_pages=-(-len(ids) // 8), page_size=8)
    runner.backend = RecordingBackend(runner.cache)
    experts, hooks = {}, []
    for layer_id, layer in enumerate(model.model.layers[: model.config.num_hidden_layers]):
        gate = getattr(layer.mlp, "gate", None)
        if isinstance(gate, MoEGate):
            hooks.append(gate.register_forward_hook(
                lambda module, args, out, layer_id=layer_id: experts.__setitem__(layer_id, out[0].sort(-1).values)))
    try:
        (table,) = runner.standalone_tables([len(ids)])
        logits = model.logits(runner.extend([ExtendItem(table, ids)]))
    finally:
        for hook in hooks:
            hook.remove()
    picked = {layer: p.sort(-1).values for layer, p in runner.backend.picked.items()}
    return PrefillChoices(logits, model.config.num_hidden_layers, picked, experts)


def flipped_rows(a: PrefillChoices, b: PrefillChoices) -> torch.Tensor:
    """[T] bool: rows whose top-k key set or expert set differs between the runs in some layer."""
    flipped = torch.zeros(a.logits.shape[0], dtype=torch.bool)
    for layer in a.topk:
        flipped |= (a.topk[layer] != b.topk[layer]).any(-1)
    for layer in a.experts:
        flipped |= (a.experts[layer] != b.experts[layer]).any(-1)
    return flipped


def touched_rows(a: PrefillChoices, b: PrefillChoices) -> torch.Tensor:
    """[T] bool: rows a flip reaches — flipped themselves, or attending (in run b) to a key of a row it reached
    in an earlier layer. The other rows computed exactly the same operations in both runs."""
    touched = torch.zeros(a.logits.shape[0], dtype=torch.bool)
    picked = None
    for layer in range(a.num_layers):
        picked = b.topk.get(layer, picked)  # "shared" layers reuse the previous full layer's selection
        if picked is not None:
            reads = torch.stack([touched[row[row >= 0]].any() for row in picked])
            touched = touched | reads
        if layer in a.topk:
            touched |= (a.topk[layer] != b.topk[layer]).any(-1)
        if layer in a.experts:
            touched |= (a.experts[layer] != b.experts[layer]).any(-1)
    return touched
