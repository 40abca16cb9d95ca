"""`dsa-serve bench decode` and `bench prefill` at C = 1 run in a Python where `import ray` fails (the GPU machines
this project is lent have torch but no Ray): the engine's Ray side is imported only on the paths that need it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
WITHOUT_RAY = """
import sys


class NoRay:  # as if Ray were not installed: `import ray` raises, and `ray` never enters sys.modules
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "ray":
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)


sys.meta_path.insert(0, NoRay())
from cluster.cli import main

sys.exit(main(sys.argv[1:]))
"""


def run_without_ray(*argv: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    done = subprocess.run([sys.executable, "-c", WITHOUT_RAY, *argv], capture_output=True, text=True, timeout=600,
                          env=env, cwd=REPO)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


@pytest.mark.slow  # two bench commands end to end: `make test-slow`
def test_decode_at_c1_runs_where_ray_cannot_be_imported():
    result = run_without_ray("bench", "decode", "--speculative-num-steps", "0,1", "--batch-size", "1", "--max-tokens",
                             "4", "--rounds", "1", "--json")
    assert result["engine"] == "in-process worker"
    assert [(r["speculative_num_steps"], r["batch_size"]) for r in result["runs"]] == [(0, 1), (1, 1)]
    assert all(r["tokens"] > 0 and r["tokens_per_s"] > 0 for r in result["runs"])


@pytest.mark.slow  # two bench commands end to end: `make test-slow`
def test_prefill_at_c1_runs_where_ray_cannot_be_imported():
    result = run_without_ray("bench", "prefill", "--cp-size", "1", "--prompt-len", "64,128", "--json")
    assert [e["prompt_len"] for e in result["lengths"]] == [64, 128]
    for entry in result["lengths"]:
        assert entry["cp_size"] == 1 and entry["c1_wall_s"] == entry["cp_wall_s"] > 0  # one group is both runs
        assert entry["one_batch"]["cp_wall_s"] > 0 and entry["runs"][0]["cp_size"] == 1
    assert result["measured_kv_bytes_per_token"] == result["formula_kv_bytes_per_token"]
