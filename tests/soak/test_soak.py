"""The soak: a real `dsa-serve serve` on the default model under the harness's mixed load with disconnects
(`python -m benchmarks soak`), and its verdict asserted check by check: no failed request, no growth of RSS, tasks,
threads, per-request state or Ray objects between the idle snapshots, every KV page free.

Two lengths: about 40 s of load in the whole suite (`slow`), and the long soak (`soak` marker) of DSA_SOAK_S
seconds, skipped unless that variable is set: `make soak` sets it (SOAK_S, 600 by default) and DSA_SOAK_OUT, the
folder that gets the result (soak.json) and the server's log (soak_server.log).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.soak_load import FAILURES, KINDS

REPO = Path(__file__).resolve().parents[2]
LEAK_CHECKS = ("processes", "rss", "kv_pages", "engine_state", "rank_state", "tasks", "threads", "objects")


def run_soak(flags: list[str], log_path: Path, timeout_s: float) -> tuple[subprocess.CompletedProcess, dict]:
    """The harness's soak with --json in a child (no RAY_ADDRESS: it serves on a Ray of its own); its result."""
    command = [sys.executable, "-m", "benchmarks", "soak", *flags, "--json", "--server-log", str(log_path)]
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s, env=env, cwd=REPO)
    assert done.stdout.strip(), done.stderr[-4000:]
    return done, json.loads(done.stdout)  # the result alone on stdout


def check_soak(done: subprocess.CompletedProcess, result: dict) -> None:
    """Every leak check passed, the exit status says the verdict, requests all accounted for, the server stopped
    cleanly."""
    outcome, requests = result["verdict"], result["requests"]
    assert done.returncode == (0 if outcome["pass"] else 1)
    for name in LEAK_CHECKS:
        check = outcome["checks"][name]
        failed = {k: v for k, v in check.get("per_process", {}).items() if not v["pass"]}  # rss: only who grew
        assert check["pass"], (name, failed or check, requests["failure_notes"], result.get("rss_series", {}).get(
            "summary_mib"))
    assert [p["name"] for p in result["phases"]] == ["warmup", "steady", "idle"]
    assert requests["total"] == sum(requests["by_outcome"].values()) == sum(requests["per_phase"].values()) > 0
    assert set(requests["by_kind"]) <= set(KINDS) and requests["by_outcome"].get("ok", 0) > 0
    assert requests["failures"] == sum(requests["by_outcome"].get(name, 0) for name in FAILURES)
    assert outcome["checks"]["requests"]["http_5xx"] == requests["http_5xx"]
    pages = outcome["checks"]["kv_pages"]
    assert pages["kv_pages_used"] == {"0": 0.0, "1": 0.0} and pages["running"] == pages["waiting"] == 0
    rss = outcome["checks"]["rss"]["per_process"]
    assert any("cp_rank=0" in name for name in rss) and any("DSAIngress" in name for name in rss)
    assert all(p["baseline_mib"] > 0 and p["final_mib"] > 0 for p in rss.values())
    assert len(result["rss_series"]["t_s"]) >= 3 and result["server"]["returncode"] == 0


@pytest.mark.slow
def test_short_soak_against_a_real_server(tmp_path):
    flags = ["--duration-s", "40", "--warmup-s", "15", "--idle-s", "5", "--sample-s", "5", "--concurrency", "8"]
    check_soak(*run_soak(flags, tmp_path / "server.log", timeout_s=900))


@pytest.mark.soak
@pytest.mark.skipif(not os.environ.get("DSA_SOAK_S"), reason="the long soak runs with DSA_SOAK_S=seconds (make soak)")
def test_soak_for_dsa_soak_s_seconds(tmp_path):
    """`make soak`: the server under DSA_SOAK_S seconds of load (warm-up: 60 s, or a quarter of a shorter soak);
    the result is written before it is checked, so a failed soak keeps its JSON."""
    seconds = float(os.environ["DSA_SOAK_S"])
    out = Path(os.environ.get("DSA_SOAK_OUT") or tmp_path)
    out.mkdir(parents=True, exist_ok=True)
    flags = ["--duration-s", f"{seconds:g}", "--warmup-s", f"{min(60.0, seconds / 4):g}"]
    done, result = run_soak(flags, out / "soak_server.log", timeout_s=seconds + 900)
    (out / "soak.json").write_text(json.dumps(result, default=str) + "\n")
    sys.stderr.write(done.stderr[-2000:])  # the soak's summary (shown with pytest -s)
    check_soak(done, result)
    assert result["verdict"]["pass"], (result["verdict"]["failed"], result["requests"]["failure_notes"])
