"""The kernel cases in the plan's order (each compared with the torch path, then timed), and the issue's targets
read off the finished record: sparse MLA decode (V3.2, FP8, batch 32) and prefill (8k) against the matmul
ceiling, the indexer logits (32k, batch 32) against the copy bandwidth ceiling, and decode with CUDA graphs at
batch 1 on the default model against eager torch."""

from __future__ import annotations

from dataclasses import asdict

from gpu_check.attention_cases import run_mla
from gpu_check.expert_cases import run_experts
from gpu_check.indexer_cases import run_indexer, run_rows

RUNNERS = {"sparse_mla": run_mla, "indexer": run_indexer, "fp8_rows": run_rows, "experts": run_experts}
DECODE_SPEEDUP_TARGET = 3.0  # triton + CUDA graphs over eager torch, batch 1, the default model


def kernel_cases(run, plan, timer, entry: dict, extra: bool = False) -> None:
    """The plan's core cases (or its extra ones) into entry["cases"]."""
    cases: list = []
    entry["cases"] = cases
    for case in plan.extra_cases if extra else plan.kernel_cases:
        shape = {k: v for k, v in asdict(case).items() if k not in ("est_s", "kind", "target")}
        record = run.case(cases, case.name, case.est_s, lambda case=case: RUNNERS[case.kind](case, plan, timer),
                          kind=case.kind, shape=shape)
        if plan.mode == "sanitizer":  # progress in the memcheck output, should the pass be cut off
            print(f"sanitizer target: {case.name}: {record['status']}, passed={record.get('passed')}", flush=True)
    ran = [c for c in cases if c["status"] == "ran"]
    entry["counts"] = {status: sum(c["status"] == status for c in cases) for status in ("ran", "skipped", "error")}
    entry["passed"] = bool(ran) and all(c.get("passed") for c in ran) and entry["counts"]["error"] == 0


def _rate(record: dict, kind: str):
    timing = record.get("timing") or {}
    if kind == "sparse_mla":
        return timing.get("triton", {}).get("of_matmul_ceiling"), "TFLOP/s of the bf16 matmul ceiling"
    return timing.get("logits", {}).get("of_copy_ceiling"), "logits GB/s (keys read) of the copy ceiling"


def targets(record: dict, plan) -> list[dict]:
    """One row per issue target: the value, the threshold, met or not (None: not measured, with why)."""
    sections = record["sections"]
    by_name = {c["name"]: c for name in ("kernels", "kernels_extra") for c in sections.get(name, {}).get("cases", [])}
    rows = []
    for case in plan.kernel_cases + plan.extra_cases:
        if getattr(case, "target", None) is None:
            continue
        found = by_name.get(case.name, {})
        value, metric = _rate(found, case.kind)
        row = {"target": case.name, "metric": metric, "threshold": case.target, "value": value,
               "met": None if value is None else value >= case.target}
        if value is None:
            row["why"] = found.get("reason") or found.get("error") or "not measured"
        rows.append(row)
    rows.append(decode_target(record))
    if plan.mode != "gpu":
        for row in rows:
            row.update(met=None, why="dry run (the targets are for a GPU)")
    return rows


def decode_target(record: dict) -> dict:
    """Triton + CUDA graphs over eager torch, decode at batch 1 on the default model."""
    models = record["sections"].get("model", {}).get("models", [])
    default = next((m for m in models if m.get("name") == "model default"), {})
    b1 = (default.get("decode") or {}).get("b1")
    value = b1.get("speedup_triton_graphs_vs_torch") if isinstance(b1, dict) else None
    row = {"target": "decode b1 default model, triton + CUDA graphs vs eager torch", "metric": "tokens/s ratio",
           "threshold": DECODE_SPEEDUP_TARGET, "value": value,
           "met": None if value is None else value >= DECODE_SPEEDUP_TARGET}
    if value is None:
        row["why"] = (b1.get("triton_graphs") if isinstance(b1, dict) else None) or default.get("reason") or \
            default.get("error") or "not measured"
    return row
