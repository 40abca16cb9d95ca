"""Every shipped Triton kernel config compiles for Hopper (sm_90a) without a GPU, within its shared memory, with no
register spills, and with wgmma where a 64-row product is expected (tools/sm90_report.py, run as CI runs it: in a
process without TRITON_INTERPRET, since the interpreter replaces compilation)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
KERNELS = ("sparse_mla", "indexer", "fp8_rows", "experts")


@pytest.fixture(scope="module")
def rows() -> list[dict]:
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "tools/sm90_report.py"], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=900)
    lines = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert done.returncode in (0, 1), done.stderr[-2000:]
    return lines


def test_every_kernel_module_ships_configs(rows):
    assert {row["name"].split()[0] for row in rows} >= {"sparse_mla", "indexer"}
    assert len(rows) >= 30


def test_no_config_spills_or_outgrows_shared_memory(rows):
    assert [(row["name"], row["problems"]) for row in rows if row["problems"]] == []
    assert all(row["shared_bytes"] <= 232_448 and row["spill_store_bytes"] == 0 for row in rows)


def test_64_head_tiles_run_on_wgmma(rows):
    v32 = [row for row in rows if row["name"].endswith(" v32") and row["wgmma_expected"]]
    assert len(v32) >= 10 and all(row["wgmma"] for row in v32)


def test_the_interpreter_is_refused():
    done = subprocess.run([sys.executable, "tools/sm90_report.py"], cwd=REPO,
                          env={**os.environ, "TRITON_INTERPRET": "1"}, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "unset TRITON_INTERPRET" in done.stderr
