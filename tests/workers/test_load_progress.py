"""Weight-loading progress: every rank logs its load's start, its progress every interval and its end (bytes
read, seconds), and under Ray (as `dsa-serve serve` starts it, log_to_driver) the lines of every rank actor reach
the driver's console."""

from __future__ import annotations

import logging
import subprocess
import sys
import threading

import pytest

from model_workers.checkpoint.model_dir import read_model_spec
from model_workers.cp_worker import CPWorker
from model_workers.load_progress import GIB, LoadProgress
from model_workers.spec import RankSpec

RANKS_UNDER_RAY = """
import sys
from cluster.config import ResolvedCPConfig  # before Ray, as in `dsa-serve serve` (cluster/__init__.py)
from cluster.launch import engine_cpus, launch_group, start_ray
import ray
from model_workers.checkpoint.model_dir import resolve_model_dir
start_ray(engine_cpus(2), log_to_driver=True)
group = launch_group(resolve_model_dir(None), ResolvedCPConfig(enabled=True, cp_size=2, strategy="zigzag",
                     impl="legacy"), "float32", 16, 8)
print("launched", flush=True)
sys.stdin.readline()  # the test has seen every rank's lines (Ray forwards them asynchronously)
group.shutdown()
ray.shutdown()
"""


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_progress_lines_name_the_rank_the_bytes_and_the_seconds(tmp_path, caplog):
    (tmp_path / "model-1.safetensors").write_bytes(b"\0" * 3000)
    (tmp_path / "model-2.safetensors").write_bytes(b"\0" * 1000)
    clock = Clock()
    with caplog.at_level(logging.INFO, logger="dsa_serve.worker"):
        progress = LoadProgress(3, tmp_path, interval_s=10.0, clock=clock)
        for _ in range(4):  # 1000 bytes every 4 s: a line at 12 s (3000 read); none at 4, 8 or 16 s
            clock.now += 4.0
            progress.read(1000)
        progress.done(4000)
    lines = [r.getMessage() for r in caplog.records if r.name == "dsa_serve.worker"]
    assert lines == [f"cp_rank 3: loading weights from {tmp_path} (0.00 GiB of checkpoint files)",
                     "cp_rank 3: 0.00 / 0.00 GiB of weights read (75%), 12.0 s",
                     f"cp_rank 3: weights loaded: 0.00 GiB read of a 0.00 GiB checkpoint in 16.0 s "
                     f"({4000 / GIB / 16:.2f} GiB/s)"]


def test_a_worker_load_logs_what_it_read(caplog):
    worker = CPWorker(0, 1, num_threads=None)
    with caplog.at_level(logging.INFO, logger="dsa_serve.worker"):
        worker.load(RankSpec(read_model_spec(None), "float32", num_pages=8, page_size=8))
    lines = [r.getMessage() for r in caplog.records if r.name == "dsa_serve.worker"]
    first, last = lines[0], lines[-1]
    assert first.startswith("cp_rank 0: loading weights from ")
    assert last.startswith(f"cp_rank 0: weights loaded: {worker.load_report.total_bytes / GIB:.2f} GiB read of a ")


@pytest.mark.slow  # a Ray group for log forwarding: `make test-slow`
def test_every_rank_actors_lines_reach_the_driver_under_ray():
    expected = {f"cp_rank {r}: {what}" for r in (0, 1) for what in ("loading weights from ", "weights loaded: ")}
    process = subprocess.Popen([sys.executable, "-c", RANKS_UNDER_RAY], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True)
    watchdog, output = threading.Timer(300, process.kill), []  # a line that never comes ends the read
    watchdog.start()
    try:
        while expected and (line := process.stdout.readline()):
            output.append(line)
            expected -= {text for text in expected if text in line}
        assert not expected, "".join(output[-40:])
        process.stdin.write("\n")
        process.stdin.flush()
        assert process.wait(timeout=120) == 0, "".join(output[-40:])
    finally:
        watchdog.cancel()
        process.kill()
