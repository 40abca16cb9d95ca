"""One compute-sanitizer memcheck pass over a small launch of every kernel: this script again, in its
`--sanitizer-target` mode (the plan's tiny cases on the GPU, compared with the torch path, no timing), under
`compute-sanitizer --tool memcheck`, with torch's caching allocator off (an access past a tensor then lands outside
any allocation, where memcheck sees it). Killed at the section's deadline."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

from gpu_check.runtime import JSON_NAME, Skip

SEARCH = ("$CUDA_HOME/bin", "/usr/local/cuda/bin", "/usr/local/cuda/compute-sanitizer", "/opt/cuda/bin")


def find_tool() -> str | None:
    found = shutil.which("compute-sanitizer")
    if found:
        return found
    for folder in SEARCH:
        candidate = Path(os.path.expandvars(folder)) / "compute-sanitizer"
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    return None


def run_sanitizer(plan_mode: str, script: Path, out_dir: Path, timeout_s: float, entry: dict) -> None:
    if plan_mode != "gpu":
        raise Skip("dry run: compute-sanitizer checks launches on a CUDA device")
    tool = find_tool()
    if tool is None:
        raise Skip(f"compute-sanitizer not found (PATH, {', '.join(SEARCH)})")
    if timeout_s < 30:
        raise Skip(f"deadline: {timeout_s:.0f} s left, a memcheck pass needs ~30 s or more")
    target_dir = out_dir / "sanitizer_target"
    command = [tool, "--tool", "memcheck", "--print-limit", "20", sys.executable, str(script), "--sanitizer-target",
               "--out", str(target_dir)]
    entry.update(tool=tool, command=" ".join(command), timeout_s=round(timeout_s))
    env = {**os.environ, "PYTORCH_NO_CUDA_MEMORY_CACHING": "1"}
    env.pop("TRITON_INTERPRET", None)
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=timeout_s)
        entry["timed_out"] = False
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the sanitizer and the python it runs: our own process group
        output, _ = proc.communicate()
        entry["timed_out"] = True
    summary = re.search(r"ERROR SUMMARY: (\d+) error", output or "")
    output = output or ""
    entry.update(returncode=proc.returncode, errors=int(summary.group(1)) if summary else None,
                 errors_printed=len(re.findall(r"^=+ (?:Invalid|Program hit|Out-of-range|Misaligned)", output, re.M)),
                 progress=re.findall(r"^sanitizer target: .*$", output, re.M), output_tail=output[-3000:])
    target = target_dir / JSON_NAME
    cases = []
    if target.is_file():
        kernels = json.loads(target.read_text())["sections"].get("kernels", {})
        cases = [{"name": c["name"], "status": c["status"], "passed": c.get("passed")}
                 for c in kernels.get("cases", [])]
    entry["launches"] = cases
    entry["passed"] = (entry["errors"] == 0 and proc.returncode == 0 and not entry["timed_out"] and bool(cases)
                       and all(c["passed"] for c in cases))
