"""`dsa-serve bench attention`: the dense baseline's numerics, the crossover rule, and the CLI's JSON."""

import json
import sys

import pytest
import torch

from cluster.bench.attention import crossover_length
from cluster.cli import main
from model_workers.kernels.torch.dense_mla import dense_causal_mla_attention
from model_workers.kernels.torch.sparse_mla import sparse_mla_attention
from model_workers.kernels.torch.topk import causal_topk

RUN_KEYS = {"length", "sparse_s", "sparse_indexer_s", "sparse_attention_s", "dense_s", "dense_over_sparse"}


def naive_dense(q_latent, q_pe, key_latent, scale):
    """Full-softmax reference: the whole [L, H, L] score matrix, future keys masked."""
    latent_dim = q_latent.shape[-1]
    scores = torch.einsum("thc,kc->thk", q_latent, key_latent[:, :latent_dim])
    scores = (scores + torch.einsum("thr,kr->thk", q_pe, key_latent[:, latent_dim:])) * scale  # [L, H, L]
    length = q_latent.shape[0]
    future = torch.ones(length, length, dtype=torch.bool).triu(1)  # [L, L] key after query
    probs = scores.masked_fill(future[:, None, :], float("-inf")).softmax(-1)
    return torch.einsum("thk,kc->thc", probs, key_latent[:, :latent_dim])


@pytest.fixture
def random_layer_inputs():
    generator = torch.Generator().manual_seed(0)
    length, heads, latent_dim, rope = 37, 3, 16, 8
    return (torch.randn(length, heads, latent_dim, generator=generator),  # q_latent [L, H, C]
            torch.randn(length, heads, rope, generator=generator),  # q_pe [L, H, R]
            torch.randn(length, latent_dim + rope, generator=generator),  # key latent [L, C + R]
            0.3)


@pytest.mark.parametrize("budget_bytes", [1, 4096, 1 << 26])  # one row per chunk, a few chunks, one chunk
def test_dense_matches_full_softmax(random_layer_inputs, budget_bytes):
    q_latent, q_pe, key_latent, scale = random_layer_inputs
    positions = torch.arange(q_latent.shape[0])
    got = dense_causal_mla_attention(q_latent, q_pe, key_latent, positions, scale, budget_bytes=budget_bytes)
    torch.testing.assert_close(got, naive_dense(q_latent, q_pe, key_latent, scale), atol=1e-5, rtol=1e-5)


def test_dense_equals_sparse_when_topk_covers_every_key(random_layer_inputs):
    q_latent, q_pe, key_latent, scale = random_layer_inputs
    length = q_latent.shape[0]
    positions = torch.arange(length)
    index_q, index_w, index_k = torch.randn(length, 2, 4), torch.rand(length, 2), torch.randn(length, 4)
    ids = causal_topk(index_q, index_w, index_k, positions, topk=length)  # every causal key
    sparse = sparse_mla_attention(q_latent, q_pe, key_latent, ids, scale)
    dense = dense_causal_mla_attention(q_latent, q_pe, key_latent, positions, scale)
    torch.testing.assert_close(dense, sparse, atol=1e-5, rtol=1e-5)


def runs(*pairs):
    return [{"length": n, "sparse_s": s, "dense_s": d} for n, s, d in pairs]


def test_crossover_is_start_of_the_suffix_where_sparse_wins():
    assert crossover_length(runs((64, 2, 1), (128, 1, 2), (256, 2, 1), (512, 1, 2), (1024, 1, 3))) == 512
    assert crossover_length(runs((1024, 1, 3), (64, 1, 2), (256, 1, 2))) == 64  # unsorted input, always faster
    assert crossover_length(runs((64, 1, 2), (128, 2, 1))) is None  # slower at the longest length
    assert crossover_length(runs((64, 1, 1))) is None  # a tie is not faster
    assert crossover_length([]) is None


def test_cli_prints_json_for_every_length(reference_checkpoint, capsys):
    _, folder = reference_checkpoint("v32")
    code = main(["bench", "attention", "--model", str(folder), "--lengths", "16,4,32", "--dtype", "float32",
                 "--repeats", "1", "--json"])
    assert code == 0
    result = json.loads(capsys.readouterr().out)
    assert result["bench"] == "attention" and result["index_topk"] == 8 and result["threads"] == 1
    assert [run["length"] for run in result["runs"]] == [4, 16, 32]
    for run in result["runs"]:
        assert set(run) == RUN_KEYS
        assert run["sparse_s"] == pytest.approx(run["sparse_indexer_s"] + run["sparse_attention_s"])  # 1 repeat
    assert result["crossover_length"] == crossover_length(result["runs"])
    if result["crossover_length"] is not None:
        assert result["crossover_over_index_topk"] == result["crossover_length"] / 8
    assert result["command"].startswith("dsa-serve bench attention --model ")
    assert "--lengths 16,4,32 --dtype float32" in result["command"]


@pytest.mark.parametrize("flags, message", [
    (["--lengths", "64,x"], "--lengths must be comma-separated integers"),
    (["--lengths", "0,64"], "--lengths values must be in"),
    (["--threads", "0"], "--threads must be >= 1"),
    (["--repeats", "0"], "--repeats must be >= 1"),
])
def test_bad_flags_exit_2(flags, message, capsys):
    assert main(["bench", "attention", *flags]) == 2
    assert message in capsys.readouterr().err


def test_plot_without_matplotlib_exits_2_before_measuring(monkeypatch, tmp_path, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    code = main(["bench", "attention", "--lengths", "8", "--plot", str(tmp_path / "a.png")])
    assert code == 2
    assert "--plot needs matplotlib: pip install 'dsa-serve[bench]'" in capsys.readouterr().err
    assert not (tmp_path / "a.png").exists()
