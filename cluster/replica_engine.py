"""The engine of one Serve replica (DSAEngine, or a colocated DSAServer): its engine spec resolved from the
ServeAppArgs (config.json read once in the replica's process), its placement bundles, and its CP group of rank
actors started in bundles 1..C of the replica's own placement group, with the engine driving them."""

from __future__ import annotations

from pathlib import Path

import ray

from cluster.config import resolve_cp_settings
from cluster.engine_limits import EngineLimits, limits_from
from cluster.engine_setup import engine_over_workers
from cluster.engine_spec import EngineOptions, EngineSpec, limit_options, resolve_engine_spec
from cluster.launch import RankLaunch, start_workers
from cluster.rank_repair import RayRankRepair
from cluster.ray_metrics import replica_metrics
from cluster.serve_settings import ServeAppArgs
from cp_router.engine import GenerationEngine
from model_workers.checkpoint.model_dir import as_model_spec, read_model_spec
from model_workers.checkpoint.tokenizer import CheckpointText, load_checkpoint_text
from model_workers.spec import ModelSpec

# Serve's own per-call log lines are off: the ingress logs one line per HTTP request (dsa_serve.access).
QUIET = {"enable_access_log": False}


class EngineReplica:
    """What every engine deployment (DSAEngine, DSAPrefill) answers the app's broadcasts with, from `self.engine`."""

    engine: object

    async def metrics_text(self) -> str:
        return await self.engine.metrics_text()

    async def flush_cache(self) -> int:
        return await self.engine.flush_cache()

    async def check_health(self) -> None:
        await self.engine.check_health()


def engine_bundles(args: ServeAppArgs) -> list[dict[str, float]]:
    """One bundle for the engine replica (and one unit of args.node_resource, when set), then one per CP rank worker."""
    rank = {"GPU": 1} if args.device == "cuda" else {"CPU": 1}
    replica = {"CPU": 1, **({args.node_resource: 1} if args.node_resource else {})}
    return [replica] + [dict(rank) for _ in range(args.cp_size)]


def engine_options(args: ServeAppArgs, model: ModelSpec | str | Path | None) -> EngineOptions:
    """The engine's options: the args' capacity fields resolved against the model (pages, window)."""
    model = as_model_spec(model)
    limits = limit_options(model, EngineLimits(**limits_from(args)), args.dtype, args.kv_cache_dtype,
                           args.speculative_num_steps)
    return EngineOptions(args.dtype, kv_cache_dtype=args.kv_cache_dtype,
                         num_speculative_steps=args.speculative_num_steps, use_gpu=args.device == "cuda",
                         deterministic=args.enable_deterministic_inference,
                         speculative_token_map=args.speculative_token_map, attention_backend=args.attention_backend,
                         disable_cuda_graph=args.disable_cuda_graph,
                         enable_prefix_caching=args.prefix_caching_enabled, **limits)


def serve_engine_spec(args: ServeAppArgs, model: ModelSpec | None = None) -> EngineSpec:
    """The engine spec of `args`: the model folder read once (or `model`, already read), the CP flags and the
    options resolved against it; every check of the flags against the model fails here, before any launch."""
    model = model or read_model_spec(args.model)
    return resolve_engine_spec(model, resolve_cp_settings(args, model), engine_options(args, model))


def start_replica_engine(spec: EngineSpec, deployment: str, args: ServeAppArgs,
                         text: CheckpointText) -> GenerationEngine:
    """The replica's CP group (rank actors in bundles 1..C of its placement group) and the engine over it."""
    group = ray.util.get_current_placement_group()
    if group is None:
        raise RuntimeError(f"{deployment} must run in a placement group of 1 + cp_size bundles "
                           "(placement_group_bundles); build the app with cluster.serve_app:app")
    options = spec.options
    launch = RankLaunch(spec.rank, spec.cp.cp_size, group, 1, options.threads_per_worker, bool(options.use_gpu))
    workers = start_workers(launch)
    metrics = replica_metrics("engine", (args.served_model_name or [spec.model.name])[0], None,
                              args.ingress.ray_metrics_export)  # also on Ray's export unless turned off
    return engine_over_workers(spec, workers, metrics, text, repair=RayRankRepair(launch))


def replica_text(spec: EngineSpec, args: ServeAppArgs) -> CheckpointText:
    """The served checkpoint's tokenizer and chat template (args' --chat-template first), read once per replica."""
    return load_checkpoint_text(spec.model.path, args.chat_template, spec.model.config.model_type)
