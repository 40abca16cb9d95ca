"""The prepared GPU check (tools/gpu_check.py) in its --dry-run on CPU: tiny shapes, the kernels in Triton's
interpreter. Every kernel comparison is present and passes, every section ran or says why it was skipped, the
model section measured both models on both kernel sets, and the table is printed last. Its pieces that the dry
run cannot reach on CPU are checked here directly: the deadline and error bookkeeping, a lost device, top-k
agreement up to ties, and the exit status of a real run without CUDA."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tools"))

from gpu_check.measure import topk_agreement  # noqa: E402
from gpu_check.runtime import Run, Skip  # noqa: E402

KERNEL_KINDS = {"sparse_mla decode fp8", "sparse_mla decode plain", "sparse_mla prefill fp8",
                "sparse_mla prefill plain", "indexer decode fp8", "indexer decode plain", "indexer prefill fp8",
                "fp8_rows latent", "fp8_rows index_key", "experts dense", "experts fp8-block"}


def kind_of(case: dict) -> str:
    shape = case["shape"]
    if case["kind"] == "sparse_mla":
        return f"sparse_mla {'prefill' if shape['prefill'] else 'decode'} {'fp8' if shape['fp8'] else 'plain'}"
    if case["kind"] == "indexer":
        return f"indexer {'prefill' if shape['rows'] > 1 else 'decode'} {'fp8' if shape['fp8'] else 'plain'}"
    if case["kind"] == "fp8_rows":
        return f"fp8_rows {shape['label']}"
    return f"experts {'fp8-block' if shape['fp8'] else 'dense'}"


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu_check")
    started = time.monotonic()
    done = subprocess.run([sys.executable, "tools/gpu_check.py", "--dry-run", "--out", str(out)], cwd=REPO,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, (done.stdout[-3000:], done.stderr[-3000:])
    return json.loads((out / "gpu_check.json").read_text()), done.stdout, time.monotonic() - started


@pytest.mark.slow  # the GPU check's whole dry run (about a minute): `make test-slow`
def test_every_kernel_is_compared_with_the_torch_path_and_passes(dry_run):
    record, _, _ = dry_run
    cases = record["sections"]["kernels"]["cases"]
    assert {kind_of(case) for case in cases} == KERNEL_KINDS  # the core cases hold one of every kernel
    cases += record["sections"]["kernels_extra"]["cases"]
    for case in cases:
        assert case["status"] == "ran" and case["passed"], case
        assert case["timing"]["triton"]["ms"] > 0 and case["timing"]["torch"]["ms"] > 0, case["name"]
        assert "not meaningful" in case["timing"]["note"]
        if case["kind"] == "fp8_rows":
            assert case["check"]["bit_identical"]
        else:
            assert case["check"]["max_abs_err"] <= case["check"]["tol"]
        if case["kind"] == "indexer":
            assert case["topk"]["passed"] and case["check"]["future_is_neg_inf"]
    assert any(c["shape"].get("heads") == 64 for c in cases if c["kind"] == "sparse_mla")  # a 64-head tile


@pytest.mark.slow  # the GPU check's whole dry run (about a minute): `make test-slow`
def test_every_section_ran_or_says_why_not(dry_run):
    record, _, elapsed = dry_run
    sections = record["sections"]
    assert list(sections) == ["ceilings", "kernels", "model", "sanitizer", "kernels_extra"]
    for name, section in sections.items():
        assert section["status"] in ("ran", "skipped"), (name, section)
        if section["status"] == "skipped":
            assert section["reason"], name
    assert [sections[n]["status"] for n in ("ceilings", "kernels", "model", "kernels_extra")] == ["ran"] * 4
    assert "dry run" in sections["sanitizer"]["reason"]
    assert sections["ceilings"]["results"]["copy_gbps"] > 0 and sections["ceilings"]["results"]["matmul_tflops"] > 0
    assert record["meta"]["mode"] == "dry" and record["meta"]["triton_interpret"] and record["passed"]
    assert {row["target"].split()[0] for row in record["targets"]} >= {"sparse_mla", "indexer+topk", "decode"}
    assert elapsed < 300  # the check itself is sized for about a minute here


@pytest.mark.slow  # the GPU check's whole dry run (about a minute): `make test-slow`
def test_the_model_section_measures_both_models_on_both_kernel_sets(dry_run):
    record, _, _ = dry_run
    models = {m["model"]: m for m in record["sections"]["model"]["models"]}
    assert set(models) == {"default", "v32_random"}
    for model in models.values():
        assert model["status"] == "ran" and model["passed"] and not model["errors"], model
        assert model["graphs"].startswith("skipped: CUDA graphs need a CUDA device")
        for batch in ("b1", "b2"):
            decode = model["decode"][batch]
            assert decode["torch"]["tokens_per_s"] > 0 and decode["triton"]["tokens_per_s"] > 0
            assert decode["triton_graphs"].startswith("skipped")
            assert decode["hidden_vs_torch"]["max_abs_err"] <= 1e-3 * decode["hidden_vs_torch"]["ref_max_abs"]
        assert model["prefill"]["triton"]["tokens_per_s"] > 0 and model["prefill"]["torch"]["tokens_per_s"] > 0
    assert models["v32_random"]["layers"] == 2


@pytest.mark.slow  # the GPU check's whole dry run (about a minute): `make test-slow`
def test_the_table_is_printed_last(dry_run):
    record, stdout, _ = dry_run
    table = "\n".join(record["table"])
    assert table in stdout and stdout.rstrip().splitlines()[-1].startswith("record: ")
    assert "kernel case" in table and "passed: True" in table and "not meaningful" in table
    for case in record["sections"]["kernels"]["cases"] + record["sections"]["kernels_extra"]["cases"]:
        assert case["name"][:58] in table


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA machine runs the real check")
def test_a_real_run_without_cuda_exits_2_with_one_line(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "tools/gpu_check.py", "--out", str(tmp_path)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1 and "--dry-run" in done.stderr


def test_sections_and_cases_record_errors_skips_and_the_deadline(tmp_path):
    run = Run(tmp_path, budget_s=60.0, meta={"mode": "test"})
    cases: list = []

    def section(entry):
        entry["cases"] = cases
        run.case(cases, "fine", 1.0, lambda: {"passed": True})
        run.case(cases, "broken", 1.0, lambda: 1 / 0)
        run.case(cases, "too long", 1000.0, lambda: {"passed": True})

    def cannot(entry):
        raise Skip("no tool here")

    assert run.section("first", section)["status"] == "ran"
    assert [c["status"] for c in cases] == ["ran", "error", "skipped"]
    assert "ZeroDivisionError" in cases[1]["error"] and "deadline" in cases[2]["reason"]
    assert run.section("second", cannot) == {"status": "skipped", "reason": "no tool here",
                                             "elapsed_s": run.record["sections"]["second"]["elapsed_s"]}
    assert run.section("third", lambda e: None, reserve_s=59.9, min_s=1.0)["status"] == "skipped"
    assert run.section("fourth", lambda e: [][1])["status"] == "error"
    written = json.loads((tmp_path / "gpu_check.json").read_text())
    assert list(written["sections"]) == ["first", "second", "third", "fourth"]


def test_a_lost_device_skips_what_would_use_it_but_not_a_subprocess(tmp_path):
    run = Run(tmp_path, budget_s=60.0, meta={"mode": "test"})
    cases: list = []

    def lost():
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    def section(entry):
        run.case(cases, "lost", 1.0, lost)
        run.case(cases, "after", 1.0, lambda: {"passed": True})

    run.section("kernels", section)
    assert [c["status"] for c in cases] == ["error", "skipped"] and "unusable" in cases[1]["reason"]
    assert run.section("model", lambda e: None)["status"] == "skipped"
    assert run.section("sanitizer", lambda e: None, in_process=False)["status"] == "ran"
    assert "illegal memory access" in run.record["meta"]["device_lost"]


def test_topk_sets_agree_up_to_ties_only():
    scores = torch.tensor([[5.0, 4.0, 3.0, 3.0, 1.0], [5.0, 4.0, 3.0, 2.0, 1.0]])
    reference = torch.tensor([[0, 1, 2], [0, 1, 2]])
    tied = torch.tensor([[0, 1, 3], [0, 1, 2]])  # row 0 swaps two keys of equal score
    assert topk_agreement(tied, reference, scores, 1e-6) | {"max_tie_gap": 0.0} == {
        "rows": 2, "rows_equal": 1, "rows_equal_up_to_ties": 2, "max_tie_gap": 0.0, "tie_tol": 1e-6, "passed": True}
    wrong = torch.tensor([[0, 1, 2], [0, 1, 3]])  # row 1 swaps 3.0 for 2.0
    assert not topk_agreement(wrong, reference, scores, 0.5)["passed"]
    short = torch.tensor([[0, 1, -1], [0, 1, 2]])  # a row picks fewer keys
    assert not topk_agreement(short, reference, scores, 10.0)["passed"]
