"""`python -m benchmarks soak` (benchmarks/soak*.py): the verdict's checks on made-up snapshots, the probes'
parsing and flag errors. The soaks against a real `dsa-serve serve` are tests/soak/test_soak.py."""

from __future__ import annotations

import copy
from collections import deque

import pytest

from benchmarks.cli import main as harness_main
from benchmarks.soak import RssSampler
from benchmarks.soak_load import tally
from benchmarks.soak_probe import container_sizes, engine_gauges, short_actor_name
from benchmarks.soak_verdict import Limits, verdict

LEAK_CHECKS = ("processes", "rss", "kv_pages", "engine_state", "rank_state", "tasks", "threads", "objects")


def idle_snapshot() -> dict:
    """What an idle server looks like to the soak: two ranks, nothing in flight."""
    return {
        "rss": {10: {"name": "raylet", "mib": 40.0}, 11: {"name": "DSAEngine#a/cp_rank=0", "mib": 1000.0},
                12: {"name": "ray::IDLE", "mib": 90.0}},
        "actors": {"DSAEngine#a": {"pid": 13, "tasks": 8, "threads": 6}},
        "engines": {"DSAEngine#a": {"sizes": {"engine.streams": 0, "scheduler.requests": 0},
                                    "free_pages": [256, 256], "num_pages": 256}},
        "ranks": {"DSAEngine#a/cp_rank=0": {"pid": 11, "sizes": {"rank.held": 0}}},
        "objects": {"owned": 9, "in_scope": 14, "in_plasma": 2, "in_object_store": 2},
        "gauges": {"running": 0.0, "waiting": 0.0, "kv_pages_used": {0: 0.0, 1: 0.0},
                   "kv_pages_total": {0: 256.0, 1: 256.0}},
    }


def failed_checks(change) -> list[str]:
    final = copy.deepcopy(idle_snapshot())
    change(final)
    requests = {"failures": 0, "http_5xx": 0}
    return verdict(idle_snapshot(), final, requests, Limits())["failed"]


def test_two_equal_idle_snapshots_pass_every_check():
    outcome = verdict(idle_snapshot(), idle_snapshot(), {"failures": 0, "http_5xx": 0}, Limits())
    assert outcome["pass"] and outcome["failed"] == []
    assert set(outcome["checks"]) == {"requests", *LEAK_CHECKS}


@pytest.mark.parametrize("change, check", [
    (lambda s: s["rss"][11].update(mib=1000.0 + 101), "rss"),  # over 10% of 1000 MiB
    (lambda s: s["rss"][10].update(mib=40.0 + 65), "rss"),  # over the 64 MiB floor
    (lambda s: s["rss"].pop(11), "processes"),  # a rank restarted (and its RSS is gone)
    (lambda s: s["gauges"]["kv_pages_used"].update({1: 3.0}), "kv_pages"),
    (lambda s: s["engines"]["DSAEngine#a"].update(free_pages=[256, 250]), "kv_pages"),
    (lambda s: s["gauges"].update(waiting=1.0), "kv_pages"),
    (lambda s: s["engines"]["DSAEngine#a"]["sizes"].update({"engine.streams": 1}), "engine_state"),
    (lambda s: s["ranks"]["DSAEngine#a/cp_rank=0"]["sizes"].update({"rank.held": 2}), "rank_state"),
    (lambda s: s["actors"]["DSAEngine#a"].update(tasks=8 + 3), "tasks"),
    (lambda s: s["actors"]["DSAEngine#a"].update(threads=6 + 3), "threads"),
    (lambda s: s["objects"].update(owned=9 + 9), "objects"),
])
def test_each_kind_of_leak_fails_its_own_check(change, check):
    assert check in failed_checks(change)


def test_growth_within_the_limits_and_idle_workers_do_not_fail():
    def change(s):
        s["rss"][11]["mib"] += 99  # under 10% of 1000 MiB
        s["rss"][10]["mib"] += 63  # under the 64 MiB floor
        s["rss"].pop(12)  # a pooled idle worker went away
        s["rss"][14] = {"name": "ray::IDLE", "mib": 80.0}
        s["actors"]["DSAEngine#a"]["tasks"] += 2
        s["objects"]["owned"] += 8

    assert failed_checks(change) == []


def test_a_failed_request_fails_the_verdict():
    outcome = verdict(idle_snapshot(), idle_snapshot(), {"failures": 1, "http_5xx": 1}, Limits())
    assert outcome["failed"] == ["requests"] and not outcome["pass"]


def test_tally_counts_by_kind_and_outcome():
    counts = {("chat", "ok"): 3, ("disconnect", "disconnected"): 2, ("chat", "http_5xx"): 1, ("timeout", "ok"): 0}
    result = tally(counts)
    assert result["total"] == 6 and result["http_5xx"] == 1 and result["failures"] == 1
    assert result["by_kind"] == {"chat": {"http_5xx": 1, "ok": 3}, "disconnect": {"disconnected": 2}}


def test_engine_gauges_sum_replicas_per_rank_whatever_the_other_labels():
    text = "\n".join([
        '# TYPE dsa_serve:num_requests_running gauge',
        'dsa_serve:num_requests_running{model_name="m",replica="engine-a"} 1.0',
        'dsa_serve:num_requests_running{model_name="m",replica="engine-b"} 2.0',
        '# TYPE dsa_serve:kv_pages_used gauge',
        'dsa_serve:kv_pages_used{cp_rank="0",model_name="m",replica="engine-a"} 4.0',
        'dsa_serve:kv_pages_used{cp_rank="0",model_name="m",replica="engine-b"} 1.0',
        'dsa_serve:kv_pages_used{cp_rank="1",model_name="m",replica="engine-a"} 0.0', ""])
    gauges = engine_gauges(text)
    assert gauges["running"] == 3.0 and gauges["waiting"] == 0.0
    assert gauges["kv_pages_used"] == {0: 5.0, 1: 0.0}


def test_container_sizes_and_actor_names():
    class Holder:
        def __init__(self):
            self.streams, self.waiting, self.name = {"a": 1}, deque([1, 2]), "not a container"
            self.pending = {0: {"x", "y"}, 1: set()}

    assert container_sizes(Holder(), "engine") == {"engine.pending": 2, "engine.pending[*]": 2,
                                                   "engine.streams": 1, "engine.waiting": 2}
    assert short_actor_name("SERVE_REPLICA::dsa-serve#DSAEngine#ab12") == "DSAEngine#ab12"
    assert short_actor_name("SERVE_PROXY_ACTOR-0123456789abcdef") == "ProxyActor@01234567"
    assert short_actor_name("SERVE_CONTROLLER_ACTOR") == "ServeController"


def test_rss_series_labels_processes_and_summarizes_each():
    sampler = RssSampler(root_pid=1, period_s=1)
    sampler.samples = [(0.0, "warmup", {5: ("ray::CPWorker", 10.0)}),
                       (1.0, "steady", {5: ("ray::CPWorker", 12.0), 6: ("ray::IDLE", 3.0)}),
                       (2.0, "idle", {5: ("ray::CPWorker", 11.0)})]
    series = sampler.series({5: "DSAEngine#a/cp_rank=0"})
    assert series["phase"] == ["warmup", "steady", "idle"]
    assert series["mib"] == {"DSAEngine#a/cp_rank=0 (5)": [10.0, 12.0, 11.0], "ray::IDLE (6)": [None, 3.0, None]}
    assert series["summary_mib"]["DSAEngine#a/cp_rank=0 (5)"] == {"first": 10.0, "min": 10.0, "max": 12.0, "last": 11.0}


@pytest.mark.parametrize("argv, named", [
    (["--duration-s", "30", "--warmup-s", "30"], "--duration-s"),
    (["--concurrency", "0"], "--concurrency"),
    (["--serve-args", "--port 9000"], "--port"),
    (["--serve-args=--ray-address=auto"], "--ray-address"),
    (["--serve-args", "'unclosed"], "--serve-args"),
])
def test_bad_flags_are_refused_naming_the_flag(argv, named, capsys):
    assert harness_main(["soak", *argv]) == 2
    assert named in capsys.readouterr().err
