"""The Triton kernel set: each operation of kernels/interface.py bound to its Triton kernel (the modules beside
this one); deterministic top-k (ties to the earliest key, fixed tiles) stays on the torch reference's rule."""

from __future__ import annotations

import torch

from model_workers.kernels.interface import KernelSet, KeyFormat
from model_workers.kernels.torch.kernel_set import KERNELS as TORCH_KERNELS
from model_workers.kernels.triton import sparse_mla, topk
from model_workers.kernels.triton.experts import TritonExperts
from model_workers.kernels.triton.fp8_rows import TritonRowCodecs
from model_workers.kernels.triton.indexer import indexer_logits as logits_kernel
from model_workers.kernels.triton.launch import row_layout


def indexer_logits(index_q, index_weights, keys, key_format: KeyFormat) -> torch.Tensor:
    """Unmasked scores [T, K] over stored rows `keys` [K, W] (every key visible to every query)."""
    every_key = torch.arange(keys.shape[0], device=keys.device)
    last = torch.full((index_q.shape[0],), keys.shape[0] - 1, dtype=torch.long, device=keys.device)
    return logits_kernel(index_q, index_weights, keys, every_key, last, row_layout(key_format, keys))


class TritonTopk:
    def causal(self, index_q, index_weights, store, slots, query_positions, topk_width: int, key_format: KeyFormat,
               deterministic: bool = False) -> torch.Tensor:
        if deterministic:
            return TORCH_KERNELS.topk.causal(index_q, index_weights, store, slots, query_positions, topk_width,
                                             key_format, deterministic=True)
        return topk.causal_topk(index_q, index_weights, store, slots, query_positions, topk_width,
                                row_layout(key_format, store))

    def batched(self, index_q, index_weights, store, slots, query_positions, topk_width: int,
                key_format: KeyFormat) -> torch.Tensor:
        return topk.batched_topk(index_q, index_weights, store, slots, query_positions, topk_width,
                                 row_layout(key_format, store))


class TritonSparseMLA:
    def prefill(self, q_latent, q_pe, key_rows, key_ids, scale: float, key_format: KeyFormat) -> torch.Tensor:
        return sparse_mla.sparse_mla_prefill(q_latent, q_pe, key_rows, key_ids, scale, row_layout(key_format, key_rows))

    def decode(self, q_latent, q_pe, key_rows, key_ids, scale: float, key_format: KeyFormat) -> torch.Tensor:
        return sparse_mla.sparse_mla_decode(q_latent, q_pe, key_rows, key_ids, scale, row_layout(key_format, key_rows))


KERNELS = KernelSet("triton", indexer_logits, TritonTopk(), TritonSparseMLA(), TritonRowCodecs(), TritonExperts())
