"""`python -m benchmarks report` (benchmarks/report.py) from synthetic bench JSON: tables, target verdicts, plots,
missing pieces, notes; and the plots of the installed benches (cluster/bench/plot.py)."""

import json
import sys

import pytest

from benchmarks.cli import main
from benchmarks.targets import TARGETS, evaluate
from cluster.bench.common import model_fingerprint
from cluster.bench.plot import prefill_points, save_plot
from cluster.bench.render import MATPLOTLIB_MISSING
from cluster.cli import main as cli_main

GIB = 1 << 30

ATTENTION = {
    "bench": "attention", "command": "dsa-serve bench attention --lengths 64,128,256,512 --json",
    "model": "m", "dtype": "bfloat16", "index_topk": 64, "threads": 1, "crossover_length": 256,
    "crossover_over_index_topk": 4.0,
    "runs": [{"length": n, "sparse_s": s, "sparse_indexer_s": s / 2, "sparse_attention_s": s / 2, "dense_s": d,
              "dense_over_sparse": d / s} for n, s, d in [(64, 2.0, 1.0), (128, 3.0, 2.5), (256, 4.0, 6.0),
                                                         (512, 6.0, 20.0)]],
}


def prefill_run(cp_size, wall_s, rss=None):
    run = {"cp_size": cp_size, "wall_s": wall_s, "per_rank_compute_s": [wall_s] * cp_size}
    return run if rss is None else {**run, "peak_rss_bytes_per_rank": [rss] * cp_size}


PREFILL_8K = {  # today's layout: one length, runs = [C=1, C]
    "bench": "prefill", "prompt_len": 8192, "cp_size": 2, "cp_strategy": "zigzag", "dtype": "bfloat16",
    "formula_kv_bytes_per_rank": 1000.0, "measured_kv_bytes_per_rank": 1000,
    "runs": [prefill_run(1, 10.0), prefill_run(2, 5.4)],  # efficiency 10 / 5.4 / 2 = 0.926
}
PREFILL_LENGTHS = {  # the extended layout: a "lengths" list; the 32k entry runs over the RSS limit
    "bench": "prefill", "cp_size": 2,
    "lengths": [{"prompt_len": n, "cp_size": 2, "runs": [prefill_run(1, t1), prefill_run(2, t2, rss)]}
                for n, t1, t2, rss in [(16384, 20.0, 10.5, 2 * GIB), (32768, 40.0, 21.0, 5 * GIB)]],
}


def decode_run(k, batch, tokens_per_s, overhead=0.1):
    return {"speculative_num_steps": k, "batch_size": batch, "tokens_per_s": tokens_per_s,
            "mean_accepted_length": 1 + 0.7 * k, "formula_accepted_length": 1 + 0.72 * k,
            "engine_overhead_fraction": overhead, "speedup_vs_first_k": 1.0}


DECODE = {"bench": "decode", "dtype": "bfloat16", "command": "dsa-serve bench decode --json",
          "model_fingerprint": {"num_hidden_layers": 8, "weights_sha256": "0123456789abcdef"},
          "runs": [decode_run(0, 1, 10.0), decode_run(2, 1, 17.0), decode_run(0, 8, 50.0, overhead=0.2)]}


@pytest.fixture
def results_dir(tmp_path):
    folder = tmp_path / "results"
    folder.mkdir()
    for name, result in [("attention", ATTENTION), ("prefill_8k", PREFILL_8K), ("prefill_long", PREFILL_LENGTHS),
                         ("decode", DECODE)]:
        (folder / f"{name}.json").write_text(json.dumps(result))
    (folder / "broken.json").write_text("{not json")
    return folder


def write_report(results_dir, out_dir):
    code = main(["report", "--results", str(results_dir), "--out", str(out_dir / "BENCHMARKS.md"),
                 "--plots-dir", str(out_dir / "plots")])
    assert code == 0
    return (out_dir / "BENCHMARKS.md").read_text()


def target_line(text: str, start: str) -> str:
    return next(line for line in text.splitlines() if line.startswith(f"| {start}"))


def test_report_tables_verdicts_and_plots(results_dir, tmp_path):
    text = write_report(results_dir, tmp_path / "out")
    assert "## Machine" in text and "logical cores" in text and "torch " in text
    assert "| L | sparse s | indexer s |" in text and "| 256 | 4 | 2 |" in text  # attention table
    assert "| L | C | C=1 1 thread s | C=1 C threads s | C ranks s |" in text  # prefill, both layouts
    assert "| 8192 | 2 | 10 | – | 5.4 |" in text and "| 32768 | 2 | 40 | – | 21 |" in text
    assert "| k | B | tokens/s |" in text
    assert target_line(text, "CP strong-scaling").endswith("| PASS |")  # min(0.926, 0.952, 0.952)
    assert target_line(text, "sparse attention faster").endswith("| PASS |")
    assert target_line(text, "speculative decoding").endswith("| PASS |")  # 17 / 10 = 1.7x
    assert target_line(text, "per-step engine overhead").endswith("| MISS |")  # 20% at B=8
    assert target_line(text, "peak RSS").endswith("| MISS |")  # 5 GiB at 32k
    assert target_line(text, "KV bytes").endswith("| PASS |")
    assert target_line(text, "serving TTFT").endswith("| not measured | not measured |")
    assert target_line(text, "serving tokens/s HTTP").endswith("| not measured |")
    assert target_line(text, "short-prompt decode in process").endswith("| not measured |")
    assert "dsa-serve bench attention --lengths 64,128,256,512 --json" in text
    assert "records no command" in text  # the prefill JSON has none
    assert "broken.json: not JSON" in text
    assert "Model: 8 decoder layers, weights sha256 `0123456789abcdef`." in text  # decode's fingerprint
    assert "Model: not recorded." in text  # the attention JSON has none
    for name in ("attention", "prefill_8k", "prefill_long", "decode"):
        png = tmp_path / "out" / "plots" / f"{name}.png"
        assert png.is_file() and png.stat().st_size > 1000
        assert f"(plots/{name}.png)" in text  # linked relative to BENCHMARKS.md


def test_report_with_no_results_says_not_measured(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    text = write_report(empty, tmp_path)
    assert "No bench results found" in text
    assert text.count("| not measured | not measured |") == len(TARGETS)


def test_report_without_matplotlib_still_writes_tables(results_dir, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    text = write_report(results_dir, tmp_path)
    assert f"(plot not drawn: {MATPLOTLIB_MISSING})" in text and "| PASS |" in text
    assert not (tmp_path / "plots").exists()


def test_save_plot_errors_name_the_problem(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match="no plot for bench 'nope'; allowed: attention, decode, prefill, serve"):
        save_plot({"bench": "nope"}, str(tmp_path / "x.png"))
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(ValueError, match=r"--plot needs matplotlib: pip install 'dsa-serve\[bench\]'"):
        save_plot(ATTENTION, str(tmp_path / "x.png"))


def test_report_needs_a_results_folder(tmp_path, capsys):
    assert main(["report", "--results", str(tmp_path / "missing")]) == 2
    assert "--results must be a folder" in capsys.readouterr().err


@pytest.mark.parametrize("kind", ["report", "soak"])
def test_the_installed_cli_points_to_the_harness_for_what_moved(kind, capsys):
    assert cli_main(["bench", kind, "--results", "x"]) == 2
    assert f"run `python -m benchmarks {kind} ...` from a checkout" in capsys.readouterr().err


def test_prefill_points_read_both_layouts():
    (point,) = prefill_points(PREFILL_8K)
    assert point["prompt_len"] == 8192 and point["cp_size"] == 2 and point["efficiency"] == pytest.approx(10 / 5.4 / 2)
    assert [p["prompt_len"] for p in prefill_points(PREFILL_LENGTHS)] == [16384, 32768]


def test_report_shows_phases_imbalance_and_notes_of_the_prefill_bench(tmp_path):
    phases = {"indexer": 3.0, "attention": 1.0, "mlp": 0.5, "communication": 0.2, "other": 0.1}
    entry = {"prompt_len": 8192, "cp_size": 2, "c1_wall_s": 9.0, "c1_cthreads_wall_s": 5.0, "cp_wall_s": 4.8,
             "strong_scaling_efficiency": 0.9375, "equal_cores_ratio": 1.04, "compute_imbalance_max_over_mean": 1.02,
             "modeled_causal_work_imbalance": {"zigzag": 1.0, "interleave": 1.0001, "contiguous": 1.5},
             "c1_phase_s": phases, "per_rank_phase_s": [phases, phases], "peak_rss_bytes_per_rank": [GIB, GIB],
             "measured_kv_bytes_per_rank": 10, "formula_kv_bytes_per_rank": 10.0, "runs": [], "chunks": 4,
             "one_batch": {"c1_wall_s": 8.0, "cp_wall_s": 4.0, "strong_scaling_efficiency": 1.0}}
    result = {"bench": "prefill", "cp_size": 2, "cp_strategy": "zigzag", "lengths": [entry], "prefill_chunk_tokens": 2048,
              "measured_kv_bytes_per_token": 1280, "formula_kv_bytes_per_token": 1280, "kv_token_formula": "f"}
    folder = tmp_path / "results"
    folder.mkdir()
    (folder / "prefill.json").write_text(json.dumps(result))
    notes = tmp_path / "notes.md"
    notes.write_text("## What stands in the way\n\nexplained here")
    assert main(["report", "--results", str(folder), "--out", str(tmp_path / "B.md"),
                 "--plots-dir", str(tmp_path / "plots"), "--notes", str(notes)]) == 0
    text = (tmp_path / "B.md").read_text()
    assert "| 8192 | 2 | 9 | 5 | 4.8 | 1.875 | 0.9375 | 1.04 | 1.02 | 10 | 10 | 1 |" in text
    assert "| 8192 | 1 | 1 | 1.5 | 1.02 |" in text  # zigzag, interleave, contiguous (model), measured
    assert "Served (2048-token chunks, the table above) vs one unchunked batch" in text
    assert "| 8192 | 4 | 9 | 4.8 | 0.9375 | 8 | 4 | 1 |" in text  # served next to one batch
    assert "| 8192 | rank 1 | 3 | 1 | 0.5 | 0.2 | 0.1 |" in text
    assert "KV cache bytes per token: measured 1280, formula 1280" in text
    assert text.index("## Targets") < text.index("explained here") < text.index("## Results")
    assert target_line(text, "CP strong-scaling").endswith("| PASS |")


def test_a_result_after_ray_lines_on_stdout_is_read(tmp_path):
    """`bench serve --json > FILE` may hold Ray's own lines before the JSON object (its last line)."""
    from benchmarks.report import load_results

    (tmp_path / "serve_x.json").write_text("(raylet) Task ServeController.graceful_shutdown failed.\n"
                                           + json.dumps({"bench": "serve", "runs": []}) + "\n")
    (tmp_path / "junk.json").write_text("not json at all\n")
    results, skipped = load_results(tmp_path)
    assert [name for name, _ in results] == ["serve_x"]
    assert len(skipped) == 1 and skipped[0].startswith("junk.json: not JSON")


def test_model_fingerprint_names_depth_and_the_cards_weights_hash(tmp_path):
    from model_workers.checkpoint.model_dir import PACKAGED_MODEL_DIR

    card = json.loads((PACKAGED_MODEL_DIR / "model_card.json").read_text())
    config = json.loads((PACKAGED_MODEL_DIR / "config.json").read_text())
    assert model_fingerprint(PACKAGED_MODEL_DIR) == {
        "num_hidden_layers": config["num_hidden_layers"], "weights_sha256": card["sha256"]["model.safetensors"][:16]}
    (tmp_path / "config.json").write_text(json.dumps({"num_hidden_layers": 3}))  # a checkpoint without a card
    assert model_fingerprint(tmp_path) == {"num_hidden_layers": 3, "weights_sha256": None}


def serve_result(direct_ingress: bool | None, ttft_ratio: float, tokens_per_s: float) -> dict:
    """A short-workload `bench serve` result with one run at 1 stream and one at 32."""
    runs = [{"concurrency": 1, "ttft_p50_ratio": ttft_ratio, "itl_p50_ratio": 1.0},
            {"concurrency": 32, "ttft_p50_ratio": 1.5, "itl_p50_ratio": 1.0, "output_tokens_per_s": tokens_per_s,
             "in_process": {"output_tokens_per_s": 1000.0}}]
    return {"bench": "serve", "server": {"direct_ingress": direct_ingress}, "runs": runs}


def test_serving_overhead_targets_judge_the_default_path_only():
    verdicts = {target.name: (text, verdict) for target, text, verdict in
                evaluate({"serve": [serve_result(True, 1.10, 950.0), serve_result(False, 1.80, 600.0)]})}
    ttft = next(v for name, v in verdicts.items() if name.startswith("serving TTFT p50"))
    tokens = next(v for name, v in verdicts.items() if name.startswith("serving tokens/s HTTP"))
    assert ttft == ("1.100", "PASS") and tokens == ("0.95x (950.0 vs 1000.0 tok/s)", "PASS")
    proxy_only = {target.name: verdict for target, _, verdict in evaluate({"serve": [serve_result(False, 1.8, 600.0)]})}
    assert all(verdict == "not measured" for name, verdict in proxy_only.items() if name.startswith("serving "))
    with_url = {t.name: v for t, _, v in evaluate({"serve": [serve_result(None, 1.3, 950.0)]})}  # --url: judged
    assert next(v for name, v in with_url.items() if name.startswith("serving TTFT p50")) == "MISS"
