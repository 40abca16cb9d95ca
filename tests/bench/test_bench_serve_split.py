"""Which side runs what: `dsa-serve bench serve` measures and says the `transformers` baseline is the harness's;
`python -m benchmarks serve` runs the same measurement with the baseline added (same flags, same fields); the
package refuses `--workload long`, naming the harness's command. The HTTP measurement is a stand-in here (the
real one runs in test_bench_serve.py's end-to-end test)."""

from __future__ import annotations

import json

import pytest

from benchmarks.cli import main as harness_main
from cluster.bench import serve as package_serve
from cluster.bench.load import RequestTiming, summarize
from cluster.cli import main as cli_main

FLAGS = ["--concurrency", "1,2", "--num-prompts", "3", "--max-tokens", "2", "--skip-in-process", "--json"]


@pytest.fixture
def measured(monkeypatch):
    """measure_served as a stand-in: every request 2 tokens in 1 s; records the plan it was given."""
    plans = []

    def fake(args, model_dir, cp, settings, groups, after=None):
        ((key, (_, plan)),) = groups.items()
        plans.append(plan)
        http = {key: {c: summarize([RequestTiming(0.0, [0.5, 0.7], 2)] * n, wall_s=1.0) for c, n in plan.items()}}
        return http, None, None

    monkeypatch.setattr(package_serve, "measure_served", fake)
    return plans


def result_of(capsys) -> dict:
    return json.loads(capsys.readouterr().out)


def test_the_package_measures_and_names_the_harness_for_the_baseline(measured, capsys):
    assert cli_main(["bench", "serve", *FLAGS]) == 0
    result = result_of(capsys)
    assert result["command"].startswith("dsa-serve bench serve ") and "--concurrency 1,2" in result["command"]
    assert result["transformers"] == {"skipped": True, "reason": package_serve.HARNESS_BASELINE}
    assert [(r["concurrency"], r["output_tokens"], r["throughput_vs_transformers"]) for r in result["runs"]] == [
        (1, 6, None), (2, 6, None)]
    assert measured == [{1: 3, 2: 3}]


def test_the_harness_adds_the_baseline_with_the_same_flags_and_fields(measured, capsys, monkeypatch):
    calls = []

    def baseline(model_dir, level_prompts, max_tokens, dtype, device, threads):
        calls.append(({c: len(p) for c, p in level_prompts.items()}, max_tokens, dtype, threads))
        return {"skipped": False, "threads": threads, "levels": {c: {"output_tokens_per_s": 2.0} for c in level_prompts}}

    monkeypatch.setattr("benchmarks.serve.run_baseline", baseline)
    assert cli_main(["bench", "serve", *FLAGS]) == 0
    package_result = result_of(capsys)
    assert harness_main(["serve", *FLAGS]) == 0
    result = result_of(capsys)
    assert result["command"] == package_result["command"].replace("dsa-serve bench", "python -m benchmarks", 1)
    assert set(result) == set(package_result)  # the same fields, whichever side measured
    assert calls == [({1: 3, 2: 3}, 2, "bfloat16", result["server"]["cp_size"])]
    assert result["transformers"] == {"skipped": False, "threads": result["server"]["cp_size"]}
    assert [r["throughput_vs_transformers"] for r in result["runs"]] == [pytest.approx(3.0), pytest.approx(3.0)]


def test_skip_transformers_skips_the_harness_baseline(measured, capsys, monkeypatch):
    monkeypatch.setattr("benchmarks.serve.run_baseline", lambda *a: pytest.fail("the baseline ran"))
    assert harness_main(["serve", *FLAGS, "--skip-transformers"]) == 0
    assert result_of(capsys)["transformers"] == {"skipped": True, "reason": "--skip-transformers"}


def test_the_package_refuses_the_long_workload_naming_the_harness(capsys):
    assert cli_main(["bench", "serve", "--workload", "long"]) == 2
    assert "python -m benchmarks serve --workload long" in capsys.readouterr().err
