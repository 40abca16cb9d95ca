"""`dsa-serve bench pd` end to end at small sizes (three Ray rank groups on a local Ray: `make test-slow`): one JSON
object with the three measurements, the hand-off's bytes equal to the page formula, and a verdict per target."""

from __future__ import annotations

import json

import pytest

from cluster import cli

pytestmark = pytest.mark.slow


def test_bench_pd_prints_its_measurements_and_targets(capsys):
    argv = ["bench", "pd", "--long-len", "512", "--long-prompts", "1", "--transfer-len", "300", "--alone-len", "64",
            "--alone-tokens", "8", "--repeats", "1", "--streams", "2", "--stream-tokens", "8", "--json"]
    assert cli.main(argv) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["bench"] == "pd" and result["command"].startswith("dsa-serve bench pd")
    transfer = result["transfer"]
    assert transfer["bytes"] == transfer["formula_bytes"] > 0 and transfer["transfer_s"] > 0
    assert set(result["targets"]) == set(result["ratios"])
    assert all(result["isolation"][side]["chunk_gaps"] > 0 for side in ("colocated", "pd"))
