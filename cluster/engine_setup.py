"""A `GenerationEngine` built over rank workers from an engine spec (cluster/engine_spec.py), and whole results
collected (CLI, tests, benchmarks). No Ray here: an engine over Ray actors is cluster/ray_engine.py's, and a C = 1
engine runs its rank in this process (`start_local_engine`), so `dsa-serve generate` runs where Ray is missing.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from cluster.config import ResolvedCPConfig
from cluster.engine_spec import LOCAL_CP, EngineOptions, EngineSpec, resolve_engine_spec, scheduler_for
from cluster.local_worker import InProcessWorker
from cp_router.engine import GenerationEngine
from cp_router.metrics import ServeMetrics
from cp_router.protocol import EngineRequest, ModelInfo
from cp_router.recovery import GroupRepair
from model_workers.checkpoint.tokenizer import CheckpointText, load_checkpoint_text
from model_workers.spec import ModelSpec


def engine_over_workers(spec: EngineSpec, workers: list, metrics: ServeMetrics | None = None,
                        text: CheckpointText | None = None, repair: GroupRepair | None = None) -> GenerationEngine:
    """A `GenerationEngine` over already launched rank workers (Ray actor handles, or one in-process worker).

    `text`: the checkpoint's tokenizer and chat template if the caller loaded them (else they are read here).
    `repair`: how lost ranks are replaced (cluster/rank_repair.py); None: a lost rank ends every request."""
    model = spec.model
    text = text or load_checkpoint_text(model.path, model_type=model.config.model_type)
    info = ModelInfo(model.name, model.config.vocab_size, spec.max_model_len, text.chat_template is not None)
    return GenerationEngine(workers, scheduler_for(spec.cp, spec.options, spec.model), text.tokenizer, info, metrics,
                            max_waiting=spec.options.max_queued_requests, repair=repair)


def start_local_engine(model: ModelSpec | str | Path | None, options: EngineOptions,
                       metrics: ServeMetrics | None = None, cp: ResolvedCPConfig = LOCAL_CP) -> GenerationEngine:
    """A C = 1 engine in this process (no Ray): the CLI without --cp-size (or with --cp-size 1), tests, benchmarks."""
    if cp.cp_size != 1:
        raise ValueError(f"an engine in this process has one rank; cp_size={cp.cp_size} needs Ray (ray_engine.py)")
    spec = resolve_engine_spec(model, cp, options)
    return engine_over_workers(spec, [InProcessWorker(spec.rank)], metrics)


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
