"""Inputs of the kernel cases, made on the device from a seeded generator: key rows in a cache's storage format
(encoded in chunks, so no float32 copy of a 128k-key store is ever whole), page-scattered slots, and causal
top-k key ids (random distinct keys at or before each query; -1 where a query has fewer)."""

from __future__ import annotations

import torch

from model_workers.kernels.torch.fp8_rows import Fp8Rows, PlainRows

ENCODE_CHUNK = 1 << 18  # rows encoded at a time


def generator(device: torch.device, seed: int) -> torch.Generator:
    return torch.Generator(device=device).manual_seed(seed)


def key_format(fp8: bool, quantized: int, plain: int, dtype: torch.dtype):
    """The torch reference's format: FP8 rows (quantized e4m3 + bf16 tail) or plain rows in `dtype`."""
    return Fp8Rows(quantized, plain) if fp8 else PlainRows(quantized + plain, dtype)


def stored_rows(fmt, count: int, dim: int, dtype: torch.dtype, device, gen: torch.Generator,
                std: float = 1.0) -> torch.Tensor:
    """[count, fmt.width] rows of N(0, std^2) values as `fmt` stores them."""
    out = torch.empty(count, fmt.width, dtype=fmt.store_dtype, device=device)
    for start in range(0, count, ENCODE_CHUNK):
        rows = min(ENCODE_CHUNK, count - start)
        values = torch.randn(rows, dim, generator=gen, device=device, dtype=dtype) * std
        out[start : start + rows] = fmt.encode(values)
    return out


def store_size(requests: int, context: int, page: int) -> int:
    """Rows of a store holding `requests` requests of `context` keys on whole pages."""
    return requests * -(-context // page) * page


def paged_slots(requests: int, context: int, page: int, device, gen: torch.Generator) -> torch.Tensor:
    """[requests, context] slots of each request's positions 0..context-1 on pages scattered over one store of
    store_size(requests, context, page) rows (as a cache's page tables place them)."""
    pages_each = -(-context // page)
    order = torch.randperm(requests * pages_each, generator=gen, device=device).view(requests, pages_each)
    slots = order[:, :, None] * page + torch.arange(page, device=device)  # [R, pages, page]
    return slots.flatten(1)[:, :context].contiguous()


def causal_ids(positions: torch.Tensor, context: int, width: int, gen: torch.Generator,
               chunk: int = 2048) -> torch.Tensor:
    """positions [T] -> [T, min(width, context)] distinct random key positions <= the query's (-1 where fewer)."""
    width = min(width, context)
    out = torch.empty(positions.shape[0], width, dtype=torch.long, device=positions.device)
    keys = torch.arange(context, device=positions.device)
    for start in range(0, positions.shape[0], chunk):
        pos = positions[start : start + chunk]
        scores = torch.rand(pos.shape[0], context, generator=gen, device=positions.device)
        scores.masked_fill_(keys[None, :] > pos[:, None], -1.0)  # rand is in [0, 1): future keys last
        values, picked = scores.topk(width, dim=-1)
        out[start : start + chunk] = torch.where(values < 0, -1, picked)
    return out


def random_routing(rows: int, experts: int, top_k: int, device, gen: torch.Generator):
    """Distinct expert ids [T, k] and positive routing weights [T, k] (float32)."""
    ids = torch.rand(rows, experts, generator=gen, device=device).topk(top_k, dim=-1).indices
    weights = torch.rand(rows, top_k, generator=gen, device=device) + 0.1
    return ids, weights
