"""The engine spec: what an engine runs with, resolved once at the edge (docs/architecture.md, 'The engine spec').

The CLI and the Serve YAML give `EngineOptions` and CP settings; `resolve_engine_spec` reads the model folder once
(or takes the `ModelSpec` the caller read), checks everything against the model (its family's KV formats and
whether it is batch-invariant, the scheduler's rules, the kernel set's name), resolves `--dtype auto`, and returns
one frozen `EngineSpec`. Everything downstream takes it: the engine (cluster/engine_setup.py), the Ray launch of
its ranks (cluster/launch.py, which sends each rank its `RankSpec`), a Serve replica (cluster/replica_engine.py).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from cluster.config import ResolvedCPConfig, check_speculative_steps
from cluster.engine_limits import EngineLimits, kv_room, prefill_chunk_tokens, resolve_limits
from cp_router.cp.strategies import cp_alignment
from cp_router.scheduler import Scheduler, SchedulerConfig
from model_workers.checkpoint.capacity import cache_bytes_per_token
from model_workers.checkpoint.draft_vocab import check_token_map_setting
from model_workers.checkpoint.model_dir import as_model_spec
from model_workers.kernels.registry import ATTENTION_BACKENDS, DEFAULT_ATTENTION_BACKEND, resolve_backend
from model_workers.kv_format import check_kv_cache_dtype
from model_workers.models.registry import FAMILIES
from model_workers.precision import resolve_dtype_name
from model_workers.spec import ModelSpec, RankSpec


@dataclass(frozen=True)
class EngineOptions:
    dtype: str = "float32"
    num_pages: int = 256  # per rank
    page_size: int = 64
    num_speculative_steps: int = 0
    prefill_token_budget: int | None = None  # the prefill chunk, tokens of one prefill batch (None: 2048 per rank)
    max_steps_per_call: int = 4
    use_gpu: bool | None = None
    threads_per_worker: int = 1
    return_logits: bool = False  # ranks ship full-vocabulary logits in every output (tests, debugging)
    kv_cache_dtype: str = "auto"  # auto (keys in `dtype`), bfloat16, fp8_e4m3 (model_workers/kv_format.py)
    max_model_len: int | None = None  # None: the model's window capped by one rank's KV room (`kv_room`)
    max_num_seqs: int = 256  # requests running at once
    cp_min_prefill_tokens: int = 0  # a smaller step of new prompts: each on its owner, no CP (0: CP whenever it splits)
    max_queued_requests: int = 4096  # waiting requests before new ones get EngineOverloadedError (503)
    deterministic: bool = False  # --enable-deterministic-inference: batch-invariant ranks
    speculative_token_map: str = "auto"  # the draft head's vocabulary: auto, none or a file (draft_vocab.py)
    time_prefill_phases: bool = False  # ranks time prefill steps by phase (`bench prefill`; ~2 ms a step)
    attention_backend: str = DEFAULT_ATTENTION_BACKEND  # the ranks' kernel set (model_workers/kernels/registry.py)
    disable_cuda_graph: bool = False  # SGLang's flag: no decode step from a CUDA graph (model_workers/decode_graphs.py)
    enable_prefix_caching: bool = True  # reuse cached prompt prefixes (--disable-radix-cache turns it off)

    def __post_init__(self):
        check_speculative_steps(self.num_speculative_steps)
        check_kv_cache_dtype(self.kv_cache_dtype)
        check_token_map_setting(self.speculative_token_map)
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend must be one of {', '.join(ATTENTION_BACKENDS)}, "
                             f"got {self.attention_backend!r}")
        if self.max_steps_per_call < 1:
            raise ValueError(f"max_steps_per_call must be >= 1, got {self.max_steps_per_call}")


LOCAL_CP = ResolvedCPConfig(enabled=False, cp_size=1, strategy=None, impl="legacy")


@dataclass(frozen=True, eq=False)
class EngineSpec:
    """One engine, resolved once: the model read once, the CP / EP layout, and the options with `dtype` resolved."""

    model: ModelSpec
    cp: ResolvedCPConfig
    options: EngineOptions

    @property
    def rank(self) -> RankSpec:
        """What each of the group's ranks loads."""
        o = self.options
        graph_shape = None if o.disable_cuda_graph else (o.max_num_seqs, self.max_model_len)
        return RankSpec(self.model, o.dtype, o.num_pages, o.page_size, self.cp.ep_size, o.kv_cache_dtype,
                        o.deterministic, o.speculative_token_map, o.attention_backend, graph_shape)

    @property
    def max_model_len(self) -> int:
        return effective_max_model_len(self.model.config.max_position_embeddings, self.options)


def scheduler_for(cp: ResolvedCPConfig, options: EngineOptions, model: ModelSpec | None = None) -> Scheduler:
    """The engine's scheduler; `model` gives its family's prefix-cache hit rule (None: page boundaries)."""
    if cp.cp_size > 1 and not cp.enabled:
        raise ValueError(f"cp_size={cp.cp_size} needs prefill CP enabled")
    strategy = cp.strategy or "zigzag"
    align = cp_alignment(strategy, cp.cp_size)
    budget = prefill_chunk_tokens(options.prefill_token_budget, cp.cp_size)
    if budget < 2 * align:
        raise ValueError(f"prefill_token_budget (--max-num-batched-tokens) must be >= {2 * align} (twice the CP "
                         f"alignment), got {budget}")
    hit_align, snapshots = (options.page_size, False) if model is None else \
        model.family.prefix_hits(model.config, options.page_size)
    return Scheduler(SchedulerConfig(
        cp.cp_size, options.num_pages, options.page_size, budget, strategy, cp.impl,
        options.num_speculative_steps, options.max_steps_per_call, options.return_logits, cp.expert_parallel,
        options.max_num_seqs, options.cp_min_prefill_tokens, options.time_prefill_phases,
        options.enable_prefix_caching, hit_align, snapshots,
    ))


def effective_max_model_len(model_window: int, options: EngineOptions) -> int:
    """What the ingress admits (prompt + max_tokens): `options.max_model_len` (checked by `resolve_limits`), else
    the model's window capped by what one request can hold in a rank's KV pages."""
    room = kv_room(options.num_pages, options.page_size, options.num_speculative_steps)
    return min(options.max_model_len or model_window, model_window, room)


def limit_options(model: ModelSpec, limits: EngineLimits, dtype: str, kv_cache_dtype: str,
                  num_speculative_steps: int) -> dict:
    """The EngineOptions fields `limits` set, resolved against the model (its window, its KV bytes per token)."""
    kv_name = resolve_dtype_name(dtype, model) if kv_cache_dtype == "auto" else kv_cache_dtype
    resolved = resolve_limits(limits, model.config.max_position_embeddings, cache_bytes_per_token(model, kv_name),
                              num_speculative_steps)
    return dict(num_pages=resolved.num_pages, page_size=resolved.page_size, max_model_len=resolved.max_model_len,
                prefill_token_budget=limits.max_num_batched_tokens, max_num_seqs=limits.max_num_seqs,
                max_queued_requests=limits.max_queued_requests, cp_min_prefill_tokens=limits.cp_min_prefill_tokens)


def resolve_engine_spec(model: ModelSpec | str | Path | None, cp: ResolvedCPConfig,
                        options: EngineOptions) -> EngineSpec:
    """The options checked against the scheduler's rules and the model's family (a KV format its cache cannot
    hold, deterministic inference where it is not batch-invariant), `dtype` "auto" resolved: before any launch."""
    model = as_model_spec(model)
    scheduler_for(cp, options, model)
    family, model_type = model.family, model.config.model_type
    check_kv_cache_dtype(options.kv_cache_dtype, family.kv_cache_dtypes, model_type)
    if options.deterministic and not family.batch_invariant:
        built_for = [t for f in FAMILIES if f.batch_invariant for t in f.model_types]
        raise ValueError(f"--enable-deterministic-inference is built for {', '.join(built_for)}; {model_type} is not "
                         "batch-invariant yet (its compressed attention pools data-dependent shapes); serve it "
                         "without the flag")
    device = "cuda" if options.use_gpu else "cpu"
    resolve_backend(options.attention_backend, device, options.deterministic)  # a set that cannot run there fails here, not in a rank
    return EngineSpec(model, cp, replace(options, dtype=resolve_dtype_name(options.dtype, model, device)))
