"""`dsa-serve bench decode`: token counts, acceptance accounting, the cost model and the overhead split."""

import json

import pytest

from cluster.bench.common import PROMPTS
from cluster.bench.decode import add_cost_model
from cluster.cli import main


def bench_json(capsys, folder, *extra):
    argv = ["bench", "decode", "--model", str(folder), "--dtype", "float32", "--max-tokens", "6", "--json", *extra]
    assert main(argv) == 0
    return json.loads(capsys.readouterr().out)  # the result alone on stdout


@pytest.fixture(scope="module")
def mtp_folder(reference_checkpoint):
    return reference_checkpoint("v32", mtp=True)[1]


def test_decode_bench_counts_tokens_acceptance_and_costs(capsys, mtp_folder):
    result = bench_json(capsys, mtp_folder, "--speculative-num-steps", "0,2", "--batch-size", "1,3")
    assert result["command"].startswith("dsa-serve bench decode --model")
    runs = {(r["speculative_num_steps"], r["batch_size"]): r for r in result["runs"]}
    assert set(runs) == {(0, 1), (2, 1), (0, 3), (2, 3)}
    assert result["rounds"] == 2
    for (k, batch), run in runs.items():
        passes = -(-len(PROMPTS) // batch)  # every prompt at least once, B at a time, in each of the 2 rounds
        assert run["tokens"] == 2 * passes * batch * 6  # every request ran to --max-tokens (EOS ignored)
        assert 0 <= run["engine_overhead_fraction"] < 1 and run["decode_only_steps"] > 0
        if k == 0:
            assert run["decode_loop_steps"]["plain"] > 0 and run["decode_loop_steps"]["speculative"] == 0
            continue
        assert len(run["per_position_acceptance"]) == 2
        assert 1 <= run["mean_accepted_length"] <= 3
        assert run["mean_accepted_length"] == pytest.approx(1 + k * run["acceptance_rate"])
        # the random MTP layer drafts from another distribution than the target: most drafts are rejected
        assert run["acceptance_rate"] < 0.5 and run["per_position_acceptance"][0] < 0.5
        assert run["per_position_acceptance"][0] >= run["per_position_acceptance"][1]  # a chain stops at a miss
        assert run["draft_cost_c"] > 0 and run["verify_cost_v"] > 0
        expected = run["mean_accepted_length"] / (2 * run["draft_cost_c"] + run["verify_cost_v"])
        assert run["predicted_speedup"] == pytest.approx(expected)


def test_cost_model_uses_the_plain_run_of_the_same_batch_size():
    plain = {"batch_size": 8, "speculative_num_steps": 0, "decode_loop_steps": {"plain": 10, "speculative": 0},
             "decode_model_s": {"plain": 1.0, "draft": 0.0, "verify": 0.0}}
    spec = {"batch_size": 8, "speculative_num_steps": 2, "mean_accepted_length": 2.4,
            "decode_loop_steps": {"plain": 0, "speculative": 5}, "decode_model_s": {"plain": 0, "draft": 0.3, "verify": 0.6}}
    other = dict(spec, batch_size=1)
    add_cost_model([plain, spec, other])
    assert spec["draft_cost_c"] == pytest.approx(0.3 / (5 * 2) / 0.1)  # 0.3 plain steps per draft token
    assert spec["verify_cost_v"] == pytest.approx(0.6 / 5 / 0.1)
    assert spec["predicted_speedup"] == pytest.approx(2.4 / (2 * 0.3 + 1.2))
    assert "draft_cost_c" not in other  # no k = 0 run at batch 1: no cost model


@pytest.mark.slow  # a Ray worker for a bench's shape: `make test-slow`
def test_decode_bench_through_a_ray_worker(capsys, mtp_folder):
    result = bench_json(capsys, mtp_folder, "--speculative-num-steps", "0,1", "--batch-size", "4", "--ray",
                        "--rounds", "1")
    assert [r["speculative_num_steps"] for r in result["runs"]] == [0, 1]  # two Ray engines, up at once
    run = result["runs"][1]
    assert result["engine"] == "ray worker" and run["tokens"] == 8 * 6 and "--rounds 1" in result["command"]
    assert 0 <= run["engine_overhead_fraction"] < 1


@pytest.mark.parametrize("argv,message", [
    (["--speculative-num-steps", "5"], "--speculative-num-steps values must be in 0..4"),
    (["--batch-size", "x"], "--batch-size must be comma-separated integers"),
    (["--max-tokens", "0"], "--max-tokens must be >= 1"),
    (["--rounds", "0"], "--rounds must be >= 1"),
])
def test_decode_bench_flag_errors(capsys, argv, message):
    assert main(["bench", "decode", *argv]) == 2
    assert message in capsys.readouterr().err
