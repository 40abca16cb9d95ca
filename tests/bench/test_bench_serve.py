"""`dsa-serve bench serve` and the harness's `python -m benchmarks serve`: percentiles, the closed loop, SSE and
engine timing accounting, the transformers baseline, flag errors, and one end-to-end run against a server it starts
(Ray Serve, the default model)."""

from __future__ import annotations

import asyncio
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import aiohttp
import pytest
import uvicorn

from cluster.bench.load import (
    RequestTiming,
    apply_sse_line,
    closed_loop,
    completion_body,
    engine_request,
    http_request,
    percentiles,
    summarize,
)
from benchmarks.transformers_baseline import run_baseline
from cluster.bench.serve_result import assemble_run, plot, summary_text
from cluster.cli import main as cli_main
from cluster.engine_spec import EngineOptions
from cluster.http_api.ingress import build_app
from cluster.serve_settings import IngressSettings
from cp_router.protocol import EngineRequest
from model_workers.comm import free_port
from model_workers.checkpoint.model_dir import resolve_model_dir
from support.engines import local_engine
from support.http_fakes import FakeEngine, write_checkpoint_files

REPO = Path(__file__).resolve().parents[2]


def test_percentiles_interpolate_between_ranks_and_handle_no_values():
    assert percentiles([4.0, 1.0, 3.0, 2.0]) == pytest.approx({"p50": 2.5, "p90": 3.7, "p99": 3.97, "mean": 2.5})
    assert percentiles([7.0]) == {"p50": 7.0, "p90": 7.0, "p99": 7.0, "mean": 7.0}
    assert percentiles([]) == {"p50": None, "p90": None, "p99": None, "mean": None}


def test_timing_of_one_request_from_its_chunk_times():
    timing = RequestTiming(sent=10.0, chunk_times=[10.5, 10.7, 11.0], tokens=7)
    assert timing.ttft_s == pytest.approx(0.5)
    assert timing.itl_s == pytest.approx([0.2, 0.3])
    assert timing.tpot_s == pytest.approx(0.5 / 6)
    summary = summarize([timing, RequestTiming(0.0, [1.0], 1)], wall_s=2.0)
    assert summary["output_tokens"] == 8 and summary["tokens_per_request"] == [1, 7]
    assert summary["tokens_per_chunk"] == pytest.approx(2.0)
    assert summary["tpot_s"]["p50"] == pytest.approx(0.5 / 6)  # a one-token request has no TPOT
    assert (summary["output_tokens_per_s"], summary["requests_per_s"]) == (4.0, 1.0)


def test_closed_loop_sends_every_request_once_with_at_most_c_in_flight():
    in_flight, peak, sent = 0, 0, []

    async def send(index: int) -> RequestTiming:
        nonlocal in_flight, peak
        in_flight += 1
        peak = max(peak, in_flight)
        await asyncio.sleep(0.001 * (index % 3))
        in_flight -= 1
        sent.append(index)
        return RequestTiming(0.0, [0.1], 1)

    timings, wall_s = asyncio.run(closed_loop(send, 10, 3))
    assert sorted(sent) == list(range(10)) and len(timings) == 10
    assert peak == 3 and wall_s > 0


def test_paths_take_turns_in_rounds_and_each_summary_covers_all_its_requests():
    from cluster.bench.serve_server import ROUNDS, measure_paths, round_sizes

    assert ROUNDS == 2 and round_sizes(5, 2) == [3, 2] and round_sizes(1, 2) == [1] and round_sizes(4, 1) == [4]
    calls = []

    def sender(name: str):
        async def send(prompts: list, i: int) -> RequestTiming:
            calls.append((name, prompts[i % len(prompts)]))
            await asyncio.sleep(0)
            return RequestTiming(sent=0.0, chunk_times=[0.01, 0.02], tokens=2)
        return send

    groups = {None: (["p0", "p1"], {1: 3, 2: 4})}
    out = asyncio.run(measure_paths({"a": sender("a"), "b": sender("b")}, groups, warmup=1))
    order = [name for name, _ in calls]
    assert order[:2] == ["a", "b"]  # one warmup request each
    assert order[2:] == ["a", "a", "b", "b", "b", "a"] + ["a", "a", "b", "b", "b", "b", "a", "a"]
    for name in ("a", "b"):
        assert out[name][None][1]["num_requests"] == 3 and out[name][None][2]["num_requests"] == 4
        assert out[name][None][2]["output_tokens"] == 8
    in_flight, peak = 0, 0

    async def tracked(prompts: list, i: int) -> RequestTiming:
        nonlocal in_flight, peak
        in_flight += 1
        peak = max(peak, in_flight)
        await asyncio.sleep(0.01)
        in_flight -= 1
        return RequestTiming(sent=0.0, chunk_times=[0.01], tokens=1)

    lone = asyncio.run(measure_paths({"a": tracked}, {None: (["p0"], {4: 4})}, warmup=0))
    assert peak == 4 and lone["a"][None][4]["num_requests"] == 4  # one round of all 4 (the long workload's 8k x 4)


def test_sse_lines_other_than_data_are_ignored_and_errors_raise():
    timing = RequestTiming(0.0)
    assert apply_sse_line(timing, "", 1.0) and apply_sse_line(timing, ": keep-alive", 1.0)
    assert apply_sse_line(timing, 'data: {"choices": [{"text": "x"}], "usage": null}', 1.5)
    assert apply_sse_line(timing, 'data: {"choices": [], "usage": {"completion_tokens": 3}}', 2.0)
    assert not apply_sse_line(timing, "data: [DONE]", 2.0)
    assert (timing.chunk_times, timing.tokens) == ([1.5], 3)
    with pytest.raises(RuntimeError, match="mid-stream"):
        apply_sse_line(timing, 'data: {"error": {"message": "boom"}}', 3.0)


def test_http_request_counts_chunks_and_usage_tokens_through_the_ingress(tmp_path):
    engine = FakeEngine()  # one token per chunk
    app = build_app(engine, IngressSettings(model_dir=str(write_checkpoint_files(tmp_path))))

    async def main():
        port = free_port()
        server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
        serving = asyncio.create_task(server.serve())
        while not server.started:
            await asyncio.sleep(0.01)
        try:
            async with aiohttp.ClientSession() as session:
                return await http_request(session, f"http://127.0.0.1:{port}", completion_body("hello world", 5))
        finally:
            server.should_exit = True
            await serving

    timing = asyncio.run(main())
    (request,) = engine.requests
    assert (request.max_tokens, request.min_tokens, request.temperature) == (5, 5, 0.0)
    assert timing.tokens == 5 and len(timing.chunk_times) == 5 and len(timing.itl_s) == 4
    assert timing.ttft_s >= 0 and all(gap >= 0 for gap in timing.itl_s)


def test_engine_requests_are_timed_per_chunk_and_produce_exactly_max_tokens():
    engine = local_engine(resolve_model_dir(None), EngineOptions(num_pages=32, page_size=16))
    prompts = [(1, 2, 3), (4, 5, 6, 7)]

    def send(i: int):
        return engine_request(engine, EngineRequest(f"b{i}", prompts[i % 2], 6, temperature=0.0, min_tokens=6))

    timings, wall_s = asyncio.run(closed_loop(send, 3, 2))
    summary = summarize(timings, wall_s)
    assert summary["tokens_per_request"] == [6] and summary["output_tokens"] == 18
    chunks = sum(len(t.chunk_times) for t in timings)
    assert 3 < chunks <= 18 and summary["tokens_per_chunk"] == pytest.approx(18 / chunks)
    assert summary["itl_s"]["p50"] > 0 and summary["ttft_s"]["p99"] >= summary["ttft_s"]["p50"] > 0


def test_transformers_baseline_generates_exactly_max_tokens_per_prompt(reference_checkpoint):
    folder = reference_checkpoint("v32")[1]
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13], [3]]
    result = run_baseline(folder, {1: prompts[:2], 3: prompts}, 3, "float32", "cpu", threads=1)
    assert not result["skipped"], result
    assert result["levels"][1]["output_tokens"] == 6 and result["levels"][3]["output_tokens"] == 12
    assert result["levels"][3]["output_tokens_per_s"] > 0


def test_transformers_baseline_that_cannot_load_is_skipped_with_a_reason(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "no_such_model"}))
    result = run_baseline(tmp_path, {1: [[1, 2]]}, 2, "float32", "cpu", threads=1)
    assert result["skipped"] and "no_such_model" in result["reason"]


def test_skipped_comparisons_give_no_ratios_and_still_print_and_plot(tmp_path):
    http = summarize([RequestTiming(0.0, [0.5, 0.7], 2)], wall_s=1.0)
    both = assemble_run(4, http, summarize([RequestTiming(0.0, [0.4, 0.6], 2)], 1.0), {"output_tokens_per_s": 0.5})
    assert both["ttft_p50_ratio"] == pytest.approx(1.25) and both["itl_p50_ratio"] == pytest.approx(1.0)
    assert both["throughput_vs_transformers"] == pytest.approx(4.0)
    alone = assemble_run(8, http, None, None)
    assert alone["ttft_p50_ratio"] is alone["itl_p50_ratio"] is alone["throughput_vs_transformers"] is None
    result = {"model": "m", "dtype": "bfloat16", "device": "cpu", "max_tokens": 2, "runs": [both, alone],
              "server": {"cp_size": 2, "speculative_num_steps": 0}, "transformers": {"skipped": True, "reason": "r"}}
    text = summary_text(result)
    assert "C=8" in text and "x- in-process" in text and "skipped: r" in text
    plot(result, str(tmp_path / "serve.png"))
    assert (tmp_path / "serve.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize("flag, value", [
    ("--concurrency", "0,8"), ("--concurrency", "one"), ("--max-tokens", "0"), ("--num-prompts", "0"),
    ("--url", "localhost:8000"), ("--speculative-num-steps", "5"), ("--cp-size", "0"), ("--warmup", "-1"),
    ("--prompt-len", "-2"), ("--plot", "/no/such/folder/serve.png"),
])
def test_invalid_flags_exit_2_naming_the_flag(capsys, flag, value):
    assert cli_main(["bench", "serve", flag, value]) == 2
    assert flag in capsys.readouterr().err


def finite_positive(value) -> bool:
    return isinstance(value, float) and math.isfinite(value) and value > 0


@pytest.mark.slow
def test_bench_serve_end_to_end_against_a_server_it_starts(tmp_path):
    plot_path = tmp_path / "serve.png"
    command = [sys.executable, "-m", "benchmarks", "serve", "--concurrency", "1,2", "--num-prompts", "2",
               "--max-tokens", "4", "--warmup", "1", "--json", "--plot", str(plot_path)]
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env, cwd=REPO)
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads(done.stdout)  # the result alone on stdout, though Ray prints its own lines while it runs
    assert (result["bench"], result["max_tokens"], result["server"]["started_here"]) == ("serve", 4, True)
    assert result["command"].startswith("python -m benchmarks serve ") and "--concurrency 1,2" in result["command"]
    assert result["machine"]["cpu_count"] >= 1 and not result["transformers"]["skipped"]
    assert [run["concurrency"] for run in result["runs"]] == [1, 2]
    for run in result["runs"]:
        for measured in (run, run["in_process"], run["transformers"]):
            assert measured["num_requests"] == 2 and measured["output_tokens"] == 8
        for measured in (run, run["in_process"]):
            assert measured["tokens_per_request"] == [4]
            assert set(measured["ttft_s"]) == set(measured["itl_s"]) == {"p50", "p90", "p99", "mean"}
        for key in ("ttft_p50_ratio", "itl_p50_ratio", "throughput_vs_transformers"):
            assert finite_positive(run[key]), (key, run[key])
    assert plot_path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_transformers_baseline_also_tries_float32_for_bf16_on_cpu():
    from benchmarks.transformers_baseline import baseline_dtypes

    assert baseline_dtypes("bfloat16", "cpu") == ["bfloat16", "float32"]
    assert baseline_dtypes("bfloat16", "cuda") == ["bfloat16"]
    assert baseline_dtypes("float32", "cpu") == ["float32"]
