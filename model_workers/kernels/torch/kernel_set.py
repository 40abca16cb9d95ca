"""The torch kernel set: each operation of kernels/interface.py bound to its torch reference implementation."""

from __future__ import annotations

import torch

from model_workers.kernels.interface import KernelSet, KeyFormat
from model_workers.kernels.torch.experts import expert_slots, expert_sum, sum_in_expert_order
from model_workers.kernels.torch.fp8_rows import Fp8Rows, PlainRows
from model_workers.kernels.torch.gather import take_rows
from model_workers.kernels.torch.indexer import indexer_scores
from model_workers.kernels.torch.sparse_mla import sparse_mla_attention
from model_workers.kernels.torch.topk import batched_causal_topk, causal_topk


def indexer_logits(index_q, index_weights, keys, key_format: KeyFormat) -> torch.Tensor:
    return indexer_scores(index_q, index_weights, keys, decode=key_format.decode)


class TorchTopk:
    def causal(self, index_q, index_weights, store, slots, query_positions, topk: int, key_format: KeyFormat,
               deterministic: bool = False) -> torch.Tensor:
        return causal_topk(index_q, index_weights, take_rows(store, slots), query_positions, topk,
                           decode=key_format.decode, deterministic=deterministic)

    def batched(self, index_q, index_weights, store, slots, query_positions, topk: int,
                key_format: KeyFormat) -> torch.Tensor:
        return batched_causal_topk(index_q, index_weights, take_rows(store, slots), query_positions, topk,
                                   decode=key_format.decode)


class TorchSparseMLA:
    """One gather-and-attend path for both phases (chunked by a byte budget)."""

    def prefill(self, q_latent, q_pe, key_rows, key_ids, scale: float, key_format: KeyFormat) -> torch.Tensor:
        return sparse_mla_attention(q_latent, q_pe, key_rows, key_ids, scale, decode=key_format.decode)

    decode = prefill


class TorchRowCodecs:
    def plain(self, dim: int, dtype: torch.dtype) -> KeyFormat:
        return PlainRows(dim, dtype)

    def fp8(self, quantized_dim: int, plain_dim: int) -> KeyFormat:
        return Fp8Rows(quantized_dim, plain_dim)


class TorchExperts:
    def sum(self, experts, x, expert_ids, weights) -> torch.Tensor:
        return expert_sum(experts, x, expert_ids, weights)

    def slots(self, experts, x, expert_ids, weights) -> torch.Tensor:
        return expert_slots(experts, x, expert_ids, weights)

    def add_in_expert_order(self, slots, expert_ids) -> torch.Tensor:
        return sum_in_expert_order(slots, expert_ids)


KERNELS = KernelSet("torch", indexer_logits, TorchTopk(), TorchSparseMLA(), TorchRowCodecs(), TorchExperts())
