"""The lightning indexer's logits and top-k (kernels/triton/indexer.py, topk.py) against the torch path, and the FP8
row writer (kernels/triton/fp8_rows.py) against the torch encoder, on the same device.

Indexer: requests of one query (decode, each with its own paged keys) or one request's prefill chunk (its rows
sharing the keys, causal). Logits equal on causal keys within tolerance and -inf after the query; top-k sets equal
up to ties. Useful work: 2·H·D FLOPs per causal key per query; bytes: the keys read (stored width). The top-k
timing is the kernel set's `topk` (what a model calls), Triton's against torch's; the logits are timed alone."""

from __future__ import annotations

import torch

from gpu_check import data
from gpu_check.measure import compare, topk_agreement
from model_workers.kernels.torch.indexer import indexer_scores
from model_workers.kernels.torch.kernel_set import KERNELS as TORCH_KERNELS
from model_workers.kernels.triton.fp8_rows import encode_rows
from model_workers.kernels.triton.indexer import indexer_logits
from model_workers.kernels.triton.kernel_set import KERNELS as TRITON_KERNELS
from model_workers.kernels.triton.launch import row_layout

PAGE = 64


def indexer_inputs(case, dtype: torch.dtype, device, seed: int = 1) -> dict:
    gen = data.generator(device, seed)
    fmt = data.key_format(case.fp8, case.dim, 0, dtype)
    store = data.stored_rows(fmt, data.store_size(case.requests, case.context, PAGE), case.dim, dtype, device, gen)
    slots = data.paged_slots(case.requests, case.context, PAGE, device, gen)  # [R, K]
    first = case.context - case.rows
    positions = (first + torch.arange(case.rows, device=device)).expand(case.requests, -1).contiguous()  # [R, n]
    q = torch.randn(case.requests, case.rows, case.heads, case.dim, generator=gen, device=device, dtype=dtype)
    weights = torch.rand(case.requests, case.rows, case.heads, generator=gen, device=device) * case.heads**-0.5
    return dict(fmt=fmt, store=store, slots=slots, positions=positions, q=q, weights=weights)


def reference_scores(q, weights, store, slots, positions, fmt) -> torch.Tensor:
    """[R * n, K] float32 scores by the torch reference, -inf after each query."""
    rows = [indexer_scores(q[r], weights[r], store[slots[r]], decode=fmt.decode) for r in range(q.shape[0])]
    scores = torch.cat(rows)  # [R * n, K]
    future = torch.arange(scores.shape[1], device=scores.device)[None, :] > positions.reshape(-1)[:, None]
    return scores.masked_fill_(future, float("-inf"))


def run_indexer(case, plan, timer) -> dict:
    inputs = indexer_inputs(case, plan.dtype, timer.device)
    fmt, store, slots, positions, q, weights = (inputs[k] for k in ("fmt", "store", "slots", "positions", "q",
                                                                     "weights"))
    layout = row_layout(fmt, store)
    shared = case.prefill  # one request's chunk: its rows share the keys

    def logits():
        return indexer_logits(q.flatten(0, 1), weights.flatten(0, 1), store, slots[0] if shared else slots,
                              positions.flatten(), layout, rows_per_group=case.rows)

    def topk_with(kernels):
        if shared:
            return lambda: kernels.topk.causal(q[0], weights[0], store, slots[0], positions[0], case.topk, fmt)
        return lambda: kernels.topk.batched(q, weights, store, slots, positions, case.topk, fmt)

    expected = reference_scores(q, weights, store, slots, positions, fmt)
    got = logits()
    causal = torch.isfinite(expected)
    check = compare(got[causal], expected[causal], plan.rel_tol)
    check["future_is_neg_inf"] = bool(torch.isneginf(got[~causal]).all())
    check["passed"] = check["passed"] and check["future_is_neg_inf"]
    picks = topk_with(TRITON_KERNELS)().reshape(expected.shape[0], -1)
    reference = topk_with(TORCH_KERNELS)().reshape(expected.shape[0], -1)
    tie_tol = 2 * check["max_abs_err"] + 1e-6 * check["ref_max_abs"]  # keys closer than both paths' errors
    agreement = topk_agreement(picks, reference, expected, tie_tol=tie_tol)
    causal_keys = int(causal.sum())
    del got, picks, reference, expected, causal
    flops = causal_keys * 2 * case.heads * case.dim
    key_bytes = case.requests * case.context * fmt.bytes_per_token
    record = {"kind": case.kind, "check": check, "topk": agreement, "passed": check["passed"] and agreement["passed"],
              "key_bytes_per_row": fmt.bytes_per_token}
    if plan.mode != "sanitizer":
        logits_time = timer.time(logits, graph=True, warm=True)
        timing = timer.kernel(topk_with(TRITON_KERNELS), topk_with(TORCH_KERNELS), flops, key_bytes)
        timing["logits"] = {**logits_time, **timer.rates(logits_time["ms"], flops, key_bytes)}
        timing["counted"] = "useful bytes = the keys read once; flops = 2*H*D per causal key per query"
        record["timing"] = timing
    return record


def run_rows(case, plan, timer) -> dict:
    """The FP8 row writer: bytes identical to the torch encoder's, then timed (bytes read + written)."""
    gen = data.generator(timer.device, 2)
    fmt = data.key_format(True, case.quantized, case.plain, plan.dtype)
    rows = torch.randn(case.rows, case.quantized + case.plain, generator=gen, device=timer.device, dtype=plan.dtype)
    rows[0].zero_()  # an all-zero block: scale 1
    rows[1, : case.quantized] *= 1e-30 if plan.dtype == torch.float32 else 1e-3  # tiny scales
    got = encode_rows(rows, case.quantized, case.plain)
    expected = fmt.encode(rows)
    identical = bool(torch.equal(got, expected))
    differing = int((got != expected).any(dim=1).sum())
    record = {"kind": case.kind, "check": {"bit_identical": identical, "rows_differing": differing},
              "passed": identical}
    if plan.mode != "sanitizer":
        nbytes = rows.numel() * rows.element_size() + got.numel()
        record["timing"] = timer.kernel(lambda: encode_rows(rows, case.quantized, case.plain),
                                        lambda: fmt.encode(rows), 0.0, nbytes)
    return record
