"""`python -m benchmarks soak`: a real `dsa-serve serve` under mixed load with disconnects, checked for leaks.

Starts `dsa-serve serve` (the default model unless --serve-args names another) on a free loopback port
(benchmarks/soak_server.py), then runs three phases of benchmarks/soak_load.py's mixed load:
warm-up (--warmup-s of load), steady (the rest of --duration-s), idle (--idle-s without requests). After
warm-up and at the end, with nothing in flight and the engine idle, it takes a snapshot
(benchmarks/soak_probe.py): RSS of every process of the server's tree, live asyncio tasks and threads of every
Serve actor, the engine's and each rank's per-request containers, KV pages, Ray objects. RSS is also sampled every
--sample-s. The verdict (benchmarks/soak_verdict.py) compares the two snapshots; the JSON object (last line of
stdout) holds phases, requests by kind and outcome, the RSS series, both snapshots and the checks. Exit status 1
when a check fails. `make soak` runs it for 10 minutes through tests/soak/test_soak.py, which asserts the verdict.
The probes run inside the server's actors; their module is sent there by value (this harness is not installed).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

from benchmarks.soak_load import LONG_TOKENS, LoadContext, bad_bodies, run_clients, tally
from benchmarks.soak_verdict import Limits, verdict
from cluster.bench.common import spelled_command
from cluster.commands.result_output import print_result

SOAK_FLAGS = ("duration_s", "warmup_s", "idle_s", "concurrency", "sample_s", "seed", "serve_args", "rss_limit_mib",
              "rss_limit_pct", "task_slack", "thread_slack", "object_slack")
IDLE_TIMEOUT_S = 120  # after the load: the engine must be idle within this
SETTLE_S = 3.0  # quiet time before a snapshot (Serve's own periodic work)
PROBE_TIMEOUT_S = 60
LONG_TEXT = "\n".join(f"def step_{i}(state, value):\n    return state.update(value * {i})\n" for i in range(400))


def add_parser(kinds) -> None:
    bench = kinds.add_parser("soak", help="mixed HTTP load with disconnects on a real server: RSS, tasks, pages")
    bench.add_argument("--duration-s", type=float, default=600, help="seconds of load, warm-up included")
    bench.add_argument("--warmup-s", type=float, default=60, help="seconds of load before the baseline snapshot")
    bench.add_argument("--idle-s", type=float, default=30, help="seconds without requests before the final snapshot")
    bench.add_argument("--concurrency", type=int, default=12, help="closed-loop clients")
    bench.add_argument("--sample-s", type=float, default=10, help="RSS sampling period")
    bench.add_argument("--seed", type=int, default=0, help="seed of the request mix")
    bench.add_argument("--serve-args", default="", help='more `dsa-serve serve` flags, e.g. "--cp-size 2 '
                                                        '--speculative-num-steps 2" (not --port/--host/--ray-address)')
    bench.add_argument("--rss-limit-mib", type=float, default=64, help="allowed RSS growth per process (MiB) ...")
    bench.add_argument("--rss-limit-pct", type=float, default=10, help="... or percent of its baseline, the larger")
    bench.add_argument("--task-slack", type=int, default=2, help="allowed growth of live asyncio tasks per actor")
    bench.add_argument("--thread-slack", type=int, default=2, help="allowed growth of threads per actor")
    bench.add_argument("--object-slack", type=int, default=8, help="allowed growth of Ray objects (each count)")
    bench.add_argument("--server-log", default=None, help="the server's output (default: a file in the temp dir)")
    bench.add_argument("--json", action="store_true", help="stdout: the JSON object only (progress and the "
                                                           "summary go to stderr either way)")
    bench.set_defaults(run=run)


def check_arguments(args: argparse.Namespace) -> list[str]:
    """The serve flags as words; ValueError naming the flag for anything out of range."""
    for flag, value, low in [("--warmup-s", args.warmup_s, 1), ("--idle-s", args.idle_s, 0),
                             ("--concurrency", args.concurrency, 1), ("--sample-s", args.sample_s, 0.5),
                             ("--rss-limit-mib", args.rss_limit_mib, 0), ("--rss-limit-pct", args.rss_limit_pct, 0),
                             ("--task-slack", args.task_slack, 0), ("--thread-slack", args.thread_slack, 0),
                             ("--object-slack", args.object_slack, 0)]:
        if value < low:
            raise ValueError(f"{flag} must be >= {low}, got {value}")
    if args.duration_s <= args.warmup_s:
        raise ValueError(f"--duration-s ({args.duration_s:g}) must exceed --warmup-s ({args.warmup_s:g}): "
                         "the steady phase is the difference")
    if not Path("/proc/self/status").exists():
        raise ValueError("the soak reads process memory from /proc: run it on Linux")
    from benchmarks.soak_server import check_serve_args

    try:
        words = shlex.split(args.serve_args)
    except ValueError as exc:
        raise ValueError(f"--serve-args: {exc}") from None
    check_serve_args(words)
    return words


class RssSampler:
    """RSS of every process of the server's tree every `period_s`, tagged with the phase it fell in."""

    def __init__(self, root_pid: int, period_s: float):
        self.root_pid, self.period_s, self.phase, self.start = root_pid, period_s, "warmup", time.monotonic()
        self.samples: list[tuple[float, str, dict[int, tuple[str, float]]]] = []

    def sample(self) -> None:
        from benchmarks.soak_probe import process_rss

        self.samples.append((time.monotonic() - self.start, self.phase, process_rss(self.root_pid)))

    async def run(self) -> None:
        while True:
            self.sample()
            await asyncio.sleep(self.period_s)

    def series(self, labels: dict[int, str]) -> dict:
        """Seconds and phase of each sample, and per process (labelled) its MiB at each (None: not alive)."""
        pids = sorted({pid for _, _, table in self.samples for pid in table})
        names = {pid: labels.get(pid) or next(t[pid][0] for _, _, t in self.samples if pid in t) for pid in pids}
        mib = {f"{names[pid]} ({pid})": [round(t[pid][1], 1) if pid in t else None for _, _, t in self.samples]
               for pid in pids}
        summary = {name: {"first": alive[0], "min": min(alive), "max": max(alive), "last": alive[-1]}
                   for name, values in mib.items() if (alive := [v for v in values if v is not None])}
        return {"t_s": [round(t, 1) for t, _, _ in self.samples], "phase": [p for _, p, _ in self.samples],
                "summary_mib": summary, "mib": mib}


def snapshot(root_pid: int) -> dict:
    """The idle state of the server (blocking Ray calls: run it in a thread). See soak_verdict's docstring."""
    import ray
    from ray import cloudpickle

    from benchmarks import soak_probe as probe

    cloudpickle.register_pickle_by_value(probe)  # the actors' Python has the package, not this harness

    def each(handles, fn) -> list:
        return ray.get([handle.__ray_call__.remote(fn) for handle in handles], timeout=PROBE_TIMEOUT_S)

    start = time.monotonic()
    actors = probe.serve_actors()
    collected = sum(each(actors.values(), probe.collect_garbage))  # first: cycles would count as live
    engines = {name: state for name, state in zip(actors, each(actors.values(), probe.engine_state)) if state}
    workers = {name: state.pop("workers") for name, state in engines.items()}
    collected += sum(each([w for ws in workers.values() for w in ws], probe.collect_garbage))
    tasks = dict(zip(actors, each(actors.values(), probe.actor_tasks)))
    ranks = {f"{name}/cp_rank={rank['cp_rank']}": rank for name, ws in workers.items()
             for rank in each(ws, probe.rank_state)}
    labels = {t["pid"]: name for name, t in tasks.items()} | {r["pid"]: label for label, r in ranks.items()}
    rss = {pid: {"name": labels.get(pid, name), "mib": mib} for pid, (name, mib) in probe.process_rss(root_pid).items()}
    return {"rss": rss, "actors": tasks, "engines": engines, "ranks": ranks, "garbage_collected": collected,
            "objects": probe.object_counts(exclude_pid=os.getpid()), "snapshot_s": round(time.monotonic() - start, 2)}


async def wait_idle(client, url: str) -> tuple[dict, float]:
    """/metrics gauges once nothing runs or waits and every page is free (or IDLE_TIMEOUT_S passed); seconds."""
    from benchmarks.soak_probe import engine_gauges

    start = time.monotonic()
    while True:
        gauges = engine_gauges((await client.get(url + "/metrics", timeout=30)).text)
        idle = gauges["running"] == gauges["waiting"] == 0 and not any(gauges["kv_pages_used"].values())
        if idle or time.monotonic() - start > IDLE_TIMEOUT_S:
            return gauges, time.monotonic() - start
        await asyncio.sleep(0.5)


async def idle_snapshot(client, url: str, root_pid: int) -> dict:
    gauges, waited = await wait_idle(client, url)
    await asyncio.sleep(SETTLE_S)
    state = await asyncio.to_thread(snapshot, root_pid)
    return {**state, "gauges": gauges, "waited_idle_s": round(waited, 1),
            "load_generator_tasks": len(asyncio.all_tasks())}


async def load_context(client, url: str) -> LoadContext:
    """The long prompt's token ids (the server's /tokenize) and max_model_len (/v1/models)."""
    card = (await client.get(url + "/v1/models")).json()["data"][0]
    ids = (await client.post(url + "/tokenize", json={"prompt": LONG_TEXT})).json()["tokens"]
    if len(ids) < LONG_TOKENS[1] or card["max_model_len"] < LONG_TOKENS[1] + 200:
        raise ValueError(f"the served model must admit {LONG_TOKENS[1] + 200} tokens (max_model_len "
                         f"{card['max_model_len']}) and tokenize the long prompt to >= {LONG_TOKENS[1]} ({len(ids)})")
    return LoadContext(client, url, ids, LONG_TEXT, bad_bodies(card["max_model_len"]))


async def soak(server, args) -> dict:
    """The three phases and the two snapshots around the steady one."""
    import httpx

    limits = httpx.Limits(max_connections=args.concurrency + 4, max_keepalive_connections=args.concurrency + 4)
    async with httpx.AsyncClient(limits=limits, trust_env=False, timeout=60) as client:
        ctx = await load_context(client, server.url)
        sampler = RssSampler(server.pid, args.sample_s)
        sampling = asyncio.create_task(sampler.run())
        phases, counts = [], {}

        async def phase(name: str, work) -> None:
            sampler.phase, start = name, time.monotonic() - sampler.start
            progress(f"{name} phase from {start:.0f} s ({sum(ctx.outcomes.values())} requests so far)")
            before = Counter(ctx.outcomes)
            await work
            end = time.monotonic() - sampler.start
            phases.append({"name": name, "start_s": round(start, 1), "end_s": round(end, 1)})
            counts[name] = sum((ctx.outcomes - before).values())

        await phase("warmup", run_clients(ctx, args.concurrency, args.warmup_s, args.seed))
        sampler.phase = "baseline"
        baseline = await idle_snapshot(client, server.url, server.pid)
        progress(f"baseline snapshot taken ({baseline['snapshot_s']} s)")
        await phase("steady", run_clients(ctx, args.concurrency, args.duration_s - args.warmup_s, args.seed + 1))
        await phase("idle", asyncio.sleep(args.idle_s))
        sampler.phase = "final"
        final = await idle_snapshot(client, server.url, server.pid)
        sampler.sample()
        sampling.cancel()
    labels = {pid: p["name"] for snap in (baseline, final) for pid, p in snap["rss"].items()}
    requests = {**tally(ctx.outcomes), "per_phase": counts, "bad_bodies_rejected": dict(sorted(ctx.bad_seen.items())),
                "failure_notes": dict(ctx.notes)}
    return {"phases": phases, "requests": requests, "baseline": baseline, "final": final,
            "rss_series": sampler.series(labels)}


def progress(line: str) -> None:
    print(f"soak: {line}", file=sys.stderr, flush=True)


def summary_text(result: dict) -> str:
    """A few lines for a person: requests, RSS per process (after warm-up -> end), and each check."""
    requests, checks = result["requests"], result["verdict"]["checks"]
    lines = [f"soak: {requests['total']} requests {requests['by_outcome']}; 5xx {requests['http_5xx']}, "
             f"failures {requests['failures']}"]
    lines += [f"  rss {name}: {p['baseline_mib']} -> {p['final_mib']} MiB"
              for name, p in checks["rss"]["per_process"].items()]
    lines.append("  checks: " + ", ".join(f"{n} {'ok' if c['pass'] else 'FAILED'}" for n, c in checks.items()))
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    from benchmarks import soak_server

    serve_words = check_arguments(args)
    log_path = Path(args.server_log or tempfile.mkstemp(prefix="dsa-soak-", suffix=".log")[1])
    progress(f"starting dsa-serve serve (log: {log_path})")
    server = soak_server.start(serve_words, log_path)
    try:
        soak_server.connect_ray(server)
        measured = asyncio.run(soak(server, args))
    finally:
        import ray

        ray.shutdown()  # leaves the server's Ray: this process only joined it
        stopped = soak_server.stop(server)
    limits = Limits(args.rss_limit_mib, args.rss_limit_pct, args.task_slack, args.thread_slack, args.object_slack)
    outcome = verdict(measured["baseline"], measured["final"], measured["requests"], limits)
    result = {"bench": "soak", "command": spelled_command("soak", args, SOAK_FLAGS),
              "server": {"command": "dsa-serve " + shlex.join(server.command[3:]), "log": str(log_path), **stopped},
              **measured, "verdict": outcome}
    print(summary_text(result), file=sys.stderr)
    if not args.json:
        print_result(summary_text(result))
    print_result(json.dumps(result, default=str))
    return 0 if outcome["pass"] else 1
