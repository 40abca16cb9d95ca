"""`dsa-serve bench structured` end to end on the default model, small: the mask-overhead runs and the schema suite
report what they measured, and every output of the schemas checked validates."""

import json
import subprocess
import sys

from cluster.bench.schema_suite import SCHEMAS


def test_bench_structured_prints_both_measurements():
    command = [sys.executable, "-m", "cluster.cli", "bench", "structured", "--streams", "2", "--max-tokens", "4",
               "--repeats", "1", "--schemas", "3", "--schema-max-tokens", "300", "--json"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout)
    assert result["bench"] == "structured" and "--schemas 3" in result["command"]
    mask = result["mask_overhead"]
    assert [len(mask["runs"][kind]) for kind in ("constrained", "free")] == [1, 1]
    assert all(run["tokens"] == 2 * 4 for kind in ("constrained", "free") for run in mask["runs"][kind])
    assert mask["ratio"] == round(mask["median_tokens_per_s"]["constrained"] / mask["median_tokens_per_s"]["free"], 3)
    validity = result["validity"]
    assert (validity["schemas"], validity["requests"], validity["failures"]) == (3, 6, [])
    assert validity["valid"] == 6 and len(SCHEMAS) >= 50
