"""The prepared GPU check (issue 45): one run on a lent H100 / H200 that measures what the Triton kernel set does
there, time-boxed to about 7 minutes, with no network and nothing beyond torch and triton (no Ray, pydantic or
transformers: the lent machines' image has torch, triton, safetensors, tqdm and numpy; a package missing there
travels as a wheel). From the repository root:

    python tools/gpu_check.py --out DIR             # on a CUDA machine (exits 2 without one)
    python tools/gpu_check.py --dry-run --out DIR   # on a CPU: tiny shapes, kernels in Triton's interpreter

Sections, most important first, each recording its own exceptions in DIR/gpu_check.json:
  ceilings  copy bandwidth (host <-> device, device), a bf16 8192^3 matmul
  kernels   every Triton kernel against the torch path at V3.2 / GLM-5 shapes, then timed (TFLOP/s, GB/s, share of
            the ceilings); sparse MLA decode / prefill on plain and FP8 rows, indexer logits + top-k, the FP8 row
            writer, the MoE grouped GEMM (dense and FP8 block weights)
  model     decode tokens/s (batch 1 and 32) and an 8k prefill, torch vs triton, triton with and without CUDA
            graphs, on the default model and a random 2-layer model of V3.2's layer shapes
  sanitizer one compute-sanitizer memcheck pass over a small launch of every kernel (--sanitizer-target)
  kernels_extra  longer contexts (8k-128k) and larger batches, as time allows
then the issue's targets and a short table. A global deadline (--budget-s) skips what is left, saying so; a
watchdog ends the run 20 s past it. Exit status: 0 when every check ran and passed, 1 otherwise, 2 without CUDA.
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import sys
from pathlib import Path

TOOLS = Path(__file__).resolve().parent
REPO = TOOLS.parent
# shares of the budget kept for the sections after each: kernels end by 45 %, the model section by 75 %, the
# sanitizer by 95 % (less when the ones before them finish early); the extra kernel cases take what is left
RESERVE = {"kernels": 0.55, "model": 0.25, "sanitizer": 0.05}


def parse_args(argv):
    parser = argparse.ArgumentParser(description="The prepared GPU check of the Triton kernel set (issue 45).")
    parser.add_argument("--out", type=Path, required=True, help="folder for gpu_check.json")
    parser.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes, kernels in Triton's interpreter")
    parser.add_argument("--budget-s", type=float, default=None, help="global deadline (default: the plan's)")
    parser.add_argument("--sanitizer-target", action="store_true", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def prepare_environment(dry_run: bool) -> None:
    """TRITON_INTERPRET before any kernel module is imported (the kernels are decorated then): on for a dry run,
    off otherwise (interpreted kernels on CUDA tensors would time Python)."""
    if dry_run:
        os.environ["TRITON_INTERPRET"] = "1"
    else:
        os.environ.pop("TRITON_INTERPRET", None)
    for path in (str(REPO), str(TOOLS)):
        if path not in sys.path:
            sys.path.insert(0, path)


def device_meta(torch, device, mode: str) -> dict:
    import triton

    meta = {"mode": mode, "torch": torch.__version__, "triton": triton.__version__, "python": platform.python_version(),
            "cuda_runtime": torch.version.cuda, "argv": sys.argv[1:],
            "triton_interpret": os.environ.get("TRITON_INTERPRET") == "1", "nvcc": shutil.which("nvcc")}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        meta.update(device=props.name, capability=f"{props.major}.{props.minor}",
                    memory_gib=round(props.total_memory / 2**30, 1), multiprocessors=props.multi_processor_count)
    else:
        meta.update(device=f"CPU ({os.cpu_count()} cores)")
    return meta


def model_cases(run, plan, device, entry: dict) -> None:
    import torch

    from gpu_check.model_section import measure_model
    from gpu_check.plan import v32_config
    from gpu_check.random_model import random_dsa_model
    from model_workers.checkpoint.loader import load_model
    from model_workers.checkpoint.model_dir import resolve_model_dir

    models: list = []
    entry["models"] = models

    def default_model():
        return load_model(resolve_model_dir(None), dtype=plan.dtype, device=device, progress=False)

    def v32_model():
        raw = plan.v32_config
        if device.type == "cuda" and torch.cuda.mem_get_info(device)[0] < 60 * 2**30:
            raw = v32_config(tiny=False, experts=64)  # 256 experts are 22.5 GB of bf16 weights
        return random_dsa_model(raw, plan.dtype, device)

    factories = {"default": (default_model, 40.0), "v32_random": (v32_model, 80.0)}
    for mp in plan.models:
        factory, est_s = factories[mp.name]
        run.case(models, f"model {mp.name}", est_s if plan.mode == "gpu" else 5.0,
                 lambda mp=mp, factory=factory: measure_model(factory(), mp, device, lambda: run.left(run.section_end)))


def run_check(args, torch, device, mode: str) -> int:
    from gpu_check.ceilings import measure_ceilings
    from gpu_check.kernel_section import kernel_cases, targets
    from gpu_check.measure import Timer
    from gpu_check.plan import plan_for
    from gpu_check.report import render
    from gpu_check.runtime import Run
    from gpu_check.sanitizer import run_sanitizer

    plan = plan_for(mode)
    budget = args.budget_s or plan.budget_s
    args.out.mkdir(parents=True, exist_ok=True)
    run = Run(args.out, budget, device_meta(torch, device, mode))
    run.cleanup = lambda: _free(torch, device)
    run.start_watchdog()
    timer = Timer(device, plan.reps, plan.target_ms)
    if mode == "sanitizer":
        run.section("kernels", lambda e: kernel_cases(run, plan, timer, e))
    else:
        run.section("ceilings", lambda e: measure_ceilings(timer, plan, e), reserve_s=0.8 * budget)
        run.section("kernels", lambda e: kernel_cases(run, plan, timer, e), reserve_s=RESERVE["kernels"] * budget)
        run.section("model", lambda e: model_cases(run, plan, device, e), reserve_s=RESERVE["model"] * budget)
        run.section("sanitizer", lambda e: run_sanitizer(mode, Path(__file__).resolve(), args.out,
                                                         run.left(run.section_end), e),
                    reserve_s=RESERVE["sanitizer"] * budget, in_process=False)
        run.section("kernels_extra", lambda e: kernel_cases(run, plan, timer, e, extra=True))
        run.record["targets"] = targets(run.record, plan)
    run.record["passed"] = all_passed(run.record)
    run.write()
    if mode != "sanitizer":
        table = render(run.record)
        run.record["table"] = table.splitlines()
        path = run.write()
        print(table)
        print(f"record: {path}")
    return 0 if run.record["passed"] else 1


def all_passed(record: dict) -> bool:
    """Every section ran or was skipped for a reason; nothing raised; every check that ran passed."""
    for name, section in record["sections"].items():
        if section.get("status") == "error" or section.get("passed") is False:
            return False
        for case in section.get("cases", []) + section.get("models", []):
            if case.get("status") == "error" or case.get("passed") is False:
                return False
    return True


def _free(torch, device) -> None:
    import gc

    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    prepare_environment(args.dry_run)
    import torch

    if args.dry_run:
        return run_check(args, torch, torch.device("cpu"), "dry")
    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device here (torch.cuda.is_available() is False); on a CPU use --dry-run",
              file=sys.stderr)
        return 2
    return run_check(args, torch, torch.device("cuda", 0), "sanitizer" if args.sanitizer_target else "gpu")


if __name__ == "__main__":
    sys.exit(main())
