"""Model-level throughput: decode tokens/s at each batch size and a long prefill's tokens/s, on the torch kernel set
and the Triton set, the latter eager and replayed from CUDA graphs (ModelRunner graph_shape), for the embedded
default model and a random 2-layer model of DeepSeek-V3.2's layer shapes.

Every request's context is filled once, by a prefill through the Triton runner, and its KV rows are copied into the
torch runner's cache (same pages, same formats: the FP8 writers are bit-identical), so the slow torch prefill of
32 long contexts is not paid; decode steps then run on both with the same tokens at the same positions, and the
hidden states of the first batch's steps are compared (informational: the paths round differently in bf16). A
step is timed from a device sync to the next, host work included (what a server sees)."""

from __future__ import annotations

import statistics
import time

import torch

from cp_router.pages import pages_for
from gpu_check.measure import DRY_LABEL, compare
from gpu_check.runtime import STICKY_ERRORS
from model_workers.kernels.registry import kernel_set
from model_workers.runner import ExtendItem, ModelRunner

NO_GRAPHS = "skipped: CUDA graphs need a CUDA device (a dry run replays nothing)"


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def token(step: int, row: int, vocab: int) -> int:
    return (7919 * step + 104729 * row + 11) % (vocab - 2) + 1


def copy_cache(src, dst) -> None:
    """The stored rows of src's slots into dst (a runner with graphs keeps one more, scratch, page at the end)."""
    for a, b in zip(src.latent + src.index_keys, dst.latent + dst.index_keys):
        if a is not None and b is not None:
            n = min(a.shape[0], b.shape[0])
            b[:n].copy_(a[:n])


def time_decode(step, tables, mp, vocab: int, device) -> tuple[dict, torch.Tensor, list[int]]:
    """mp.warmup_steps + mp.timed_steps plain decode steps of every table's request -> (step times and tokens/s,
    the first step's hidden states [B, D] in float32, the positions that step wrote)."""
    times, first, positions = [], None, [table.num_tokens for table in tables]
    for i in range(mp.warmup_steps + mp.timed_steps):
        items = [ExtendItem(table, [token(table.num_tokens, row, vocab)]) for row, table in enumerate(tables)]
        sync(device)
        started = time.perf_counter()
        hidden = step(items)
        sync(device)
        if i >= mp.warmup_steps:
            times.append(time.perf_counter() - started)
        if first is None:
            first = hidden.float().clone()
    median = statistics.median(times)
    out = {"step_ms": median * 1e3, "min_step_ms": min(times) * 1e3, "tokens_per_s": len(tables) / median,
           "timed_steps": len(times), "context_at_end": tables[0].num_tokens}
    return out, first, positions


def time_prefill(runner, table, prompt: list[int], reps: int, device) -> dict:
    times = []
    for _ in range(reps):
        table.num_tokens = 0
        sync(device)
        started = time.perf_counter()
        runner.extend([ExtendItem(table, prompt)])
        sync(device)
        times.append(time.perf_counter() - started)
    median = statistics.median(times)
    return {"ms": median * 1e3, "tokens_per_s": len(prompt) / median, "tokens": len(prompt), "reps": reps}


def attempt(fn, left, errors: list, need_s: float = 5.0):
    """fn()'s result, or a line saying why not: the section's deadline, or fn's exception (also added to errors)."""
    if left() < need_s:
        return "skipped: the section's deadline"
    try:
        return fn()
    except Exception as exc:  # one measurement lost, not the model's others (unless the device is lost)
        line = f"error: {type(exc).__name__}: {exc}"[:1000]
        if any(sticky in line.lower() for sticky in STICKY_ERRORS):
            raise
        errors.append(line)
        return line


def triton_runner(model, pages: int, mp, device, shape: tuple[int, int], record: dict) -> ModelRunner:
    """The Triton set's runner, capturing decode graphs on CUDA; eager only when the capture fails (recorded)."""
    kernels = kernel_set("triton", device.type)
    if device.type != "cuda":
        record["graphs"] = NO_GRAPHS
        return ModelRunner(model, pages, mp.page_size, device, kernels=kernels)
    started = time.perf_counter()
    try:
        runner = ModelRunner(model, pages, mp.page_size, device, kernels=kernels, graph_shape=shape)
        sync(device)
    except Exception as exc:
        record["graphs"] = f"error: the capture failed, triton runs eagerly only: {type(exc).__name__}: {exc}"[:1000]
        record["errors"].append(record["graphs"])
        torch.cuda.synchronize()
        return ModelRunner(model, pages, mp.page_size, device, kernels=kernels)
    captured = runner.decode_graphs is not None
    record["graphs"] = {"captured": captured, "buckets": list(runner.decode_graphs.buckets) if captured else [],
                        "max_context": shape[1], "runner_build_with_capture_s": time.perf_counter() - started}
    return runner


def build_runners(model, mp, device, record: dict):
    """(triton runner, torch runner, their tables): contexts filled on the Triton runner and copied."""
    batch = max(mp.batches)
    room = mp.context + 2 * len(mp.batches) * (mp.warmup_steps + mp.timed_steps) + 1
    lens = [room] * batch + [mp.prefill_len]
    pages = sum(pages_for(n, mp.page_size) for n in lens)
    tri = triton_runner(model, pages, mp, device, (batch, room), record)
    tor = ModelRunner(model, pages, mp.page_size, device, kernels=kernel_set("torch", device.type))
    tri_tables, tor_tables = tri.standalone_tables(lens), tor.standalone_tables(lens)
    vocab = model.config.vocab_size
    started = time.perf_counter()
    for first in range(0, batch, mp.prefill_group):
        group = range(first, min(first + mp.prefill_group, batch))
        tri.extend([ExtendItem(tri_tables[b], [token(i, b, vocab) for i in range(mp.context)]) for b in group])
    copy_cache(tri.cache, tor.cache)
    for table in tor_tables[:batch]:
        table.num_tokens = mp.context
    sync(device)
    record["contexts"] = {"requests": batch, "tokens_each": mp.context, "filled_by": "triton prefill, copied to torch",
                          "fill_s": time.perf_counter() - started}
    return tri, tor, tri_tables, tor_tables


def decode_batch(tri, tor, tri_tables, tor_tables, mp, device, vocab: int, left, errors: list) -> dict:
    """Torch, triton eager and triton from graphs on the same batch; the first steps' hidden states compared."""
    entry: dict = {}
    ours = attempt(lambda: time_decode(tor.decode, tor_tables, mp, vocab, device), left, errors)
    theirs = attempt(lambda: time_decode(lambda items: tri.extend(items, is_extend=False), tri_tables, mp, vocab,
                                         device), left, errors)
    entry["torch"] = ours[0] if isinstance(ours, tuple) else ours
    entry["triton"] = theirs[0] if isinstance(theirs, tuple) else theirs
    if isinstance(ours, tuple) and isinstance(theirs, tuple):
        same = [row for row in range(len(tri_tables)) if ours[2][row] == theirs[2][row]]  # same position and token
        diff = compare(theirs[1][same], ours[1][same], 0.0)  # informational: the bf16 paths round differently
        entry["hidden_vs_torch"] = {"rows": len(same), **{k: v for k, v in diff.items() if k not in ("tol", "passed")}}
    if device.type != "cuda":
        entry["triton_graphs"] = NO_GRAPHS
    elif tri.decode_graphs is None:
        entry["triton_graphs"] = "skipped: no decode graphs were captured (see graphs)"
    else:
        replayed = attempt(lambda: time_decode(tri.decode, tri_tables, mp, vocab, device), left, errors)
        entry["triton_graphs"] = replayed[0] if isinstance(replayed, tuple) else replayed
    for name in ("triton", "triton_graphs"):
        if isinstance(entry[name], dict) and isinstance(entry["torch"], dict):
            entry[f"speedup_{name}_vs_torch"] = entry[name]["tokens_per_s"] / entry["torch"]["tokens_per_s"]
    return entry


def measure_model(model, mp, device, left) -> dict:
    """The record of one model; `left()`: seconds left for this section (the rest is skipped when it runs out)."""
    config = model.config
    record: dict = {"model": mp.name, "layers": config.num_hidden_layers, "heads": config.num_attention_heads,
                    "hidden": config.hidden_size, "routed_experts": config.n_routed_experts,
                    "dtype": str(model.model.embed_tokens.weight.dtype), "errors": []}
    errors = record["errors"]
    tri, tor, tri_tables, tor_tables = build_runners(model, mp, device, record)
    vocab = config.vocab_size
    record["decode"] = {f"b{batch}": decode_batch(tri, tor, tri_tables[:batch], tor_tables[:batch], mp, device, vocab,
                                                  left, errors) for batch in mp.batches}
    prompt = [token(i, 999, vocab) for i in range(mp.prefill_len)]
    prefill = record["prefill"] = {"tokens": mp.prefill_len}
    for name, runner, table in (("triton", tri, tri_tables[-1]), ("torch", tor, tor_tables[-1])):
        prefill[name] = attempt(lambda: time_prefill(runner, table, prompt, mp.prefill_reps, device), left, errors)
    if isinstance(prefill["triton"], dict) and isinstance(prefill["torch"], dict):
        prefill["speedup_triton_vs_torch"] = prefill["triton"]["tokens_per_s"] / prefill["torch"]["tokens_per_s"]
    if device.type != "cuda":
        record["note"] = DRY_LABEL
    record["passed"] = not errors
    return record
