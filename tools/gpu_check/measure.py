"""Timing and comparisons.

Timing on CUDA: a warm-up call, then CUDA events around back-to-back calls (enough to fill `target_ms`), replayed
from a captured CUDA graph where the callable makes no host sync (the Triton kernels: the GPU's time, not Python's
launch cost) or called eagerly (the torch path); the median over `reps` repetitions. On a CPU (--dry-run):
perf_counter around single calls, labelled as not meaningful. Rates: useful FLOPs and bytes over the median time,
and their fractions of the measured ceilings.

Comparisons: the max abs error against a tolerance scaled by the reference's largest value; top-k sets equal up
to ties (a key in one set only must score, by the reference, within the tolerance of the row's k-th score).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field

import torch

DRY_LABEL = "CPU / Triton interpreter numbers: not meaningful as performance"
SLOW_MS = 250.0


@dataclass
class Timer:
    device: torch.device
    reps: int
    target_ms: float
    ceilings: dict = field(default_factory=dict)  # matmul_tflops, copy_gbps (filled by the ceilings section)

    def time(self, fn, graph: bool = False, warm: bool = False) -> dict:
        """Median time of fn() in ms, and how it was measured. `warm`: fn already ran (compiled, caches filled);
        an eager call slower than SLOW_MS is timed once (the torch path of a prefill chunk)."""
        if self.device.type != "cuda":
            if not warm:
                fn()
            samples = []
            for _ in range(self.reps):
                started = time.perf_counter()
                fn()
                samples.append((time.perf_counter() - started) * 1e3)
            return {"ms": statistics.median(samples), "min_ms": min(samples), "calls_per_rep": 1,
                    "reps": self.reps, "method": "cpu perf_counter", "note": DRY_LABEL}
        if not warm:
            fn()
            torch.cuda.synchronize()
        single = event_ms(fn, 1)
        if single >= SLOW_MS and not graph:
            return {"ms": single, "min_ms": single, "calls_per_rep": 1, "reps": 1,
                    "method": f"one eager call (slower than {SLOW_MS:.0f} ms)"}
        calls = max(1, min(100, int(self.target_ms / max(single, 1e-3))))
        method, replay = "eager calls", fn
        if graph:
            try:
                replay, method = captured(fn), "cuda graph replays"
            except Exception as exc:  # the eager number is still a measurement
                method = f"eager calls (graph capture failed: {type(exc).__name__}: {str(exc)[:200]})"
                torch.cuda.synchronize()
        samples = [event_ms(replay, calls) / calls for _ in range(self.reps)]
        return {"ms": statistics.median(samples), "min_ms": min(samples), "calls_per_rep": calls,
                "reps": self.reps, "method": method}

    def rates(self, ms: float, flops: float, nbytes: float) -> dict:
        """TFLOP/s and GB/s of `ms` for `flops` useful FLOPs and `nbytes` useful bytes, and their share of the
        ceilings (fractions, 1 = the ceiling)."""
        tflops, gbps = flops / ms / 1e9, nbytes / ms / 1e6
        out = {"useful_tflop": flops / 1e12, "useful_gb": nbytes / 1e9, "tflops": tflops, "gbps": gbps}
        if self.ceilings.get("matmul_tflops"):
            out["of_matmul_ceiling"] = tflops / self.ceilings["matmul_tflops"]
        if self.ceilings.get("copy_gbps"):
            out["of_copy_ceiling"] = gbps / self.ceilings["copy_gbps"]
        return out

    def kernel(self, triton_fn, torch_fn, flops: float, nbytes: float, graph: bool = True) -> dict:
        """The Triton call's time (graph replays on CUDA) with its rates, and the torch path's (eager); both
        already ran once (the comparison)."""
        mine = self.time(triton_fn, graph=graph, warm=True)
        theirs = self.time(torch_fn, warm=True)
        out = {"triton": {**mine, **self.rates(mine["ms"], flops, nbytes)}, "torch": theirs,
               "speedup_vs_torch": theirs["ms"] / mine["ms"]}
        if self.device.type != "cuda":
            out["note"] = DRY_LABEL
        return out


def event_ms(fn, calls: int) -> float:
    """CUDA-event time of `calls` back-to-back calls of fn, in ms."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(calls):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def captured(fn):
    """fn captured in a CUDA graph (after a call on a side stream, as torch asks); returns its replay."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    torch.cuda.synchronize()
    return graph.replay


def compare(got: torch.Tensor, ref: torch.Tensor, rel_tol: float, abs_tol: float = 0.0) -> dict:
    """Max abs error of got against ref, passing within rel_tol x max|ref| + abs_tol (and every value finite)."""
    got, ref = got.float(), ref.float()
    finite = bool(torch.isfinite(got).all())
    scale = float(ref.abs().max()) if ref.numel() else 0.0
    err = float("inf") if not finite else float((got - ref).abs().max()) if ref.numel() else 0.0
    tol = rel_tol * scale + abs_tol
    return {"max_abs_err": err, "ref_max_abs": scale, "tol": tol, "finite": finite, "passed": finite and err <= tol}


def topk_agreement(got: torch.Tensor, ref: torch.Tensor, scores: torch.Tensor, tie_tol: float) -> dict:
    """got, ref [N, k] picked key positions (-1 = none); scores [N, K] the reference's (-inf = not causal).
    Rows pick equal sets up to ties when they pick as many keys and each key in one set only scores within
    tie_tol of the row's k-th reference pick."""
    num_rows, num_keys = scores.shape

    def picked(ids: torch.Tensor) -> torch.Tensor:
        mask = torch.zeros(num_rows, num_keys + 1, dtype=torch.bool, device=scores.device)
        mask.scatter_(1, torch.where(ids < 0, num_keys, ids), True)
        return mask[:, :num_keys]

    mine, theirs = picked(got), picked(ref)
    differ = mine ^ theirs
    kth = torch.where(theirs, scores, float("inf")).amin(dim=1)  # [N] the lowest reference pick
    gap = torch.where(differ, (scores - kth[:, None]).abs(), 0.0).amax(dim=1)  # [N]; inf: a non-causal pick
    same_count = mine.sum(1) == theirs.sum(1)
    tied = same_count & (gap <= tie_tol)
    return {"rows": num_rows, "rows_equal": int((~differ.any(1)).sum()), "rows_equal_up_to_ties": int(tied.sum()),
            "max_tie_gap": float(gap.max()) if num_rows else 0.0, "tie_tol": tie_tol,
            "passed": bool(tied.all())}
