"""The DeepSeek-V4 causal LM (docs/models.md, 'DeepSeek-V4' and 'MTP block'): decoder blocks on mHC residual streams,
the final `hc_head`, and the MTP (NextN) block.

It has the same surface as `DSAForCausalLM`, so the runner, the CP prefill and the decode loop drive both: the
"hidden" rows it hands out are the residual streams before `hc_head`, flattened to [T, hc_mult · D]. That is
what `logits` needs and exactly what the MTP block reads (the target's pre-hc_head streams). Module names
follow the `transformers` checkpoint keys; the MTP block lives at `model.layers.{num_hidden_layers}`.
"""

from __future__ import annotations

import torch
from torch import nn

from model_workers.models.common.draft_vocab import DraftVocab
from model_workers.models.common.layers import MoE, RMSNorm
from model_workers.kernels.torch.linear import linear
from model_workers.models.common.linear import Linear
from model_workers.models.common.rope import RotaryTable
from model_workers.models.deepseek_v4.attention import V4Attention
from model_workers.models.deepseek_v4.blocks import HyperConnection, HyperHead, expand_streams, v4_moe
from model_workers.models.deepseek_v4.config import SLIDING, V4Config


class V4DecoderLayer(nn.Module):
    def __init__(self, config: V4Config, layer_id: int, layer_type: str, expert_ids: range | None = None):
        super().__init__()
        self.layer_type = layer_type
        self.self_attn = V4Attention(config, layer_type)
        self.mlp = v4_moe(config, layer_id, expert_ids)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.attn_hc = HyperConnection(config)
        self.ffn_hc = HyperConnection(config)

    def forward(self, streams: torch.Tensor, token_ids: torch.Tensor, positions: torch.Tensor, table: RotaryTable,
                backend, layer_id: int) -> torch.Tensor:
        """streams [T, N, D], token_ids / positions [T] -> streams [T, N, D]."""
        post, comb, collapsed = self.attn_hc(streams)
        attn_out = self.self_attn(self.input_layernorm(collapsed), positions, table, backend, layer_id)
        streams = expand_streams(post, comb, attn_out, streams)
        post, comb, collapsed = self.ffn_hc(streams)
        mlp_out = self.mlp(self.post_attention_layernorm(collapsed), backend, layer_id, token_ids)
        return expand_streams(post, comb, mlp_out, streams)


class V4MTPLayer(V4DecoderLayer):
    """x = e_proj(enorm(embed(t_{i+1}))) + h_proj(hnorm(streams_i)) per stream -> a sliding-only block (never
    hash-routed) -> its own hc_head and norm -> the shared lm_head."""

    def __init__(self, config: V4Config, layer_id: int, expert_ids: range | None = None):
        super().__init__(config, layer_id, SLIDING, expert_ids)
        hidden = config.hidden_size
        self.enorm = RMSNorm(hidden, config.rms_norm_eps)
        self.hnorm = RMSNorm(hidden, config.rms_norm_eps)
        self.e_proj = Linear(hidden, hidden, bias=False)
        self.h_proj = Linear(hidden, hidden, bias=False)
        self.hc_head = HyperHead(config)
        self.norm = RMSNorm(hidden, config.rms_norm_eps)


class V4Body(nn.Module):
    def __init__(self, config: V4Config, num_mtp_layers: int, expert_ids: range | None):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        layers: list[nn.Module] = [V4DecoderLayer(config, i, config.layer_types[i], expert_ids)
                                   for i in range(config.num_hidden_layers)]
        layers += [V4MTPLayer(config, config.num_hidden_layers + j, expert_ids) for j in range(num_mtp_layers)]
        self.layers = nn.ModuleList(layers)
        self.hc_head = HyperHead(config)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class DeepseekV4ForCausalLM(nn.Module):
    """Pure torch: callers pass token ids, global positions and a `V4AttentionBackend`.
    `expert_ids`: the routed experts this process holds in every MoE layer (expert parallelism), default all."""

    def __init__(self, config: V4Config, num_mtp_layers: int = 0, expert_ids: range | None = None):
        super().__init__()
        self.config = config
        self.model = V4Body(config, num_mtp_layers, expert_ids)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        self.draft_vocab: DraftVocab | None = None  # `set_draft_vocab`: the draft head's reduced vocabulary
        rope_dim = config.qk_rope_head_dim
        self.main_table = RotaryTable.of(config.main_rope, rope_dim)  # sliding-only layers, the MTP block
        self.compress_table = RotaryTable.of(config.compress_rope, rope_dim)  # CSA / HCA layers

    @property
    def num_mtp_layers(self) -> int:
        return len(self.model.layers) - self.config.num_hidden_layers

    @property
    def hidden_width(self) -> int:
        """Width of the hidden rows this model hands out: the hc_mult streams, flattened."""
        return self.config.hc_mult * self.config.hidden_size

    def table(self, layer_type: str) -> RotaryTable:
        return self.main_table if layer_type == SLIDING else self.compress_table

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, backend) -> torch.Tensor:
        """input_ids, positions [T] -> the residual streams before hc_head, [T, hc_mult · D]."""
        embedded = self.model.embed_tokens(input_ids)  # [T, D]
        streams = embedded.unsqueeze(1).expand(-1, self.config.hc_mult, -1).contiguous()  # [T, N, D]
        for layer_id in range(self.config.num_hidden_layers):
            layer = self.model.layers[layer_id]
            streams = layer(streams, input_ids, positions, self.table(layer.layer_type), backend, layer_id)
        return streams.flatten(1)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [..., hc_mult · D] (pre-hc_head streams) -> logits [..., vocab] float32."""
        return self._head(hidden, self.model.hc_head, self.model.norm)

    def join_experts(self, backend, mtp_index: int | None = None) -> None:
        """One forward's expert exchanges with no rows of this process (DP-attention lockstep)."""
        n = self.config.num_hidden_layers
        for layer_id in (range(n) if mtp_index is None else [n + mtp_index]):
            mlp = self.model.layers[layer_id].mlp
            if isinstance(mlp, MoE):
                mlp.join(backend, layer_id)

    def mtp_forward(self, next_ids: torch.Tensor, prev_hidden: torch.Tensor, positions: torch.Tensor, backend,
                    mtp_index: int = 0) -> torch.Tensor:
        """MTP block `mtp_index` on next_ids [T] (t_{i+1}), prev_hidden [T, N·D] (streams at i; the target's, or
        the block's own for a recursive draft step), positions [T] (i) -> its streams [T, N·D]."""
        layer_id = self.config.num_hidden_layers + mtp_index
        mtp: V4MTPLayer = self.model.layers[layer_id]
        n, hidden = self.config.hc_mult, self.config.hidden_size
        dtype = mtp.e_proj.weight.dtype  # the draft's (models/common/draft_dtype.py): the target's rows come in cast
        embedded = mtp.e_proj(mtp.enorm(self.model.embed_tokens(next_ids).to(dtype)))  # [T, D]
        streams = embedded.unsqueeze(1) + mtp.h_proj(mtp.hnorm(prev_hidden.to(dtype).view(-1, n, hidden)))  # [T, N, D]
        streams = V4DecoderLayer.forward(mtp, streams, next_ids, positions, self.main_table, backend, layer_id)
        return streams.flatten(1)

    def mtp_logits(self, mtp_hidden: torch.Tensor, mtp_index: int = 0) -> torch.Tensor:
        mtp: V4MTPLayer = self.model.layers[self.config.num_hidden_layers + mtp_index]
        return self._head(mtp_hidden, mtp.hc_head, mtp.norm)

    def draft_logits(self, mtp_hidden: torch.Tensor, mtp_index: int = 0) -> torch.Tensor:
        """What speculation drafts from: `mtp_logits`, or over the draft vocabulary when one is set."""
        mtp: V4MTPLayer = self.model.layers[self.config.num_hidden_layers + mtp_index]
        return self._head(mtp_hidden, mtp.hc_head, mtp.norm, self.draft_vocab)

    def set_draft_vocab(self, token_ids: torch.Tensor | None) -> None:
        """Drafts over `token_ids` [N] from now on (None: the full vocabulary); the head rows are copied now."""
        self.draft_vocab = None if token_ids is None else DraftVocab(token_ids, self.lm_head.weight)

    def _head(self, hidden: torch.Tensor, hc_head: HyperHead, norm: RMSNorm, vocab: DraftVocab | None = None):
        """hidden [..., N·D] -> logits [..., vocab] float32 (through `vocab`'s reduced head when given)."""
        shape = hidden.shape[:-1]
        streams = hidden.reshape(-1, self.config.hc_mult, self.config.hidden_size)  # [R, N, D]
        normed = norm(hc_head(streams)).to(self.lm_head.weight.dtype)  # [R, D]; a wider draft's rows cast to the head's
        logits = vocab(normed) if vocab is not None else linear(normed, self.lm_head.weight).float()
        return logits.view(*shape, logits.shape[-1])
