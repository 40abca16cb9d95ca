"""`dsa-serve generate --cp-size` and `dsa-serve bench prefill` as users run them: each command starts its own
local Ray. The two commands run concurrently (they spend most of their time starting Ray and actors)."""

import json
import subprocess
import sys

import pytest
import torch

from model_workers.models.dsa.flops import prefill_flops
from cluster.cli import main
from model_workers.models.registry import parse_model_config

PROMPT = [5, 17, 99, 3, 64, 23, 8, 41, 77, 12, 90]  # 11 tokens: odd, not divisible by 2C


@pytest.fixture(scope="module")
def commands(reference_checkpoint):
    ref, folder = reference_checkpoint("v32", mtp=True)
    cli = [sys.executable, "-m", "cluster.cli"]
    generate = cli + ["generate", "--model", str(folder), "--prompt-ids", ",".join(map(str, PROMPT)),
                      "--max-tokens", "10", "--cp-size", "2", "--cp-strategy", "interleave", "--json"]
    bench = cli + ["bench", "prefill", "--model", str(folder), "--cp-size", "2", "--prompt-len", "64,2100",
                   "--dtype", "float32", "--kv-cache-dtype", "fp8_e4m3", "--repeats", "1", "--json"]
    running = [subprocess.Popen(c, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for c in (generate, bench)]
    outputs = []
    for process in running:
        stdout, stderr = process.communicate(timeout=300)
        assert process.returncode == 0, stderr[-2000:]
        outputs.append(json.loads(stdout))  # the result alone on stdout (cluster/commands/result_output.py)
    return ref, folder, outputs[0], outputs[1]


def test_generate_with_cp_size_matches_transformers(commands):
    ref, _, result, _ = commands
    expected = ref.generate(torch.tensor([PROMPT]), max_new_tokens=10, do_sample=False, pad_token_id=0)
    assert result["token_ids"] == expected[0, len(PROMPT):].tolist()
    assert (result["cp_size"], result["cp_strategy"], result["cp_impl"]) == (2, "interleave", "v2")  # auto -> v2


def test_bench_prefill_reports_scaling_bytes_phases_and_memory_per_length(commands):
    _, folder, _, bench = commands
    config = json.loads((folder / "config.json").read_text())
    c_kv, rope, index = config["kv_lora_rank"], config["qk_rope_head_dim"], config["index_head_dim"]
    per_token = (c_kv + 4 * -(-c_kv // 128) + 2 * rope) + (index + 4 * -(-index // 128))  # FP8 rows (docs/kv_cache.md)
    assert bench["kv_cache_dtype"] == "fp8_e4m3" and "ceil(kv_lora_rank/128)" in bench["kv_token_formula"]
    assert bench["formula_kv_bytes_per_token"] == 4 * per_token  # 3 target layers + 1 MTP layer
    bf16, fp8 = bench["kv_by_dtype"]["bfloat16"], bench["kv_by_dtype"]["fp8_e4m3"]
    assert fp8["kv_bytes_per_token"] == 4 * per_token and bf16["kv_bytes_per_token"] == 4 * 2 * (c_kv + rope + index)
    assert bench["kv_by_dtype"]["fp8_capacity_gain"] == round(bf16["kv_bytes_per_token"] / fp8["kv_bytes_per_token"], 4)
    assert bench["measured_kv_bytes_per_token"] == bench["formula_kv_bytes_per_token"]
    assert [e["prompt_len"] for e in bench["lengths"]] == [64, 2100]
    assert bench["prefill_chunk_tokens"] == 2 * 2048 and set(bench["paths"]) == {"served", "one_batch"}
    for entry in bench["lengths"]:  # the served path chunks as `serve` does (2048 per rank); one batch is one step
        one_rank, two_ranks = -(-entry["prompt_len"] // 2048), -(-entry["prompt_len"] // 4096)
        assert entry["chunks"] == two_ranks and [r["chunks"] for r in entry["runs"]] == [one_rank, one_rank, two_ranks]
        assert entry["one_batch"]["chunks"] == 1 and [r["chunks"] for r in entry["one_batch"]["runs"]] == [1] * 3
        assert entry["one_batch"]["measured_kv_bytes_per_rank"] == entry["formula_kv_bytes_per_rank"]
        assert entry["one_batch"]["strong_scaling_efficiency"] == pytest.approx(
            entry["one_batch"]["c1_wall_s"] / (2 * entry["one_batch"]["cp_wall_s"]))
    for entry in bench["lengths"]:
        single, equal, ranks = entry["runs"]
        assert (single["cp_size_used"], equal["cp_size_used"], ranks["cp_size_used"]) == (1, 1, 2)
        assert (single["threads_per_rank"], equal["threads_per_rank"]) == (1, 2)
        # the prompt split evenly: each rank receives exactly (C-1)/C of every layer's FP8 latent + indexer key
        assert entry["formula_kv_bytes_per_rank"] == 0.5 * entry["prompt_len"] * 4 * per_token
        assert ranks["kv_comm_bytes_per_rank"] == [entry["formula_kv_bytes_per_rank"]] * 2
        assert single["kv_comm_bytes_per_rank"] == [0]
        assert entry["strong_scaling_efficiency"] == pytest.approx(single["wall_s"] / (2 * ranks["wall_s"]))
        assert entry["equal_cores_ratio"] == pytest.approx(equal["wall_s"] / ranks["wall_s"])
        compute = entry["per_rank_compute_s"]
        assert all(t > 0 for t in compute)
        assert entry["compute_imbalance_max_over_mean"] == pytest.approx(max(compute) / (sum(compute) / len(compute)))
        modeled = entry["modeled_causal_work_imbalance"]
        assert modeled["zigzag"] < modeled["contiguous"] and modeled["interleave"] < modeled["contiguous"]
        for phases in entry["per_rank_phase_s"]:
            assert set(phases) == {"indexer", "compressor", "attention", "mlp", "communication", "other"}
            assert phases["indexer"] > 0 and phases["mlp"] > 0 and phases["communication"] > 0
        assert entry["c1_phase_s"]["communication"] == 0
        assert all(rss > 100 * 2**20 for rss in entry["peak_rss_bytes_per_rank"])  # a real process's RSS
        flops = entry["prefill_flop_efficiency"]  # the C ranks' served prefill against the fp32 GEMM rate
        counted = prefill_flops(parse_model_config(config), entry["prompt_len"], logit_rows=entry["chunks"])
        assert (flops["prompt_len"], flops["cp_size"], flops["chunks"]) == (entry["prompt_len"], 2, entry["chunks"])
        assert flops["model_flops"] == counted and counted["layers"] == 4  # 3 target layers + the MTP layer
        assert flops["efficiency"] > 0 and all(v > 0 for v in flops["phase_efficiency"].values())
    assert "efficiency" in bench["definitions"]["prefill_flop_efficiency"]


@pytest.mark.parametrize(
    "argv,message",
    [
        (["generate", "--prompt-ids", "5,6", "--cp-size", "0"], "cp_size"),
        (["generate", "--prompt-ids", "5,6,500", "--cp-size", "2"], "outside the vocabulary"),
        (["bench", "prefill", "--cp-size", "2", "--prompt-len", "0"], "--prompt-len values must be in 1..1048576"),
        (["generate", "--prompt-ids", "5,6", "--cp-size", "2", "--ep-size", "3"], "ep_size=3 is not supported with"
         " cp_size=2; allowed values: 1, 2"),
    ],
)
def test_cp_flag_errors_are_one_line(commands, capsys, argv, message):
    assert main(argv + ["--model", str(commands[1])]) == 2  # before any Ray or model work
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1


def test_unknown_strategy_is_rejected_by_the_parser(capsys):
    with pytest.raises(SystemExit):
        main(["generate", "--prompt-ids", "5", "--cp-size", "2", "--cp-strategy", "ring"])
    assert "--cp-strategy: invalid choice: 'ring'" in capsys.readouterr().err
