"""The verdict of `python -m benchmarks soak`: two idle snapshots (after warm-up, at the end) compared check by check.

A snapshot is what benchmarks/soak_probe.py read with the server idle: `rss` {pid: {name, mib}}, `actors`
{name: {pid, tasks, threads}}, `engines` {name: {sizes, free_pages, num_pages}}, `ranks` {label: {pid, sizes}},
`objects` {owned, in_scope, in_plasma, in_object_store}, `gauges` (/metrics). Checks, each {"pass", ...}:

* requests: no failure outcome (5xx, mid-stream error, malformed answer, a bad body accepted, a transport error);
* processes: the same server processes (pids) at both snapshots (a restarted replica would hide a leak);
* rss: per process, growth <= max(rss_limit_mib, rss_limit_pct % of its baseline). The floor: small processes
  (gcs_server, raylet: 30-150 MiB) move by tens of MiB with allocator arenas alone; the percentage: large ones
  (ranks holding weights) scale with their weights, not with traffic;
* kv_pages: every rank's pages free (/metrics and the engine's allocators), nothing running or waiting;
* engine_state, rank_state: no per-request container of the engine, scheduler or a rank larger than at baseline;
* tasks, threads: per actor, live asyncio tasks / threads at most `slack` above baseline;
* objects: Ray objects owned / referenced / stored at most `object_slack` above baseline.
"""

from __future__ import annotations

from dataclasses import dataclass

IDLE_WORKER = "ray::IDLE"  # Ray's pooled idle workers come and go; not server processes


@dataclass(frozen=True)
class Limits:
    rss_limit_mib: float = 64.0
    rss_limit_pct: float = 10.0
    task_slack: int = 2
    thread_slack: int = 2
    object_slack: int = 8


def rounded(value: float | None, digits: int) -> float | None:
    return None if value is None else round(value, digits)


def server_pids(snapshot: dict) -> dict[int, str]:
    return {int(pid): p["name"] for pid, p in snapshot["rss"].items() if not p["name"].startswith(IDLE_WORKER)}


def rss_check(baseline: dict, final: dict, limits: Limits) -> dict:
    per_process, ok = {}, True
    for pid, name in server_pids(baseline).items():
        start = baseline["rss"][pid]["mib"]
        end = final["rss"].get(pid, {}).get("mib")
        limit = max(limits.rss_limit_mib, start * limits.rss_limit_pct / 100)
        growth = None if end is None else end - start
        passed = growth is not None and growth <= limit
        ok &= passed
        per_process[f"{name} ({pid})"] = {"baseline_mib": round(start, 1), "final_mib": rounded(end, 1),
                                          "growth_mib": rounded(growth, 1),
                                          "growth_pct": rounded(None if growth is None else 100 * growth / start, 2),
                                          "limit_mib": round(limit, 1), "pass": passed}
    return {"pass": ok, "per_process": per_process}


def growth_check(baseline: dict, final: dict, key: str, slack: int) -> dict:
    """Per actor: `key` (tasks / threads) at the end minus after warm-up, at most `slack`."""
    per_actor, ok = {}, True
    for name, start in baseline["actors"].items():
        end = final["actors"].get(name, {}).get(key)
        passed = end is not None and end - start[key] <= slack
        ok &= passed
        per_actor[name] = {"baseline": start[key], "final": end, "pass": passed}
    return {"pass": ok, "slack": slack, "per_actor": per_actor}


def sizes_check(baseline: dict, final: dict, key: str) -> dict:
    """Every container size of every engine (or rank) at the end at most its size after warm-up."""
    grown, ok = {}, set(baseline[key]) == set(final[key])
    for name, start in baseline[key].items():
        end = final[key].get(name, {}).get("sizes", {})
        for field, size in end.items():
            if size > start["sizes"].get(field, 0):
                grown[f"{name}: {field}"] = {"baseline": start["sizes"].get(field, 0), "final": size}
    return {"pass": ok and not grown, "grown": grown, "final": {n: s["sizes"] for n, s in final[key].items()}}


def pages_check(final: dict) -> dict:
    gauges = final["gauges"]
    used = gauges["kv_pages_used"]
    allocators = {name: {"free": e["free_pages"], "num_pages": e["num_pages"]} for name, e in final["engines"].items()}
    all_free = all(free == e["num_pages"] for e in final["engines"].values() for free in e["free_pages"])
    passed = bool(used) and not any(used.values()) and gauges["running"] == gauges["waiting"] == 0 and all_free
    return {"pass": passed, "kv_pages_used": used, "kv_pages_total": gauges["kv_pages_total"],
            "running": gauges["running"], "waiting": gauges["waiting"], "allocators": allocators,
            "waited_idle_s": final.get("waited_idle_s")}


def objects_check(baseline: dict, final: dict, slack: int) -> dict:
    keys = ("owned", "in_scope", "in_plasma", "in_object_store")
    counts = {k: {"baseline": baseline["objects"][k], "final": final["objects"][k]} for k in keys}
    passed = all(c["final"] - c["baseline"] <= slack for c in counts.values())
    return {"pass": passed, "slack": slack, **counts}


def verdict(baseline: dict, final: dict, requests: dict, limits: Limits) -> dict:
    """Every check and the overall pass."""
    before, after = server_pids(baseline), server_pids(final)
    checks = {
        "requests": {"pass": requests["failures"] == 0, "failures": requests["failures"],
                     "http_5xx": requests["http_5xx"]},
        "processes": {"pass": before == after, "gone": sorted(set(before) - set(after)),
                      "new": sorted(set(after) - set(before))},
        "rss": rss_check(baseline, final, limits),
        "kv_pages": pages_check(final),
        "engine_state": sizes_check(baseline, final, "engines"),
        "rank_state": sizes_check(baseline, final, "ranks"),
        "tasks": growth_check(baseline, final, "tasks", limits.task_slack),
        "threads": growth_check(baseline, final, "threads", limits.thread_slack),
        "objects": objects_check(baseline, final, limits.object_slack),
    }
    return {"pass": all(c["pass"] for c in checks.values()), "failed": [n for n, c in checks.items() if not c["pass"]],
            "checks": checks}
