"""`ModelFamily`: everything the rest of the project needs of a model family, as one record (registry.py).

A family's folder builds its record in its `__init__.py` from its own modules; the loader, the runner, the CP
prefill, the capacity plan and the engine's checks call these fields and never test which family they hold
(docs/models.md, 'What a family provides'). Argument names below are the calls' own:

* config: the frozen record `parse_config` made of config.json (generation_config.json's EOS ids merged in).
* tables: per request its `PageTable` (model_workers/page_table.py); lengths: its new tokens this forward.
* kernels: a `KernelSet` (model_workers/kernels/); experts: where a MoE layer's routed experts run (this process's
  expert loop, or the expert-parallel exchange), an object with `combine(x, expert_ids, weights, experts)`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

CheckpointEntries = dict[str, tuple[Path, str]]  # our tensor name -> (safetensors file, the name stored there)


@dataclass(frozen=True)
class ModelFamily:
    name: str  # the folder's name: "dsa", "deepseek_v4"
    title: str  # for people: "DeepSeek-V3.2 / GLM-5"
    model_types: tuple[str, ...]  # the config.json model_type values it serves
    parse_config: Callable[[dict], Any]  # raw config.json -> frozen config (ModelConfigError naming the field)
    # (config, checkpoint's stored tensor names, routed experts held or None = all) -> (model built on the current
    # default device, e.g. meta before loading; config with its MTP layer count set from the checkpoint)
    build_model: Callable[[Any, set[str], range | None], tuple[Any, Any]]
    checkpoint_entries: Callable[[Any, dict[str, Path]], CheckpointEntries]  # stored name -> file, as our names
    fp32_param_suffixes: tuple[str, ...]  # parameters loaded in float32 whatever the compute dtype
    # (config, num_mtp_layers, num_pages, page_size, weights dtype, kv_cache_dtype, kernels, device) -> cache
    make_cache: Callable[..., Any]
    make_backend: Callable[..., Any]  # (cache, kernels, experts, deterministic) -> the family's backend
    local_batch: Callable[..., Any]  # (cache, tables, lengths, page_size, device): rows = the stream, one rank
    cp_batch: Callable[..., Any]  # (cache, tables, RankMetadata, page_size, device): this CP rank's logical rows
    kv_cache_dtypes: tuple[str, ...]  # the --kv-cache-dtype values its cache can hold
    batch_invariant: bool  # --enable-deterministic-inference is built (and tested) for it
    # capacity (`dsa-serve plan`, KV sizing): every checkpoint tensor with its class, expert and stored bytes;
    checkpoint_tensors: Callable[[dict, Any], list]  # (raw config.json, config) -> [CheckpointTensor]
    plan_kv_dtypes: tuple[str, ...]  # KV dtypes a plan can count (auto counts as bfloat16)
    cache_bytes_per_token: Callable[[Any, str], float]  # (config, plan kv dtype): KV bytes a token costs its owner
    gather_bytes_per_token: Callable[[Any, str], float]  # (config, kv dtype): bytes CP prefill gathers per token
    kv_plan: Callable[..., dict]  # (config, plan kv dtype, weight bytes, device GiB or None) -> the plan's KV part
    kv_summary: Callable[[dict], str]  # (the plan) -> its KV part as one line of text (`dsa-serve plan`)
    kv_formulas: Callable[[str], dict]  # (kv dtype) -> the gather and per-token byte formulas as text (benchmarks)
    # the batch type a decode step captured in a CUDA graph runs (model_workers/decode_graphs.py), built from static
    # tensors (positions, request_rows, key_slots, write_slots); None: its decode is not graph-safe yet
    graph_batch: Callable[..., Any] | None = None
    # (config, length, logit_rows, mtp_sparse) -> model FLOPs of one prefill by part and phase; None: not counted
    prefill_flops: Callable[..., dict] | None = None
    random_checkpoint: Callable[..., Path] | None = None  # (out, shape, seed, dtype): `dsa-serve random-checkpoint`
    random_shapes: tuple[str, ...] = ()  # the named shapes `random_checkpoint` writes
    # prefix caching (cp_router/prefix_cache.py): (config, page_size) -> (a hit ends at a multiple of this, whether
    # the ranks must snapshot bounded per-request state there); None: any page boundary, nothing to snapshot
    prefix_hit_rule: Callable[[Any, int], tuple[int, bool]] | None = None

    def prefix_hits(self, config, page_size: int) -> tuple[int, bool]:
        return (page_size, False) if self.prefix_hit_rule is None else self.prefix_hit_rule(config, page_size)
