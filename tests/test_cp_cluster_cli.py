"""`dsa-serve generate --cp-size` and `dsa-serve bench prefill` as users run them: each command starts its own
local Ray. The two commands run concurrently (they spend most of their time starting Ray and actors)."""

import json
import subprocess
import sys

import pytest
import torch

from cluster.cli import main

PROMPT = [5, 17, 99, 3, 64, 23, 8, 41, 77, 12, 90]  # 11 tokens: odd, not divisible by 2C


@pytest.fixture(scope="module")
def commands(reference_checkpoint):
    ref, folder = reference_checkpoint("v32", mtp=True)
    cli = [sys.executable, "-m", "cluster.cli"]
    generate = cli + ["generate", "--model", str(folder), "--prompt-ids", ",".join(map(str, PROMPT)),
                      "--max-tokens", "10", "--cp-size", "2", "--cp-strategy", "interleave", "--json"]
    bench = cli + ["bench", "prefill", "--model", str(folder), "--cp-size", "2", "--prompt-len", "64",
                   "--dtype", "float32", "--repeats", "1", "--warmup", "0", "--json"]
    running = [subprocess.Popen(c, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for c in (generate, bench)]
    outputs = []
    for process in running:
        stdout, stderr = process.communicate(timeout=300)
        assert process.returncode == 0, stderr[-2000:]
        outputs.append(json.loads(stdout.strip().splitlines()[-1]))
    return ref, folder, outputs[0], outputs[1]


def test_generate_with_cp_size_matches_transformers(commands):
    ref, _, result, _ = commands
    expected = ref.generate(torch.tensor([PROMPT]), max_new_tokens=10, do_sample=False, pad_token_id=0)
    assert result["token_ids"] == expected[0, len(PROMPT):].tolist()
    assert (result["cp_size"], result["cp_strategy"], result["cp_impl"]) == (2, "interleave", "v2")  # auto -> v2


def test_bench_prefill_reports_measured_bytes_next_to_the_formula(commands):
    _, _, _, bench = commands
    cp1, cp2 = bench["runs"]
    assert (cp1["cp_size_used"], cp2["cp_size_used"]) == (1, 2)
    assert cp2["per_rank_logical_token"] == [32, 32]
    # 64 tokens split evenly: each rank receives exactly (C-1)/C of every layer's latent + indexer key
    config = json.loads((commands[1] / "config.json").read_text())
    per_token = (config["kv_lora_rank"] + config["qk_rope_head_dim"] + config["index_head_dim"]) * 4
    assert bench["formula_kv_bytes_per_rank"] == 0.5 * 64 * 4 * per_token  # 3 target layers + 1 MTP layer
    assert cp2["kv_comm_bytes_per_rank"] == [bench["formula_kv_bytes_per_rank"]] * 2
    assert cp1["kv_comm_bytes_per_rank"] == [0] and cp1["collectives_per_rank"] == [0]
    assert bench["speedup_vs_cp1"] == pytest.approx(cp1["wall_s"] / cp2["wall_s"])
    assert all(t > 0 for t in cp2["per_rank_compute_s"]) and cp2["compute_imbalance_max_over_mean"] >= 1


@pytest.mark.parametrize(
    "argv,message",
    [
        (["generate", "--prompt-ids", "5,6", "--cp-size", "0"], "cp_size"),
        (["generate", "--prompt-ids", "5,6,500", "--cp-size", "2"], "outside the vocabulary"),
        (["bench", "prefill", "--cp-size", "2", "--prompt-len", "0"], "--prompt-len must be >= 1"),
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
