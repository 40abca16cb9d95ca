"""Decoder layers, the DSA causal LM body, and the MTP (NextN) layer.

Module names follow the Hugging Face checkpoint keys (`model.layers.{i}.self_attn.q_a_proj`, ...), so
loading is a name lookup. The MTP layer lives at `model.layers.{num_hidden_layers}`.
"""

from __future__ import annotations

import torch
from torch import nn

from model_workers.models.dsa.attention import MLAttention
from model_workers.models.dsa.contract import AttentionBackend
from model_workers.models.dsa.config import ModelConfig
from model_workers.models.common.draft_vocab import DraftVocab
from model_workers.models.common.layers import MLP, MoE, RMSNorm
from model_workers.models.dsa.moe import deepseek_moe
from model_workers.kernels.torch.linear import linear
from model_workers.models.common.linear import Linear
from model_workers.models.common.rope import RotaryTable


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, has_indexer: bool, sparse_mlp: bool, expert_ids: range | None = None):
        super().__init__()
        self.self_attn = MLAttention(config, has_indexer)
        self.mlp = deepseek_moe(config, expert_ids) if sparse_mlp else MLP(config.hidden_size, config.intermediate_size)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x, cos, sin, backend: AttentionBackend, layer_id: int, shared_topk):
        """x [T, hidden] -> (x [T, hidden], top-k ids of this layer)."""
        attn_out, topk_ids = self.self_attn(self.input_layernorm(x), cos, sin, backend, layer_id, shared_topk)
        x = x + attn_out
        normed = self.post_attention_layernorm(x)
        mlp_out = self.mlp(normed, backend, layer_id) if isinstance(self.mlp, MoE) else self.mlp(normed)
        return x + mlp_out, topk_ids


class SharedHead(nn.Module):
    def __init__(self, config: ModelConfig, has_own_head: bool):
        super().__init__()
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.head = Linear(config.hidden_size, config.vocab_size, bias=False) if has_own_head else None


class MTPLayer(DecoderLayer):
    """h' = eh_proj([enorm(embed(t_{i+1})) ‖ hnorm(h_i)]) -> decoder layer -> shared_head.norm -> lm_head."""

    def __init__(self, config: ModelConfig, sparse_mlp: bool, has_own_head: bool, expert_ids: range | None = None):
        super().__init__(config, has_indexer=True, sparse_mlp=sparse_mlp, expert_ids=expert_ids)
        self.enorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.hnorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.eh_proj = Linear(2 * config.hidden_size, config.hidden_size, bias=False)
        self.shared_head = SharedHead(config, has_own_head)


class DSABody(nn.Module):
    def __init__(self, config: ModelConfig, mtp_layout: list[tuple[bool, bool]], expert_ids: range | None):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        layers: list[nn.Module] = [
            DecoderLayer(config, config.indexer_types[i] == "full", config.mlp_layer_types[i] == "sparse", expert_ids)
            for i in range(config.num_hidden_layers)
        ]
        layers += [MTPLayer(config, sparse, own_head, expert_ids) for sparse, own_head in mtp_layout]
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class DSAForCausalLM(nn.Module):
    """Pure torch: callers pass token ids, global positions and an attention backend.

    `mtp_layout` lists, per MTP layer present in the checkpoint, (MoE MLP?, own shared_head.head?).
    `expert_ids`: the routed experts this process holds in every MoE layer (expert parallelism), default all.
    """

    def __init__(self, config: ModelConfig, mtp_layout: list[tuple[bool, bool]] | None = None,
                 expert_ids: range | None = None):
        super().__init__()
        self.config = config
        self.model = DSABody(config, mtp_layout or [], expert_ids)
        self.lm_head = None if config.tie_word_embeddings else Linear(config.hidden_size, config.vocab_size, bias=False)
        self.rotary = RotaryTable(config)
        self.draft_vocab: DraftVocab | None = None  # `set_draft_vocab`: the draft head's reduced vocabulary

    @property
    def num_mtp_layers(self) -> int:
        return len(self.model.layers) - self.config.num_hidden_layers

    @property
    def hidden_width(self) -> int:
        """Width of the hidden rows `forward` returns and `logits` / `mtp_forward` read."""
        return self.config.hidden_size

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, backend: AttentionBackend) -> torch.Tensor:
        """input_ids, positions [T] -> final-normed hidden states [T, hidden] (the rows this process owns)."""
        cos, sin = self.rotary.for_positions(positions)
        x = self.model.embed_tokens(input_ids)
        topk_ids = None
        for layer_id in range(self.config.num_hidden_layers):
            x, topk_ids = self.model.layers[layer_id](x, cos, sin, backend, layer_id, topk_ids)
        return self.model.norm(x)

    def join_experts(self, backend, mtp_index: int | None = None) -> None:
        """One forward's expert exchanges with no rows of this process: every MoE layer of the target body
        (`mtp_index` None) or of MTP layer `mtp_index`, in forward order (DP-attention lockstep)."""
        n = self.config.num_hidden_layers
        layer_ids = range(n) if mtp_index is None else [n + mtp_index]
        for layer_id in layer_ids:
            mlp = self.model.layers[layer_id].mlp
            if isinstance(mlp, MoE):
                mlp.join(backend, layer_id)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [T, hidden] -> logits [T, vocab] in float32."""
        return linear(hidden, self.head_weight()).float()

    def head_weight(self) -> torch.Tensor:
        """[vocab, hidden]: the LM head, or the embedding it is tied to."""
        return self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def linear_weights(self) -> tuple[torch.Tensor, ...]:
        """A head tied to the embedding, which `linear` multiplies as a plain tensor (kernels/torch/cpu_prepack.py)."""
        return (self.head_weight(),) if self.lm_head is None else ()

    def mtp_forward(
        self,
        next_ids: torch.Tensor,
        prev_hidden: torch.Tensor,
        positions: torch.Tensor,
        backend: AttentionBackend,
        mtp_index: int = 0,
    ) -> torch.Tensor:
        """One MTP layer: next_ids [T] (t_{i+1}), prev_hidden [T, hidden] (h_i), positions [T] (i).

        Returns the layer's hidden output [T, hidden] before `shared_head.norm`; feed it back as
        `prev_hidden` for a recursive draft step, or pass it to `mtp_logits`.
        """
        layer_id = self.config.num_hidden_layers + mtp_index
        mtp: MTPLayer = self.model.layers[layer_id]
        cos, sin = self.rotary.for_positions(positions)
        dtype = mtp.eh_proj.weight.dtype  # the draft's (models/common/draft_dtype.py): the target's rows come in cast
        embedded = mtp.enorm(self.model.embed_tokens(next_ids).to(dtype))
        x = mtp.eh_proj(torch.cat([embedded, mtp.hnorm(prev_hidden.to(dtype))], dim=-1))  # [T, hidden]
        x, _ = DecoderLayer.forward(mtp, x, cos, sin, backend, layer_id, None)
        return x

    def mtp_logits(self, mtp_hidden: torch.Tensor, mtp_index: int = 0) -> torch.Tensor:
        """mtp_hidden [T, hidden] -> the MTP head's logits [T, vocab] float32 over the full vocabulary."""
        head = self.mtp_head_weight(mtp_index)  # the shared LM head stays in the target's dtype
        return linear(self._mtp_normed(mtp_hidden, mtp_index).to(head.dtype), head).float()

    def draft_logits(self, mtp_hidden: torch.Tensor, mtp_index: int = 0) -> torch.Tensor:
        """What speculation drafts from: `mtp_logits`, or with a draft vocabulary set, logits [T, vocab] that
        only its tokens take (the others NOT_DRAFTED), for a fraction of the head's reads. The vocabulary holds
        MTP layer 0's head rows, so other MTP layers draft over the full vocabulary."""
        if self.draft_vocab is None or mtp_index != 0:
            return self.mtp_logits(mtp_hidden, mtp_index)
        return self.draft_vocab(self._mtp_normed(mtp_hidden, mtp_index).to(self.draft_vocab.weight.dtype))

    def set_draft_vocab(self, token_ids: torch.Tensor | None) -> None:
        """Drafts over `token_ids` [N] from now on (None: the full vocabulary); the head rows are copied now."""
        self.draft_vocab = None if token_ids is None else DraftVocab(token_ids, self.mtp_head_weight(0))

    def mtp_head_weight(self, mtp_index: int = 0) -> torch.Tensor:
        """[vocab, hidden]: the MTP layer's own head, else the shared LM head."""
        mtp: MTPLayer = self.model.layers[self.config.num_hidden_layers + mtp_index]
        return mtp.shared_head.head.weight if mtp.shared_head.head is not None else self.head_weight()

    def _mtp_normed(self, mtp_hidden: torch.Tensor, mtp_index: int) -> torch.Tensor:
        return self.model.layers[self.config.num_hidden_layers + mtp_index].shared_head.norm(mtp_hidden)
