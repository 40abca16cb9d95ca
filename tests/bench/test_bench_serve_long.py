"""`python -m benchmarks serve --workload long` (benchmarks/serve_long.py): the held-out prompts, the transformers
queue derivation and streamer, flag errors, the report / targets / plot of a long result, and one small end-to-end
run."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.cli import build_parser
from benchmarks.cli import main as harness_main
from benchmarks.serve_long import efficiency_block, long_prompts, resolve_workload
from benchmarks.transformers_long import TokenClock, queued_timings
from cluster.bench.common import _EndOfFileAs, cut_windows, window_offsets
from cluster.bench.load import summarize
from cluster.bench.serve import check_arguments
from cluster.commands.aliases import resolve_speculation
from model_workers.checkpoint.model_dir import resolve_model_dir
from model_workers.checkpoint.tokenizer import load_tokenizer
from model_workers.training.corpus import stdlib_files, token_stream

REPO = Path(__file__).resolve().parents[2]


def run(e2e_s: float, offsets: list[float]) -> dict:
    return {"e2e_s": e2e_s, "ttft_s": offsets[0], "token_offsets_s": offsets, "tokens": len(offsets)}


RUNS = [run(2.0, [0.5, 1.0, 2.0]), run(3.0, [1.0, 2.0, 3.0]), run(1.0, [0.25, 0.5, 1.0])]


def test_concurrency_one_is_the_sequential_runs_as_they_are():
    summary = summarize(*queued_timings(RUNS, 1, 3))
    assert summary["ttft_s"]["p50"] == pytest.approx(0.5) and summary["ttft_s"]["mean"] == pytest.approx(1.75 / 3)
    assert summary["wall_s"] == pytest.approx(6.0) and summary["output_tokens_per_s"] == pytest.approx(9 / 6.0)
    assert sorted(summary["itl_s"].values())[0] >= 0.25 and summary["tokens_per_chunk"] == 1.0


def test_c_requests_arriving_together_queue_behind_the_earlier_runs():
    timings, wall_s = queued_timings(RUNS, 3, 3)
    assert [t.ttft_s for t in timings] == pytest.approx([0.5, 2.0 + 1.0, 2.0 + 3.0 + 0.25])  # earlier durations + own
    assert wall_s == pytest.approx(6.0)
    assert summarize(timings, wall_s)["output_tokens_per_s"] == pytest.approx(9 / 6.0)  # total tokens / total time
    assert [gap for t in timings for gap in t.itl_s] == pytest.approx([0.5, 1.0, 1.0, 1.0, 0.25, 0.5])  # own gaps


def test_a_closed_loop_of_fewer_clients_sends_the_next_request_when_one_finishes():
    timings, _ = queued_timings(RUNS, 2, 3)
    # request 2 arrives when request 0 ends (2.0) and starts when request 1 ends (5.0)
    assert [t.ttft_s for t in timings] == pytest.approx([0.5, 3.0, 5.0 - 2.0 + 0.25])
    repeated, wall_s = queued_timings(RUNS[:1], 1, 2)  # more requests than runs: run i % len(runs)
    assert [t.ttft_s for t in repeated] == pytest.approx([0.5, 0.5]) and wall_s == pytest.approx(4.0)


def test_the_streamer_times_generated_tokens_not_the_prompt():
    clock = TokenClock()
    clock.put("the prompt")
    assert clock.times == []
    clock.put("token 1")
    clock.put("token 2")
    clock.end()
    assert len(clock.times) == 2 and clock.times[0] <= clock.times[1]


def test_windows_are_distinct_non_overlapping_and_of_the_right_length():
    stream = list(range(100))
    assert window_offsets(100, 4, 20, "f") == [0, 20, 40, 60]
    windows = cut_windows(stream, 3, 20, "f")
    assert [len(w) for w in windows] == [20] * 3 and [w[0] for w in windows] == [0, 26, 52]
    assert cut_windows(stream, 1, 100, "f") == [stream]
    with pytest.raises(ValueError, match="--long-prompt-lens 40 with --num-prompts 3: 3 non-overlapping"):
        cut_windows(stream, 3, 40, "--long-prompt-lens 40 with --num-prompts 3")
    with pytest.raises(ValueError, match="101 tokens do not fit the 100 tokens"):
        cut_windows(stream, 1, 101, "f")


def test_long_prompts_are_cut_from_the_held_out_files(tmp_path):
    model_dir = resolve_model_dir(None)
    prompts = long_prompts(model_dir, [128, 256], 3, 64)
    held_out = token_stream(load_tokenizer(model_dir), stdlib_files().held_out).tolist()
    assert prompts["held_out_tokens"] == len(held_out)
    for length in (128, 256):
        windows, offsets = prompts["by_length"][length], prompts["offsets"][str(length)]
        assert [len(w) for w in windows] == [length] * 3 and len({tuple(w) for w in windows}) == 3
        assert all(b - a >= length for a, b in zip(offsets, offsets[1:]))  # non-overlapping
        assert windows == [held_out[o : o + length] for o in offsets]
    assert prompts["efficiency"] == held_out[:64]
    assert long_prompts(model_dir, [128, 256], 3, 64) == prompts  # deterministic


def test_a_tokenizer_without_the_corpus_eos_joins_files_with_the_model_eos(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    tokenizer = Tokenizer(models.WordLevel({"a": 0, "b": 1, "[UNK]": 2}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    (tmp_path / "one.py").write_text("a b")
    assert token_stream(_EndOfFileAs(tokenizer, 7), (tmp_path / "one.py",)).tolist() == [0, 1, 7]


def test_a_prefill_not_run_or_failed_is_a_skipped_efficiency_with_the_reason():
    model_dir = resolve_model_dir(None)
    assert efficiency_block(model_dir, None, 0, None) == {"skipped": True, "reason": "--efficiency-prefill-len 0"}
    failed = efficiency_block(model_dir, None, 8192, {"failed": "RuntimeError('x')"})
    assert failed["skipped"] and "the prefill failed: RuntimeError('x')" == failed["reason"]


def parsed(*flags: str):
    args = build_parser().parse_args(["serve", *flags])
    resolve_speculation(args)  # as the harness's main does first
    return args, check_arguments(args, resolve_workload)


def test_long_defaults_and_short_defaults_unchanged():
    args, levels = parsed("--workload", "long")
    assert levels == [1, 4] and args.skip_in_process and args.in_process_skipped_by_default
    assert (args.long_prompt_lens, args.efficiency_prefill_len, args.cp_size) == ("4096,8192,16384", 8192, 2)
    args, _ = parsed("--workload", "long", "--no-skip-in-process")
    assert not args.skip_in_process and args.no_skip_in_process
    args, levels = parsed()
    assert levels == [1, 8, 32, 64] and not args.skip_in_process and args.workload == "short"


@pytest.mark.parametrize("flags, named", [
    (["--long-prompt-lens", "0,8"], "--long-prompt-lens"),
    (["--long-prompt-lens", "4096,x"], "--long-prompt-lens"),
    (["--long-prompt-lens", "32768"], "--long-prompt-lens"),  # + 64 tokens past max_position_embeddings 32768
    (["--long-prompt-lens", "30000", "--num-prompts", "4"], "--long-prompt-lens 30000 with --num-prompts 4"),
    (["--efficiency-prefill-len", "-1"], "--efficiency-prefill-len"),
    (["--efficiency-prefill-len", "40000"], "--efficiency-prefill-len"),
    (["--concurrency", "1,4", "--num-prompts", "2"], "--num-prompts"),
    (["--long-prompt-lens", "4096", "--max-model-len", "2048"], "--max-model-len"),
    (["--prompt-len", "16"], "--prompt-len"),
])
def test_invalid_long_flags_exit_2_naming_the_flag(capsys, flags, named):
    assert harness_main(["serve", "--workload", "long", *flags]) == 2
    assert named in capsys.readouterr().err


@pytest.mark.parametrize("flag, value", [("--long-prompt-lens", "128"), ("--efficiency-prefill-len", "64")])
def test_long_flags_on_the_short_workload_exit_2(capsys, flag, value):
    assert harness_main(["serve", flag, value]) == 2
    assert f"{flag} is a --workload long flag" in capsys.readouterr().err


def long_result(ratios: dict, efficiency: float) -> dict:
    """A synthetic long result: runs at (length, 4) with (throughput ratio, TTFT ratio), the prefill block."""
    def summary(ttft: float, tps: float) -> dict:
        return {"ttft_s": {"p50": ttft, "p90": 2 * ttft}, "output_tokens_per_s": tps}

    runs = [{"prompt_len": n, "concurrency": 4, **summary(1.0, 100.0 * x), "transformers": summary(1.0 / t, 100.0),
             "throughput_ratio_vs_transformers": x, "ttft_ratio_vs_transformers": t, "ttft_p50_ratio": 9.0}
            for n, (x, t) in ratios.items()]
    block = {"skipped": False, "prompt_len": 8192, "cp_size": 2, "wall_s": 3.0, "efficiency": efficiency,
             "model_flops": {"total": 1.5e11}, "gemm_flops_per_s": {"rank": 8e10, "all": 1.6e11},
             "phase_efficiency": {"indexer": 0.3, "attention": 0.2, "mlp": 0.6}}
    return {"bench": "serve", "workload": "long", "model": "m", "dtype": "bfloat16", "max_tokens": 64, "runs": runs,
            "server": {"cp_size": 2, "speculative_num_steps": 0}, "headline": {"prompt_len": 8192, "concurrency": 4},
            "throughput_ratio_vs_transformers": ratios[8192][0], "ttft_ratio_vs_transformers": ratios[8192][1],
            "transformers": {"skipped": False, "dtype": "float32", "probe_prompt_len": 4096, "threads": 2,
                             "dtypes_tried": {"float32": {"e2e_s": 9.0}, "bfloat16": {"error": "x"}},
                             "lengths": [{"prompt_len": 16384, "skipped": True, "reason": "out of memory"}]},
            "prefill_flop_efficiency": block}


def test_report_table_targets_and_plot_of_a_long_result(tmp_path):
    folder = tmp_path / "results"
    folder.mkdir()
    (folder / "serve_long.json").write_text(json.dumps(long_result({8192: (13.0, 0.05), 16384: (15.0, 0.04)}, 0.4)))
    assert harness_main(["report", "--results", str(folder), "--out", str(tmp_path / "B.md"),
                         "--plots-dir", str(tmp_path / "plots")]) == 0
    text = (tmp_path / "B.md").read_text()
    assert "| 8192 | 4 | 1 | 2 | 1300 | 20 | 40 | 100 | 13 | 0.05 |" in text
    assert "throughput x13, TTFT p50 x0.05 of transformers" in text and "L=16384 skipped: out of memory" in text
    assert "| 8192 | 2 | 3 | 150 | 80 | 160 | 0.4 | 0.3 | 0.2 | 0.6 |" in text  # the prefill FLOP efficiency

    def verdict(start: str) -> str:
        return next(line for line in text.splitlines() if line.startswith(f"| {start}")).rsplit("|", 2)[-2].strip()

    assert verdict("long context: throughput at 8k") == "PASS" and verdict("long context: TTFT p50") == "PASS"
    assert verdict("long context: throughput at 16k") == "MISS" and verdict("prefill FLOP efficiency") == "MISS"
    assert verdict("serving TTFT p50 HTTP / in-process") == "not measured"  # long runs are not the short targets
    assert (tmp_path / "plots" / "serve_long.png").stat().st_size > 1000


def finite_positive(value) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value) and value > 0


def check_long_result(result: dict) -> None:
    """The structure of a small long run (lengths 128, 256; C = 1, 2; 4 tokens) and its numbers positive."""
    assert (result["bench"], result["workload"], result["max_tokens"], result["num_prompts"]) == ("serve", "long", 4, 2)
    assert "--workload long" in result["command"] and "--long-prompt-lens 128,256" in result["command"]
    assert result["prompt_lens"] == [128, 256] and result["concurrency"] == [1, 2]
    assert result["in_process"]["skipped"] and "double the run time" in result["in_process"]["reason"]
    assert result["server"]["cp_size"] == 2 and result["server"]["started_here"]
    for key in ("transformers", "throughput_ratio_vs_transformers", "ttft_ratio_vs_transformers", "prompts",
                "prefill_flop_efficiency"):
        assert key in result["definitions"]
    assert result["throughput_ratio_vs_transformers"] is None and result["ttft_ratio_vs_transformers"] is None
    baseline = result["transformers"]
    assert not baseline["skipped"] and baseline["dtype"] in baseline["dtypes_tried"] and baseline["threads"] >= 1
    assert set(baseline["dtypes_tried"]) == {"bfloat16", "float32"} and baseline["probe_prompt_len"] == 128
    assert [(e["prompt_len"], e["skipped"], [r["tokens"] for r in e["runs"]]) for e in baseline["lengths"]] == [
        (128, False, [4, 4]), (256, False, [4, 4])]
    assert [(r["prompt_len"], r["concurrency"]) for r in result["runs"]] == [(128, 1), (128, 2), (256, 1), (256, 2)]
    for entry in result["runs"]:
        for measured in (entry, entry["transformers"]):
            assert measured["num_requests"] == 2 and measured["output_tokens"] == 8
            assert all(finite_positive(measured["ttft_s"][q]) for q in ("p50", "p90"))
            assert finite_positive(measured["output_tokens_per_s"])
        assert finite_positive(entry["throughput_ratio_vs_transformers"])
        assert finite_positive(entry["ttft_ratio_vs_transformers"])
    block = result["prefill_flop_efficiency"]
    assert not block["skipped"] and (block["prompt_len"], block["cp_size"], block["threads_per_rank"]) == (256, 2, 1)
    assert all(finite_positive(v) for v in (block["efficiency"], block["wall_s"], *block["phase_efficiency"].values(),
                                            block["gemm_flops_per_s"]["rank"], block["gemm_flops_per_s"]["all"]))


@pytest.mark.slow
def test_bench_serve_long_end_to_end_on_the_default_model(tmp_path):
    plot_path = tmp_path / "long.png"
    command = [sys.executable, "-m", "benchmarks", "serve", "--workload", "long", "--long-prompt-lens",
               "128,256", "--concurrency", "1,2", "--max-tokens", "4", "--warmup", "1", "--efficiency-prefill-len",
               "256", "--json", "--plot", str(plot_path)]
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env, cwd=REPO)
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads(done.stdout)  # the result alone on stdout
    check_long_result(result)
    assert plot_path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    results = tmp_path / "results"
    results.mkdir()
    (results / "serve_long.json").write_text(json.dumps(result))
    assert harness_main(["report", "--results", str(results), "--out", str(tmp_path / "B.md"),
                         "--plots-dir", str(tmp_path / "plots")]) == 0
    text = (tmp_path / "B.md").read_text()
    assert "| L | C | TTFT p50 s | TTFT p90 s | tokens/s | transformers TTFT p50 s |" in text
    assert "| 256 | 2 |" in text and (tmp_path / "plots" / "serve_long.png").is_file()
