"""Device ceilings the kernel rates are compared with: host <-> device copy bandwidth (pinned memory), device copy
bandwidth (bytes read + written per second), and a bf16 N^3 matmul's TFLOP/s; CUDA events, medians of a few runs.
On a CPU (--dry-run): a memory copy and a float32 matmul at small sizes, labelled as not meaningful."""

from __future__ import annotations

import torch

from gpu_check.measure import DRY_LABEL, Timer

WARM_MATMULS = 30


def measure_ceilings(timer: Timer, plan, entry: dict) -> None:
    device = timer.device
    results: dict = {}
    entry["results"] = results
    results["copy"] = device_copy(timer, plan.copy_mb * 2**20)
    results["copy_gbps"] = results["copy"]["gbps"]
    if device.type == "cuda" and plan.host_mb:
        for way, rates in host_copies(timer, plan.host_mb * 2**20).items():
            results[way], results[f"{way}_gbps"] = rates, rates["gbps"]
    else:
        results["host_copies"] = "skipped: no device (a CPU run has no host <-> device copy)"
    results["matmul"] = matmul(timer, plan.matmul_n)
    results["matmul_tflops"] = results["matmul"]["tflops"]
    if device.type != "cuda":
        results["note"] = DRY_LABEL
    timer.ceilings.update(copy_gbps=results["copy_gbps"], matmul_tflops=results["matmul_tflops"])


def device_copy(timer: Timer, nbytes: int) -> dict:
    src = torch.empty(nbytes, dtype=torch.uint8, device=timer.device).fill_(1)
    dst = torch.empty_like(src)
    measured = timer.time(lambda: dst.copy_(src))
    return {**measured, "bytes": nbytes, "gbps": 2 * nbytes / measured["ms"] / 1e6,
            "counted": "bytes read + bytes written"}


def host_copies(timer: Timer, nbytes: int) -> dict:
    """Pinned host memory to the device and back."""
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True).fill_(1)
    on_device = torch.empty(nbytes, dtype=torch.uint8, device=timer.device)
    h2d = timer.time(lambda: on_device.copy_(host, non_blocking=True))
    d2h = timer.time(lambda: host.copy_(on_device, non_blocking=True))
    return {"h2d": {**h2d, "bytes": nbytes, "gbps": nbytes / h2d["ms"] / 1e6},
            "d2h": {**d2h, "bytes": nbytes, "gbps": nbytes / d2h["ms"] / 1e6}}


def matmul(timer: Timer, size: int) -> dict:
    """A size^3 matmul in bf16 (float32 on a CPU), after enough calls to bring the clocks up."""
    dtype = torch.bfloat16 if timer.device.type == "cuda" else torch.float32
    a = torch.randn(size, size, dtype=dtype, device=timer.device)
    b = torch.randn(size, size, dtype=dtype, device=timer.device)
    out = torch.empty(size, size, dtype=dtype, device=timer.device)
    for _ in range(WARM_MATMULS if timer.device.type == "cuda" else 1):
        torch.mm(a, b, out=out)
    measured = timer.time(lambda: torch.mm(a, b, out=out))
    return {**measured, "n": size, "dtype": str(dtype), "tflops": 2 * size**3 / measured["ms"] / 1e9}
