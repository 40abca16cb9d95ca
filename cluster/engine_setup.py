"""Building a `GenerationEngine` over rank workers, and collecting whole results (CLI, tests, benchmarks)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, replace
from pathlib import Path

from cluster.config import ResolvedCPConfig, check_speculative_steps
from cluster.engine_limits import EngineLimits, kv_room, prefill_chunk_tokens, resolve_limits
from cluster.launch import CPGroup, launch_group
from cluster.local_worker import InProcessWorker
from cluster.rank_repair import RayRankRepair
from cp_router.cp.strategies import cp_alignment
from cp_router.engine import GenerationEngine
from cp_router.metrics import ServeMetrics
from cp_router.protocol import EngineRequest, ModelInfo
from cp_router.recovery import GroupRepair
from cp_router.scheduler import Scheduler, SchedulerConfig
from model_workers.checkpoint.capacity import cache_bytes_per_token
from model_workers.checkpoint.draft_vocab import check_token_map_setting
from model_workers.checkpoint.tokenizer import CheckpointText, load_checkpoint_text
from model_workers.kv_format import check_kv_cache_dtype
from model_workers.model.config import load_model_config
from model_workers.precision import resolve_dtype_name


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
    kv_cache_dtype: str = "auto"  # auto (keys in `dtype`), bfloat16, fp8_e4m3 (kv_format.py)
    max_model_len: int | None = None  # None: the model's window capped by one rank's KV room (`kv_room`)
    max_num_seqs: int = 256  # requests running at once
    cp_min_prefill_tokens: int = 0  # a smaller step of new prompts: each on its owner, no CP (0: CP whenever it splits)
    max_queued_requests: int = 4096  # waiting requests before new ones get EngineOverloadedError (503)
    deterministic: bool = False  # --enable-deterministic-inference: batch-invariant ranks (batch_invariant.py)
    speculative_token_map: str = "auto"  # the draft head's vocabulary: auto, none or a file (draft_vocab.py)
    time_prefill_phases: bool = False  # ranks time prefill steps by phase (`bench prefill`; ~2 ms a step)

    def __post_init__(self):
        check_speculative_steps(self.num_speculative_steps)
        check_kv_cache_dtype(self.kv_cache_dtype, model_type="")
        check_token_map_setting(self.speculative_token_map)
        if self.max_steps_per_call < 1:
            raise ValueError(f"max_steps_per_call must be >= 1, got {self.max_steps_per_call}")


DETERMINISTIC_MODEL_TYPES = ("deepseek_v32", "glm_moe_dsa")  # what --enable-deterministic-inference is tested on
LOCAL_CP = ResolvedCPConfig(enabled=False, cp_size=1, strategy=None, impl="legacy")


def scheduler_for(cp: ResolvedCPConfig, options: EngineOptions) -> Scheduler:
    if cp.cp_size > 1 and not cp.enabled:
        raise ValueError(f"cp_size={cp.cp_size} needs prefill CP enabled")
    strategy = cp.strategy or "zigzag"
    align = cp_alignment(strategy, cp.cp_size)
    budget = prefill_chunk_tokens(options.prefill_token_budget, cp.cp_size)
    if budget < 2 * align:
        raise ValueError(f"prefill_token_budget (--max-num-batched-tokens) must be >= {2 * align} (twice the CP "
                         f"alignment), got {budget}")
    return Scheduler(SchedulerConfig(
        cp.cp_size, options.num_pages, options.page_size, budget, strategy, cp.impl,
        options.num_speculative_steps, options.max_steps_per_call, options.return_logits, cp.expert_parallel,
        options.max_num_seqs, options.cp_min_prefill_tokens, options.time_prefill_phases,
    ))


def effective_max_model_len(model_window: int, options: EngineOptions) -> int:
    """What the ingress admits (prompt + max_tokens): `options.max_model_len` (checked by `resolve_limits`), else
    the model's window capped by what one request can hold in a rank's KV pages."""
    room = kv_room(options.num_pages, options.page_size, options.num_speculative_steps)
    return min(options.max_model_len or model_window, model_window, room)


def limit_options(model_dir, limits: EngineLimits, dtype: str, kv_cache_dtype: str, num_speculative_steps: int) -> dict:
    """The EngineOptions fields `limits` set, resolved against the model (its window, its KV bytes per token)."""
    config = load_model_config(model_dir)
    kv_name = resolve_dtype_name(dtype, model_dir) if kv_cache_dtype == "auto" else kv_cache_dtype
    resolved = resolve_limits(limits, config.max_position_embeddings, cache_bytes_per_token(config, kv_name),
                              num_speculative_steps)
    return dict(num_pages=resolved.num_pages, page_size=resolved.page_size, max_model_len=resolved.max_model_len,
                prefill_token_budget=limits.max_num_batched_tokens, max_num_seqs=limits.max_num_seqs,
                max_queued_requests=limits.max_queued_requests, cp_min_prefill_tokens=limits.cp_min_prefill_tokens)


def check_options_for_model(model_dir, cp: ResolvedCPConfig, options: EngineOptions) -> EngineOptions:
    """The options against the scheduler's rules and the model (e.g. a KV format it cannot use), before launch;
    returns them with `dtype` "auto" resolved against the checkpoint."""
    scheduler_for(cp, options)
    model_type = load_model_config(model_dir).model_type
    check_kv_cache_dtype(options.kv_cache_dtype, model_type)
    if options.deterministic and model_type not in DETERMINISTIC_MODEL_TYPES:
        raise ValueError(f"--enable-deterministic-inference is built for {', '.join(DETERMINISTIC_MODEL_TYPES)}; "
                         f"{model_type} is not batch-invariant yet (its compressed attention pools data-dependent "
                         "shapes); serve it without the flag")
    device = "cuda" if options.use_gpu else "cpu"
    return replace(options, dtype=resolve_dtype_name(options.dtype, model_dir, device))


def engine_over_workers(model_dir, cp: ResolvedCPConfig, options: EngineOptions, workers: list,
                        metrics: ServeMetrics | None = None, text: CheckpointText | None = None,
                        repair: GroupRepair | None = None) -> GenerationEngine:
    """A `GenerationEngine` over already launched rank workers (Ray actor handles, or one in-process worker).

    `text`: the checkpoint's tokenizer and chat template if the caller loaded them (else they are read here).
    `repair`: how lost ranks are replaced (cluster/rank_repair.py); None: a lost rank ends every request."""
    config = load_model_config(model_dir)
    text = text or load_checkpoint_text(model_dir)
    info = ModelInfo(Path(model_dir).name, config.vocab_size,
                     effective_max_model_len(config.max_position_embeddings, options), text.chat_template is not None)
    return GenerationEngine(workers, scheduler_for(cp, options), text.tokenizer, info, metrics,
                            max_waiting=options.max_queued_requests, repair=repair)


def start_engine(model_dir: str | Path, cp: ResolvedCPConfig, options: EngineOptions,
                 metrics: ServeMetrics | None = None) -> tuple[GenerationEngine, CPGroup]:
    """Launches the CP group (Ray must be running) and the engine over it; shut down the group when done."""
    options = check_options_for_model(model_dir, cp, options)  # bad options fail before any actor starts
    group = launch_group(model_dir, cp, options.dtype, options.num_pages, options.page_size,
                         threads_per_worker=options.threads_per_worker, use_gpu=options.use_gpu,
                         kv_cache_dtype=options.kv_cache_dtype, deterministic=options.deterministic,
                         speculative_token_map=options.speculative_token_map)
    return engine_over_workers(model_dir, cp, options, group.workers, metrics, repair=RayRankRepair(group.launch)), group


def start_local_engine(model_dir: str | Path, options: EngineOptions,
                       metrics: ServeMetrics | None = None) -> GenerationEngine:
    """A C = 1 engine in this process (no Ray): the CLI without --cp-size, tests, benchmarks."""
    options = check_options_for_model(model_dir, LOCAL_CP, options)
    worker = InProcessWorker(model_dir, options.dtype, options.num_pages, options.page_size, options.kv_cache_dtype,
                             options.deterministic, options.speculative_token_map)
    return engine_over_workers(model_dir, LOCAL_CP, options, [worker], metrics)


async def collect(engine: GenerationEngine, request: EngineRequest) -> dict:
    """The whole result of one request."""
    tokens, text, logprobs, finish = [], "", [], None
    async for chunk in engine.generate(request):
        tokens += chunk.token_ids
        text += chunk.text
        logprobs += chunk.logprobs or ()
        finish = chunk.finish_reason
    result = {"token_ids": tokens, "text": text, "finish_reason": finish, "prompt_tokens": len(request.prompt_token_ids)}
    if request.logprobs is not None:
        result["logprobs"] = [lp.logprob for lp in logprobs]
    return result


def run_all(engine: GenerationEngine, requests: list[EngineRequest]) -> list[dict]:
    """All requests concurrently (blocking), results in request order."""
    async def main():
        return await asyncio.gather(*[collect(engine, r) for r in requests])

    return asyncio.run(main())
