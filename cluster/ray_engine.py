"""A CP engine on Ray: the group of rank actors launched from the engine spec, and the engine driving it here."""

from __future__ import annotations

from pathlib import Path

from cluster.config import ResolvedCPConfig
from cluster.engine_setup import engine_over_workers
from cluster.engine_spec import EngineOptions, resolve_engine_spec
from cluster.launch import CPGroup, launch_ranks
from cluster.rank_repair import RayRankRepair
from cp_router.engine import GenerationEngine
from cp_router.metrics import ServeMetrics
from model_workers.spec import ModelSpec


def start_engine(model: ModelSpec | str | Path | None, cp: ResolvedCPConfig, options: EngineOptions,
                 metrics: ServeMetrics | None = None) -> tuple[GenerationEngine, CPGroup]:
    """Launches the CP group (Ray must be running) and the engine over it; shut down the group when done. Bad
    options fail before any actor starts (`resolve_engine_spec`)."""
    spec = resolve_engine_spec(model, cp, options)
    group = launch_ranks(spec.rank, cp, threads_per_worker=options.threads_per_worker, use_gpu=options.use_gpu)
    return engine_over_workers(spec, group.workers, metrics, repair=RayRankRepair(group.launch)), group
