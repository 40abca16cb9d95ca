"""Ray placement and launch of one CP group: C CPWorker actors in a placement group, joined in a process group.

One placement group per engine with C bundles (`{"GPU": 1}` each when CUDA is available, else `{"CPU": 1}`), one
worker (a CPWorker actor) per bundle, each loading the same `RankSpec`; a task in cp_rank 0's bundle picks the
rendezvous address and a free port, which the launcher passes to every rank. A group that cannot be placed fails
after a timeout with an error naming what it asked for; `CPGroup.shutdown` kills the actors and removes the
placement group. The engine that drives a group runs where its caller is (this process, or a Serve replica): see
cluster/ray_engine.py. `start_workers` alone puts the workers into bundles of a placement group the caller owns (a
Serve replica's), as a `RankLaunch` describes; the engine's repair (cluster/rank_repair.py) starts a lost rank's
replacement the same way."""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from pathlib import Path

import ray
import torch
from ray.exceptions import GetTimeoutError
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from cluster.config import ResolvedCPConfig
from model_workers.checkpoint.model_dir import as_model_spec
from model_workers.comm import free_port
from model_workers.cp_worker import CPWorker
from model_workers.kernels.registry import DEFAULT_ATTENTION_BACKEND
from model_workers.spec import ModelSpec, RankSpec


class PlacementTimeout(RuntimeError):
    """The placement group of an engine could not be placed in time."""


def engine_cpus(cp_size: int) -> int:
    """Logical CPUs one CPU engine occupies: a bundle per rank worker plus one for the engine's step loop."""
    return cp_size + 1


def start_ray(min_cpus: int, address: str | None = None, log_to_driver: bool = False) -> bool:
    """Joins the Ray cluster at `address` (or $RAY_ADDRESS), else starts a local one; True when it started Ray.

    A local Ray gets at least `min_cpus` logical CPUs (`engine_cpus(C)` per engine it will hold), so a
    machine with fewer cores still places the groups (the workers then share cores). `log_to_driver`
    forwards the actors' stdout/stderr to this process (the server's access log).
    """
    if ray.is_initialized():
        return False
    address = address or os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address, include_dashboard=False, log_to_driver=log_to_driver)
        return False
    num_cpus = max(os.cpu_count() or 1, min_cpus)
    ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, log_to_driver=log_to_driver)
    return True


@contextlib.contextmanager
def ray_session(min_cpus: int, address: str | None):
    """Ray for one command: joined at `address` or started locally (and then shut down on exit)."""
    started = start_ray(min_cpus, address)
    try:
        yield
    finally:
        if started:
            ray.shutdown()


@dataclass
class CPGroup:
    """Handles of one launched CP group: its rank workers (Ray actors) and their placement group."""

    cp: ResolvedCPConfig
    workers: list  # by cp_rank; the engine's repair replaces lost ones in this list
    placement: object
    launch: RankLaunch

    def shutdown(self) -> None:
        try:
            stop_workers(self.workers)
        finally:
            remove_placement_group(self.placement)


def stop_workers(workers: list) -> None:
    """Shuts the workers' process group down (30 s at most), then kills the worker actors."""
    try:
        ray.get([w.shutdown.remote() for w in workers], timeout=30)
    finally:
        for worker in workers:
            ray.kill(worker)


def _place(cp_size: int, use_gpu: bool, timeout_s: float, strategy: str = "PACK"):
    bundle = {"GPU": 1} if use_gpu else {"CPU": 1}
    group = placement_group([dict(bundle) for _ in range(cp_size)], strategy=strategy)
    try:
        ray.get(group.ready(), timeout=timeout_s)
    except GetTimeoutError:
        remove_placement_group(group)
        raise PlacementTimeout(
            f"placement group of {cp_size} bundles {bundle} (cp_size={cp_size}) not placed within {timeout_s:g}s;"
            f" cluster resources: {ray.cluster_resources()}, available: {ray.available_resources()}"
        ) from None
    return group


@ray.remote(num_cpus=0)
def node_rendezvous() -> tuple[str, int]:
    """This node's address as Ray knows it, and a port free on it now: where a group's ranks meet."""
    return ray.util.get_node_ip_address(), free_port()


@dataclass(frozen=True)
class RankLaunch:
    """How the rank workers of one group start: bundles first_bundle.. of `group` (a placement group), each loading
    `rank` (the spec resolved once at the edge). Kept by the engine's repair (cluster/rank_repair.py) to replace a
    lost rank."""

    rank: RankSpec
    cp_size: int
    group: object  # the placement group
    first_bundle: int
    threads_per_worker: int = 1
    use_gpu: bool = False

    def create(self, cp_rank: int):
        """A new (not yet joined, not loaded) worker actor for `cp_rank` in its bundle."""
        resources = {"num_gpus": 1, "num_cpus": 0} if self.use_gpu else {"num_cpus": 1}
        strategy = PlacementGroupSchedulingStrategy(self.group, placement_group_bundle_index=self.first_bundle + cp_rank)
        return ray.remote(CPWorker).options(**resources, scheduling_strategy=strategy).remote(
            cp_rank, self.cp_size, self.threads_per_worker, True)  # its load progress reaches the server console

    def load(self, worker):
        """The ObjectRef of `worker` loading the checkpoint and a fresh cache."""
        return worker.load.remote(self.rank)

    def rendezvous(self):
        """The ObjectRef of (address, free port) on cp_rank 0's node, for the group's process-group rendezvous."""
        strategy = PlacementGroupSchedulingStrategy(self.group, placement_group_bundle_index=self.first_bundle)
        return node_rendezvous.options(scheduling_strategy=strategy).remote()


def start_workers(launch: RankLaunch) -> list:
    """One CPWorker per rank, joined in a process group, checkpoint loaded.

    On failure the workers are stopped and the error re-raised; the placement group stays the caller's.
    """
    workers = [launch.create(r) for r in range(launch.cp_size)]
    try:
        master_addr, master_port = ray.get(launch.rendezvous())
        ray.get([w.init_comm.remote(master_addr, master_port) for w in workers])
        ray.get([launch.load(w) for w in workers])
    except Exception:
        stop_workers(workers)
        raise
    return workers


def launch_ranks(rank: RankSpec, cp: ResolvedCPConfig, placement_timeout_s: float = 60.0, threads_per_worker: int = 1,
                 use_gpu: bool | None = None, placement_strategy: str = "PACK") -> CPGroup:
    """Places a group and starts its workers (one per CP rank, each loading `rank`: see `start_workers`).
    `placement_strategy`: Ray's (PACK, SPREAD, STRICT_PACK, STRICT_SPREAD); SPREAD puts the ranks on different
    nodes where it can."""
    use_gpu = torch.cuda.is_available() if use_gpu is None else use_gpu
    group = _place(cp.cp_size, use_gpu, placement_timeout_s, placement_strategy)
    launch = RankLaunch(rank, cp.cp_size, group, 0, threads_per_worker, use_gpu)
    try:
        workers = start_workers(launch)
    except Exception:
        remove_placement_group(group)
        raise
    return CPGroup(cp, workers, group, launch)


def launch_group(
    model: ModelSpec | str | Path,
    cp: ResolvedCPConfig,
    dtype: str = "float32",
    num_pages: int = 256,
    page_size: int = 64,
    placement_timeout_s: float = 60.0,
    threads_per_worker: int = 1,
    use_gpu: bool | None = None,
    kv_cache_dtype: str = "auto",
    deterministic: bool = False,
    placement_strategy: str = "PACK",
    speculative_token_map: str = "auto",
    attention_backend: str = DEFAULT_ATTENTION_BACKEND,
) -> CPGroup:
    """`launch_ranks` of the rank spec these settings make (a folder is read here): tests and tools that launch a
    group without an engine spec."""
    model = as_model_spec(model)
    rank = RankSpec(model, dtype, num_pages, page_size, cp.ep_size, kv_cache_dtype, deterministic,
                    speculative_token_map, attention_backend)
    return launch_ranks(rank, cp, placement_timeout_s, threads_per_worker, use_gpu, placement_strategy)
