"""Compile every shipped Triton kernel config for Hopper (sm_90a) without a GPU and report what the hardware would
get: shared memory (Triton's metadata), registers and spill bytes (ptxas -v on the kernel's PTX, with the ptxas
Triton bundles and launches with: 12.8 for triton 3.6.0), and whether its products became wgmma instructions. Prints one JSON object per config, then exits 1 if one exceeds the limits.

    python tools/sm90_report.py [--json]

Runs with TRITON_INTERPRET unset (the interpreter replaces compilation); configs come from each kernel module's
COMPILE_CONFIGS (model_workers/kernels/triton/)."""

from __future__ import annotations

import importlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

KERNEL_MODULES = ("sparse_mla", "indexer", "fp8_rows", "experts")
HOPPER_SHARED_BYTES = 232_448  # the most dynamic shared memory one block may use on sm_90


def ptxas() -> str:
    import triton

    bundled = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    return str(bundled) if bundled.exists() else shutil.which("ptxas")


def report(config: dict) -> dict:
    import triton
    from triton.backends.compiler import GPUTarget

    source = triton.compiler.ASTSource(fn=config["kernel"], signature=config["signature"],
                                       constexprs=config["constexprs"], attrs=divisibility(config))
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": config["num_warps"], "num_stages": config["num_stages"]})
    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as ptx:
        ptx.write(compiled.asm["ptx"])
        ptx.flush()
        verbose = subprocess.run([ptxas(), "-arch=sm_90a", "-v", ptx.name, "-o", os.devnull], capture_output=True,
                                 text=True, check=True).stderr
    registers = re.search(r"Used (\d+) registers", verbose)
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", verbose)
    return {"name": config["name"], "shared_bytes": compiled.metadata.shared,
            "registers": int(registers.group(1)) if registers else None,
            "spill_store_bytes": int(spills.group(1)) if spills else 0,
            "spill_load_bytes": int(spills.group(2)) if spills else 0,
            "num_warps": config["num_warps"], "wgmma": "wgmma" in compiled.asm["ptx"],
            "wgmma_expected": config["wgmma"]}


def divisibility(config: dict) -> dict:
    """What a real launch tells the compiler: pointer arguments are 16-byte aligned (torch allocations and the rows
    the launchers pass are), and so are the integer arguments a config names in `divisible_by_16` (the values a
    launch at the config's shapes passes: Triton specializes such arguments at run time)."""
    names = config["kernel"].arg_names
    aligned = [name for name, kind in config["signature"].items() if kind.startswith("*")]
    aligned += list(config.get("divisible_by_16", ()))
    return {(names.index(name),): [["tt.divisibility", 16]] for name in aligned}


def problems(row: dict) -> list[str]:
    found = []
    if row["shared_bytes"] > HOPPER_SHARED_BYTES:
        found.append(f"shared memory {row['shared_bytes']} B > {HOPPER_SHARED_BYTES}")
    if row["spill_store_bytes"] or row["spill_load_bytes"]:
        found.append(f"spills {row['spill_store_bytes']} / {row['spill_load_bytes']} B")
    if row["wgmma_expected"] and not row["wgmma"]:
        found.append("no wgmma where a 64-row product was expected")
    return found


def main() -> int:
    if os.environ.get("TRITON_INTERPRET") == "1":
        print("tools/sm90_report.py: unset TRITON_INTERPRET (the interpreter does not compile)", file=sys.stderr)
        return 2
    failed = 0
    for name in KERNEL_MODULES:
        module = importlib.import_module(f"model_workers.kernels.triton.{name}")
        for config in module.COMPILE_CONFIGS:
            row = report(config)
            row["problems"] = problems(row)
            failed += bool(row["problems"])
            print(json.dumps(row), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
