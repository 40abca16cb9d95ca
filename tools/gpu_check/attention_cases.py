"""Sparse MLA (kernels/triton/sparse_mla.py) against the torch path (kernels/torch/sparse_mla.py) on the same device:
decode (one query per request, each request's top-k among its own paged keys) and a prefill chunk (queries at the
end of one request's context, each with its causal top-k), on plain and FP8 rows; then both timed.

Useful work, per selected key of a query: 2·H·(C + R) FLOPs for the scores and 2·H·C for the weighted sum; bytes:
each selected row read once per query (its stored width), plus the queries read and the output written."""

from __future__ import annotations

import torch

from gpu_check import data
from gpu_check.measure import compare
from model_workers.kernels.torch.sparse_mla import sparse_mla_attention
from model_workers.kernels.triton.launch import row_layout
from model_workers.kernels.triton.sparse_mla import sparse_mla_decode, sparse_mla_prefill

QK_HEAD_DIM = 192  # V3.2 / GLM-5: qk_nope 128 + qk_rope 64 -> the softmax scale 192^-0.5
PAGE = 64


def mla_inputs(case, dtype: torch.dtype, device, seed: int = 0) -> dict:
    gen = data.generator(device, seed)
    fmt = data.key_format(case.fp8, case.latent, case.rope, dtype)
    requests = 1 if case.prefill else case.rows
    count = data.store_size(requests, case.context, PAGE)
    store = data.stored_rows(fmt, count, case.latent + case.rope, dtype, device, gen)
    slots = data.paged_slots(requests, case.context, PAGE, device, gen)  # [R, context]
    if case.prefill:
        positions = torch.arange(case.context - case.rows, case.context, device=device)
        request_of_row = torch.zeros(case.rows, dtype=torch.long, device=device)
    else:
        positions = torch.full((case.rows,), case.context - 1, device=device)
        request_of_row = torch.arange(case.rows, device=device)
    picked = data.causal_ids(positions, case.context, case.topk, gen)  # [T, k] positions
    ids = torch.where(picked < 0, -1, slots[request_of_row[:, None], picked.clamp_min(0)])  # [T, k] store rows
    q_latent = torch.randn(case.rows, case.heads, case.latent, generator=gen, device=device, dtype=dtype)
    q_pe = torch.randn(case.rows, case.heads, case.rope, generator=gen, device=device, dtype=dtype)
    scale = (QK_HEAD_DIM if case.latent >= 512 else case.latent // 2 + case.rope) ** -0.5
    return dict(q_latent=q_latent, q_pe=q_pe, store=store, ids=ids, scale=scale, fmt=fmt)


def run_mla(case, plan, timer) -> dict:
    """One case: the comparison, then the timings with their rates."""
    inputs = mla_inputs(case, plan.dtype, timer.device)
    q_latent, q_pe, store, ids, scale, fmt = (inputs[k] for k in ("q_latent", "q_pe", "store", "ids", "scale", "fmt"))
    layout = row_layout(fmt, store)
    kernel = sparse_mla_prefill if case.prefill else sparse_mla_decode

    def triton_call():
        return kernel(q_latent, q_pe, store, ids, scale, layout)

    def torch_call():
        return sparse_mla_attention(q_latent, q_pe, store, ids, scale, decode=fmt.decode)

    expected = torch_call()
    got = triton_call()
    check = compare(got, expected, plan.rel_tol)
    del got, expected
    selected = int((ids >= 0).sum())
    flops = selected * 2 * case.heads * (2 * case.latent + case.rope)
    q_bytes = (q_latent.numel() + q_pe.numel()) * q_latent.element_size()
    nbytes = selected * fmt.bytes_per_token + q_bytes + q_latent.numel() * q_latent.element_size()
    record = {"kind": case.kind, "check": check, "passed": check["passed"], "selected_keys": selected,
              "key_bytes_per_row": fmt.bytes_per_token}
    if plan.mode != "sanitizer":
        record["timing"] = timer.kernel(triton_call, torch_call, flops, nbytes)
    return record
