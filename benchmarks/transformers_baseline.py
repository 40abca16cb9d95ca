"""The `transformers` baseline of `dsa-serve bench serve`: batched greedy `generate` on the same checkpoint.

The prompts of one concurrency level are cut into batches of `concurrency` prompts, left-padded, and each
batch runs `generate(do_sample=False, max_new_tokens=M, min_new_tokens=M)`, so every sequence produces exactly
M tokens as the served requests do. On CPU torch gets as many threads as the server's rank workers use,
and a bf16 run is also measured in float32 (the faster of the two is the baseline, see `baseline_dtypes`).
Any failure (transformers missing, a checkpoint it cannot load) is reported as skipped with the reason.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch


def load_model(model_dir: Path, dtype: str, device: str):
    import transformers
    from transformers import AutoModelForCausalLM

    transformers.logging.set_verbosity_error()  # e.g. the MTP layer's weights, which transformers does not use
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype))
    return model.to(device).eval()


def left_padded(prompts: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(p) for p in prompts)
    ids = [[pad_id] * (width - len(p)) + list(p) for p in prompts]
    mask = [[0] * (width - len(p)) + [1] * len(p) for p in prompts]
    return torch.tensor(ids), torch.tensor(mask)


def generate_batch(model, prompts: list[list[int]], max_tokens: int, device: str) -> int:
    """Generated tokens of one batch."""
    pad_id = model.config.pad_token_id
    pad_id = pad_id if pad_id is not None else 0
    ids, mask = left_padded(prompts, pad_id)
    with torch.inference_mode():
        out = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), do_sample=False,
                             max_new_tokens=max_tokens, min_new_tokens=max_tokens, pad_token_id=pad_id)
    return (out.shape[1] - ids.shape[1]) * len(prompts)


def measure_level(model, prompts: list[list[int]], concurrency: int, max_tokens: int, device: str) -> dict:
    start, tokens = time.perf_counter(), 0
    for first in range(0, len(prompts), concurrency):
        tokens += generate_batch(model, prompts[first:first + concurrency], max_tokens, device)
    if device == "cuda":
        torch.cuda.synchronize()
    wall_s = time.perf_counter() - start
    return {"num_requests": len(prompts), "batch_size": concurrency, "output_tokens": tokens, "wall_s": wall_s,
            "output_tokens_per_s": tokens / wall_s, "requests_per_s": len(prompts) / wall_s}


def run_baseline(model_dir: Path, level_prompts: dict[int, list[list[int]]], max_tokens: int, dtype: str,
                 device: str, threads: int) -> dict:
    """{"levels": {concurrency: measurement}, "threads": ...}, or {"skipped": True, "reason": ...}."""
    previous_threads = torch.get_num_threads()
    try:
        import transformers
    except ImportError as exc:
        return {"skipped": True, "reason": f"transformers is not importable: {exc}"}
    try:
        torch.set_num_threads(threads)
        by_dtype = {d: measure_dtype(model_dir, d, level_prompts, max_tokens, device) for d in baseline_dtypes(dtype, device)}
    except Exception as exc:  # noqa: BLE001 - the baseline is optional: report why it did not run
        return {"skipped": True, "reason": f"transformers baseline failed: {exc!r}"}
    finally:
        torch.set_num_threads(previous_threads)
    levels = {c: max((dict(runs[c], dtype=d) for d, runs in by_dtype.items()), key=lambda r: r["output_tokens_per_s"])
              for c in level_prompts}
    return {"skipped": False, "transformers_version": transformers.__version__, "threads": threads,
            "dtypes_tried": list(by_dtype), "levels": levels}


def baseline_dtypes(dtype: str, device: str) -> list[str]:
    """The served dtype, plus float32 for bf16 on a CPU: transformers computes bf16 there with emulated
    matmuls, and a user would pick whichever is faster; the faster of the two is the baseline."""
    return [dtype, "float32"] if dtype == "bfloat16" and device == "cpu" else [dtype]


def measure_dtype(model_dir: Path, dtype: str, level_prompts: dict[int, list[list[int]]], max_tokens: int,
                  device: str) -> dict[int, dict]:
    model = load_model(model_dir, dtype, device)
    generate_batch(model, next(iter(level_prompts.values()))[:1], 2, device)  # warm-up
    return {c: measure_level(model, prompts, c, max_tokens, device) for c, prompts in level_prompts.items()}
