"""What `python -m benchmarks soak` reads of a running server: process RSS, asyncio tasks, Ray objects, engine state.

Nothing here changes the server. Processes: the server's process tree from /proc (the `dsa-serve serve` driver,
gcs_server, raylet, Ray's agents, and every Ray worker: Serve controller, proxy, ingress and engine replicas,
CPWorker ranks), named by their command line (Ray titles workers `ray::<Actor>.<method>`). Inside actors the
soak runs the read-only functions below through Ray's `__ray_call__` (a DeveloperAPI that calls `fn(actor)` in
the actor's process), so the server needs no debug route: `actor_tasks` counts live asyncio tasks of every event
loop of the process (Serve runs user code on its own loop, Ray's actor calls on another), `engine_state` the sizes
of the engine's and scheduler's per-request containers, `rank_state` a rank worker's. Ray objects per worker come
from the raylet's node stats (what `ray memory` reads; the state API needs the dashboard, which `serve` leaves off).
"""

from __future__ import annotations

import asyncio
import gc
import os
import sys
import threading
from collections import deque
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

PROC = Path("/proc")
SERVE_NAMESPACE = "serve"
CONTAINERS = (dict, list, set, frozenset, deque, tuple)


# processes ----------------------------------------------------------------------------------------
def read_proc(pid: int, name: str) -> str | None:
    try:
        return (PROC / str(pid) / name).read_text(errors="replace")
    except OSError:  # the process ended
        return None


def children_of(root_pid: int) -> list[int]:
    """Every live descendant of `root_pid` (one scan of /proc)."""
    parents: dict[int, list[int]] = {}
    for entry in PROC.iterdir():
        if entry.name.isdigit() and (stat := read_proc(int(entry.name), "stat")) is not None:
            ppid = int(stat.rsplit(")", 1)[1].split()[1])  # the name in (...) may hold spaces
            parents.setdefault(ppid, []).append(int(entry.name))
    found, frontier = [], [root_pid]
    while frontier:
        found.extend(kids := [k for pid in frontier for k in parents.get(pid, [])])
        frontier = kids
    return found


def start_time(pid: int) -> int | None:
    """The process's start time (clock ticks since boot): with the pid, names one process even after pid reuse."""
    stat = read_proc(pid, "stat")
    return None if stat is None else int(stat.rsplit(")", 1)[1].split()[19])


def process_name(pid: int) -> str | None:
    """`ray::ServeReplica:dsa-serve:DSAEngine` (the method suffix dropped), `raylet`, `dashboard.py`, ..."""
    cmdline = read_proc(pid, "cmdline")
    if not cmdline:
        return None
    words = [w for w in cmdline.split("\0") if w]
    if words[0].startswith("ray::"):
        return words[0].strip().split(".")[0]
    if Path(words[0]).name.startswith("python"):
        script = next((w for w in words[1:] if not w.startswith("-")), words[0])
        return Path(script).name
    return Path(words[0]).name


def rss_mib(pid: int) -> float | None:
    status = read_proc(pid, "status")
    line = next((ln for ln in (status or "").splitlines() if ln.startswith("VmRSS:")), None)
    return int(line.split()[1]) / 1024 if line else None  # kB


def process_rss(root_pid: int) -> dict[int, tuple[str, float]]:
    """(name, RSS MiB) of the root and every descendant still alive."""
    table = {}
    for pid in [root_pid, *children_of(root_pid)]:
        name, rss = process_name(pid), rss_mib(pid)
        if name is not None and rss is not None:
            table[pid] = (name, rss)
    return table


def gcs_address(root_pid: int) -> str:
    """The GCS address of the Ray cluster a `serve` process started (its raylet's --gcs-address)."""
    for pid in children_of(root_pid):
        words = (read_proc(pid, "cmdline") or "").split("\0")
        if Path(words[0]).name == "raylet":
            for word in words:
                if word.startswith("--gcs-address="):
                    return word.split("=", 1)[1]
    raise RuntimeError(f"no raylet with --gcs-address under process {root_pid}: did `serve` start its own Ray?")


# inside actors (run by __ray_call__; read-only) ------------------------------------------------------
def live_tasks() -> list[asyncio.Task]:
    """Unfinished asyncio tasks of every loop of this process (Python's registry of tasks, any thread)."""
    registry = getattr(asyncio.tasks, "_all_tasks", None)  # <= 3.11: one WeakSet of every task
    if registry is None:  # 3.12+: scheduled tasks in a WeakSet, eager ones in a set
        registry = [*asyncio.tasks._scheduled_tasks, *getattr(asyncio.tasks, "_eager_tasks", ())]
    for _ in range(100):  # another thread may add a task while we copy: retry, as asyncio.all_tasks does
        try:
            return [task for task in list(registry) if not task.done()]
        except RuntimeError:
            continue
    raise RuntimeError("the task registry kept changing")


def user_callable(actor):
    """A Serve replica's deployment instance (DSAEngine, DSAIngress, DSAServer); None for other actors."""
    wrapper = getattr(getattr(actor, "_replica_impl", None), "_user_callable_wrapper", None)
    return None if wrapper is None else wrapper.user_callable


def actor_tasks(actor) -> dict:
    """This process: pid, live asyncio tasks (all loops), threads."""
    return {"pid": os.getpid(), "tasks": len(live_tasks()), "threads": threading.active_count()}


def collect_garbage(actor) -> int:
    """gc.collect() (what it freed): objects left in reference cycles (a cancelled request's traceback holding
    Ray object refs, say) would otherwise count until Python's next full collection."""
    return gc.collect()


def container_sizes(obj, prefix: str) -> dict[str, int]:
    """len() of every container attribute of `obj`; a dict of containers also counts its members' total."""
    sizes = {}
    for name, value in sorted(vars(obj).items()):
        if isinstance(value, CONTAINERS) and not isinstance(value, (str, bytes)):
            sizes[f"{prefix}.{name}"] = len(value)
            if isinstance(value, dict) and value and all(isinstance(v, CONTAINERS) for v in value.values()):
                sizes[f"{prefix}.{name}[*]"] = sum(len(v) for v in value.values())
    return sizes


def engine_state(actor) -> dict | None:
    """The replica's engine: container sizes of the engine and its scheduler, free pages per rank, and the
    rank worker handles (for `rank_state`); None for a replica without an engine (the ingress). Read on the
    loop that runs the engine, so no step is half applied."""
    module = sys.modules.get("cp_router.engine")  # not imported: no engine here (and none imported by the probe)
    engine = getattr(user_callable(actor), "engine", None)
    if module is None or not isinstance(engine, module.GenerationEngine):  # the ingress's: a DeploymentHandle
        return None

    async def read() -> dict:
        scheduler = engine.scheduler
        return {"pid": os.getpid(), "free_pages": list(scheduler.free_pages()), "num_pages": scheduler.config.num_pages,
                "sizes": {**container_sizes(engine, "engine"), **container_sizes(scheduler, "scheduler")},
                "workers": list(engine.workers)}

    loop = actor._replica_impl._user_callable_wrapper.event_loop
    return asyncio.run_coroutine_threadsafe(read(), loop).result(timeout=30)


def rank_state(worker) -> dict:
    """A CPWorker rank: pid, cp_rank, and the sizes of its per-request containers (`held`, ...)."""
    return {"pid": os.getpid(), "cp_rank": worker.cp_rank, "sizes": container_sizes(worker, "rank")}


# from the soak's driver ----------------------------------------------------------------------------
def short_actor_name(name: str) -> str:
    """SERVE_REPLICA::dsa-serve#DSAEngine#ab12 -> DSAEngine#ab12; SERVE_PROXY_ACTOR-<node> -> ProxyActor@<node[:8]>;
    SERVE_CONTROLLER_ACTOR -> ServeController."""
    if name.startswith("SERVE_REPLICA::"):
        return name.split("#", 1)[1]
    if name.startswith("SERVE_PROXY_ACTOR-"):
        return "ProxyActor@" + name.removeprefix("SERVE_PROXY_ACTOR-")[:8]
    return "ServeController" if name == "SERVE_CONTROLLER_ACTOR" else name


def serve_actors() -> dict[str, object]:
    """Short name -> handle of every named Serve actor (controller, proxies, replicas)."""
    import ray

    actors = {}
    for entry in ray.util.list_named_actors(all_namespaces=True):
        if entry["namespace"] == SERVE_NAMESPACE:
            actors[short_actor_name(entry["name"])] = ray.get_actor(entry["name"], namespace=SERVE_NAMESPACE)
    return actors


def object_counts(exclude_pid: int) -> dict:
    """Ray objects over the cluster's workers (not `exclude_pid`, the soak itself): owned, references in scope,
    in plasma; and the object stores' object count. Per pid too."""
    import ray
    from ray._private import internal_api

    per_pid, stored = {}, 0
    for node in ray.nodes():
        if node["Alive"]:
            stats = internal_api.node_stats(node["NodeManagerAddress"], node["NodeManagerPort"], False)
            stored += stats.store_stats.num_local_objects
            for worker in stats.core_workers_stats:
                if worker.pid != exclude_pid:
                    per_pid[worker.pid] = {"owned": worker.num_owned_objects, "in_plasma": worker.num_in_plasma,
                                           "in_scope": worker.num_object_refs_in_scope}
    totals = {key: sum(c[key] for c in per_pid.values()) for key in ("owned", "in_scope", "in_plasma")}
    return {**totals, "in_object_store": stored, "per_pid": per_pid}


def engine_gauges(metrics_text: str) -> dict:
    """From /metrics: running and waiting requests (summed over replicas), KV pages used and total per cp_rank
    (summed over replicas: idle means 0 on every one)."""
    gauges = {"running": 0.0, "waiting": 0.0, "kv_pages_used": {}, "kv_pages_total": {}}
    for family in text_string_to_metric_families(metrics_text):
        for sample in family.samples:
            name = sample.name.removeprefix("dsa_serve:")
            if name in ("num_requests_running", "num_requests_waiting"):
                gauges[name.removeprefix("num_requests_")] += sample.value
            elif name in ("kv_pages_used", "kv_pages_total"):
                per_rank = gauges[name]
                rank = int(sample.labels["cp_rank"])
                per_rank[rank] = per_rank.get(rank, 0.0) + sample.value
    return gauges
