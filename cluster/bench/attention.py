"""`dsa-serve bench attention`: one layer's sparse (indexer top-k + gathered MLA) vs dense attention over L.

For each prompt length L, one request's prefill through the first layer that has an indexer:
  sparse = `causal_topk` (indexer scores + causal top-k at the model's index_topk)
           + `sparse_mla_attention` over the index_topk gathered keys,
  dense  = `dense_causal_mla_attention` over every causal key (no indexer).
Inputs come from running the real layer's projections on embedded random tokens (seed 0). Prints the
median time of each part and the crossover length: the smallest measured L from which sparse stays
faster than dense at every larger measured L.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from cluster.bench.common import model_fingerprint, spelled_command
from cluster.commands.args import add_dtype_argument, int_list
from cluster.commands.result_output import print_result
from model_workers.precision import compute_dtype, storage_dtype

DEFAULT_LENGTHS = "64,128,256,512,1024,2048,4096,8192"
INPUTS = "the layer's own projections of embedded random token ids (torch seed 0), positions 0..L-1"
ATTENTION_FLAGS = ("model", "lengths", "dtype", "threads", "repeats")
TARGET_TOPK_MULTIPLE = 4  # target: sparse faster than dense beyond ~4 * index_topk tokens


def add_parser(kinds) -> None:
    attention = kinds.add_parser("attention", help="one layer's sparse vs dense attention time over L")
    attention.add_argument("--model", default=None, help="checkpoint folder (default: the embedded model)")
    attention.add_argument("--lengths", default=DEFAULT_LENGTHS, help="prompt lengths L, comma list")
    add_dtype_argument(attention, default="bfloat16", allow_auto=False)
    attention.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    attention.add_argument("--repeats", type=int, default=3, help="timed runs per length (median kept)")
    attention.add_argument("--json", action="store_true", help="print one JSON object")
    attention.add_argument("--plot", default=None, metavar="FILE.png", help="also save a plot (needs matplotlib)")
    attention.set_defaults(run=run_attention)


class CaptureBackend:
    """An `AttentionBackend` that records what the layer hands it and attends to nothing."""

    def __init__(self):
        self.tensors: dict[str, torch.Tensor] = {}

    def store_kv(self, layer_id: int, latent: torch.Tensor, index_key: torch.Tensor | None) -> None:
        self.tensors.update(latent=latent, index_k=index_key)  # [L, C + R], [L, D_idx]

    def needs_index_scores(self, layer_id: int, topk: int) -> bool:
        return True  # the indexer's inputs are what it records

    def select_topk(self, layer_id: int, index_q: torch.Tensor, index_weights: torch.Tensor, topk: int):
        self.tensors.update(index_q=index_q, index_w=index_weights)  # [L, H_idx, D_idx], [L, H_idx]
        return torch.empty(index_q.shape[0], 0, dtype=torch.long)

    def attend(self, layer_id: int, q_latent, q_pe, topk_ids, scale: float) -> torch.Tensor:
        self.tensors.update(q_latent=q_latent, q_pe=q_pe)  # [L, H, C], [L, H, R]
        self.tensors["scale"] = torch.tensor(scale)
        return torch.zeros_like(q_latent)


def first_indexer_layer(model) -> int:
    for layer_id in range(model.config.num_hidden_layers):
        if model.model.layers[layer_id].self_attn.indexer is not None:
            return layer_id
    raise ValueError("--model: no layer has an indexer (not a DSA checkpoint)")


@torch.inference_mode()
def layer_inputs(model, layer_id: int, length: int) -> dict[str, torch.Tensor]:
    """Runs layer `layer_id`'s attention projections on L embedded random tokens and returns its inputs."""
    generator = torch.Generator().manual_seed(0)
    token_ids = torch.randint(0, model.config.vocab_size, (length,), generator=generator)  # [L]
    positions = torch.arange(length)  # [L]
    cos, sin = model.rotary.for_positions(positions)
    layer = model.model.layers[layer_id]
    x = layer.input_layernorm(model.model.embed_tokens(token_ids))  # [L, hidden]
    capture = CaptureBackend()
    layer.self_attn(x, cos, sin, capture, layer_id, None)
    return {**capture.tensors, "positions": positions}


def cache_rounded(inputs: dict[str, torch.Tensor], storage: torch.dtype) -> dict[str, torch.Tensor]:
    """Keys rounded to the KV cache's dtype, as attention reads them back from the cache."""
    keys = {name: inputs[name].to(storage).to(inputs[name].dtype) for name in ("latent", "index_k")}
    return {**inputs, **keys}


def timed(fn) -> tuple[float, object]:
    start = time.perf_counter()
    value = fn()
    return time.perf_counter() - start, value


@torch.inference_mode()
def measure_length(inputs: dict[str, torch.Tensor], topk: int, repeats: int) -> dict:
    """Median sparse (indexer + gathered attention) and dense times for one length; one untimed warm-up."""
    from model_workers.kernels.torch.dense_mla import dense_causal_mla_attention
    from model_workers.kernels.torch.sparse_mla import sparse_mla_attention
    from model_workers.kernels.torch.topk import causal_topk

    t = inputs
    scale = float(t["scale"])

    def select():
        return causal_topk(t["index_q"], t["index_w"], t["index_k"], t["positions"], topk)  # [L, k]

    def sparse(ids):
        return sparse_mla_attention(t["q_latent"], t["q_pe"], t["latent"], ids, scale)  # [L, H, C]

    def dense():
        return dense_causal_mla_attention(t["q_latent"], t["q_pe"], t["latent"], t["positions"], scale)

    sparse(select()), dense()  # warm-up
    indexer_s, attention_s, dense_s = [], [], []
    for _ in range(repeats):
        seconds, ids = timed(select)
        indexer_s.append(seconds)
        attention_s.append(timed(lambda: sparse(ids))[0])
        dense_s.append(timed(dense)[0])
    sparse_s = statistics.median(a + b for a, b in zip(indexer_s, attention_s))
    dense_median = statistics.median(dense_s)
    return {
        "length": int(t["positions"].shape[0]), "sparse_s": sparse_s,
        "sparse_indexer_s": statistics.median(indexer_s), "sparse_attention_s": statistics.median(attention_s),
        "dense_s": dense_median, "dense_over_sparse": dense_median / sparse_s,
    }


def crossover_length(runs: list[dict]) -> int | None:
    """Smallest measured L from which sparse_s < dense_s holds for every larger measured L; None if never."""
    crossover = None
    for run in sorted(runs, key=lambda r: r["length"], reverse=True):
        if run["sparse_s"] >= run["dense_s"]:
            break
        crossover = run["length"]
    return crossover


def validate(args: argparse.Namespace) -> list[int]:
    lengths = int_list(args.lengths, "--lengths", 1, 1 << 20)
    for flag, value in [("--threads", args.threads), ("--repeats", args.repeats)]:
        if value < 1:
            raise ValueError(f"{flag} must be >= 1, got {value}")
    return sorted(set(lengths))


def run_attention(args: argparse.Namespace) -> int:
    from cluster.bench.plot import save_plot
    from cluster.bench.render import require_matplotlib
    from model_workers.checkpoint.loader import load_model
    from model_workers.checkpoint.model_dir import resolve_model_dir

    lengths = validate(args)
    if args.plot:
        require_matplotlib()  # fail before the measurement, not after it
    model_dir = resolve_model_dir(args.model)
    previous_threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        storage = storage_dtype(args.dtype)
        model = load_model(model_dir, compute_dtype(storage, "cpu"), progress=False)  # as a CPU worker does
        layer_id, topk = first_indexer_layer(model), model.config.index_topk
        runs = [measure_length(cache_rounded(layer_inputs(model, layer_id, n), storage), topk, args.repeats)
                for n in lengths]
    finally:
        torch.set_num_threads(previous_threads)
    crossover = crossover_length(runs)
    result = {
        "bench": "attention", "command": spelled_command("attention", args, ATTENTION_FLAGS), "model": str(model_dir),
        "model_fingerprint": model_fingerprint(model_dir),
        "dtype": args.dtype, "compute_dtype": str(model.model.embed_tokens.weight.dtype).removeprefix("torch."),
        "device": "cpu", "index_topk": topk, "threads": args.threads, "repeats": args.repeats,
        "layer_id": layer_id, "inputs": INPUTS, "runs": runs, "crossover_length": crossover,
        "crossover_over_index_topk": crossover / topk if crossover is not None else None,
        "target": f"crossover_length <= {TARGET_TOPK_MULTIPLE} * index_topk",
    }
    if args.plot:
        save_plot(result, args.plot)
    print_result(json.dumps(result) if args.json else summary(result))
    return 0


def summary(result: dict) -> str:
    lines = [f"{'L':>7} {'sparse_s':>10} {'indexer':>8} {'dense_s':>10} {'dense/sparse':>12}"]
    for run in result["runs"]:
        share = run["sparse_indexer_s"] / run["sparse_s"] if run["sparse_s"] else 0.0
        lines.append(f"{run['length']:>7} {run['sparse_s']:>10.5f} {share:>8.0%} {run['dense_s']:>10.5f}"
                     f" {run['dense_over_sparse']:>12.2f}")
    ratio = result["crossover_over_index_topk"]
    where = f"L={result['crossover_length']} ({ratio:g} x index_topk)" if ratio is not None else "none measured"
    lines.append(f"index_topk={result['index_topk']}: sparse faster from {where}")
    return "\n".join(lines)
