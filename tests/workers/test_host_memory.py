"""A rank's host memory stays bounded: oneDNN's per-shape caches are capped when the worker starts (unless the
operator set them), so serving ever-new row counts stops growing the heap once the caches are full."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from cp_router.plans import DecodeItem, StepPlan
from model_workers.plan_checks import plan_is_idle
from model_workers.host_memory import MALLOC_VARIABLES, ONEDNN_CACHE_CAPACITY, ONEDNN_CACHE_VARIABLES

MALLINFO = """
import ctypes, json, sys
import torch

class MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks "
                "keepcost".split()]

libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = MallInfo2
"""  # glibc's heap counters, in a child process of a test

NEW_SHAPES = MALLINFO + """
import torch.nn.functional as F
from model_workers.cp_worker import CPWorker
CPWorker(0, 1, num_threads=1)  # what a rank actor runs first
weight = torch.randn(768, 256, dtype=torch.bfloat16)
in_use = {}
for rows in range(1, int(sys.argv[1]) + 1):  # one new row count per product, as prefill chunks bring
    F.linear(torch.randn(rows, 256, dtype=torch.bfloat16), weight)
    if rows in (int(sys.argv[2]), int(sys.argv[1])):
        in_use[rows] = libc.mallinfo2().uordblks / 2**20
print(json.dumps(in_use))
"""


def run_shapes(total: int, measured_from: int, env: dict) -> dict[int, float]:
    done = subprocess.run([sys.executable, "-c", NEW_SHAPES, str(total), str(measured_from)], capture_output=True,
                          text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    return {int(k): v for k, v in json.loads(done.stdout.strip().splitlines()[-1]).items()}


@pytest.mark.slow  # a memory behaviour over many forwards: `make test-slow`
def test_new_row_counts_stop_growing_the_heap_once_the_caches_are_full():
    env = {k: v for k, v in os.environ.items() if k not in ONEDNN_CACHE_VARIABLES}
    start = 300  # past ONEDNN_CACHE_CAPACITY: full caches from here on
    assert ONEDNN_CACHE_CAPACITY < start
    in_use = run_shapes(start + 400, start, env)
    growth = in_use[start + 400] - in_use[start]
    # unbounded (the 1024-entry defaults) this grows ~0.78 MiB per new shape: ~310 MiB over 400 shapes
    assert growth < 40, f"heap in use grew {growth:.1f} MiB over 400 new shapes after the caches filled"


def test_an_operator_setting_wins_over_the_bound():
    env = {**os.environ, "ONEDNN_PRIMITIVE_CACHE_CAPACITY": "8", "LRU_CACHE_CAPACITY": "1024"}
    code = ("from model_workers.cp_worker import CPWorker; import os; CPWorker(0, 1, num_threads=1); "
            "print(os.environ['ONEDNN_PRIMITIVE_CACHE_CAPACITY'], os.environ['LRU_CACHE_CAPACITY'])")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert done.stdout.split() == ["8", "1024"], done.stderr[-2000:]


def test_only_a_step_without_forwards_is_idle():
    item = DecodeItem(request_id="a", token_id=1, num_cached=4, num_generated=1, max_new=8, pages=(0,))
    assert plan_is_idle(StepPlan(free=("a",)))
    assert not plan_is_idle(StepPlan(decode=(item,)))
    assert not plan_is_idle(StepPlan(group_decode=True))
    assert not plan_is_idle(StepPlan(group_prefill_rows=(3, 0)))



LARGE_ALLOCATION = MALLINFO + """
from model_workers.host_memory import keep_large_allocations_on_heap
applied = keep_large_allocations_on_heap() if sys.argv[1] == "set" else None
before = libc.mallinfo2().hblkhd
block = torch.ones(2 * 2**20)  # 8 MiB
print(json.dumps({"applied": applied, "mapped_mib": (libc.mallinfo2().hblkhd - before) / 2**20}))
"""


def large_allocation(mode: str, env: dict) -> dict:
    done = subprocess.run([sys.executable, "-c", LARGE_ALLOCATION, mode], capture_output=True, text=True,
                          timeout=120, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_rank_serves_tensors_of_a_few_mib_from_the_heap():
    """glibc's default maps an 8 MiB tensor afresh from the OS (and page-faults it again after every free); with
    the rank's settings it comes from the heap and is reused."""
    env = {k: v for k, v in os.environ.items() if k not in MALLOC_VARIABLES and k != "GLIBC_TUNABLES"}
    assert large_allocation("default", env)["mapped_mib"] >= 8
    assert large_allocation("set", env) == {"applied": True, "mapped_mib": 0}


@pytest.mark.slow  # a memory behaviour over many forwards: `make test-slow`
def test_an_operator_malloc_setting_wins():
    clean = {k: v for k, v in os.environ.items() if k not in MALLOC_VARIABLES and k != "GLIBC_TUNABLES"}
    for setting in ({"MALLOC_MMAP_THRESHOLD_": "131072"}, {"GLIBC_TUNABLES": "glibc.malloc.mmap_threshold=131072"}):
        kept = large_allocation("set", {**clean, **setting})
        assert kept["applied"] is False and kept["mapped_mib"] >= 8
    other_tunable = large_allocation("set", {**clean, "GLIBC_TUNABLES": "glibc.cpu.x86_rep_movsb_threshold=4096"})
    assert other_tunable == {"applied": True, "mapped_mib": 0}
