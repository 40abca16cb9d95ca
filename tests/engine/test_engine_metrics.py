"""What the engine reports while it runs: queue and prefill times from its scheduler, vLLM's speculative counters,
and the status line a person reads every few seconds while it is busy (injected clocks: no sleeping)."""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest
from prometheus_client.parser import text_string_to_metric_families

from cluster.engine_setup import run_all, start_local_engine
from cluster.engine_spec import EngineOptions
from cp_router.engine_log import EngineLog
from cp_router.engine_stats import EngineStats
from cp_router.metrics import ServeMetrics
from cp_router.plans import RequestOutput
from cp_router.request_timing import RequestTimes
from cp_router.scheduler_prefill import Piece, PrefillBatch
from model_workers.checkpoint.model_dir import resolve_model_dir
from support.engines import make_requests


class Clock:
    def __init__(self, now: float = 100.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


def sums(text: str) -> dict[str, float]:
    """Sample name (labels summed over) -> value."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[s.name] = out.get(s.name, 0.0) + s.value
    return out


def step_with(pieces: list[Piece]) -> SimpleNamespace:
    return SimpleNamespace(prefill=PrefillBatch(tuple(pieces), (0,), (0,) * len(pieces)) if pieces else None)


def test_queue_time_runs_to_the_first_prefill_and_prefill_time_to_the_first_token():
    clock, metrics = Clock(), ServeMetrics("engine-0", "m")
    times = RequestTimes(clock)
    times.arrive("a")  # at 100
    clock.now = 103.0  # a step of 1 s (started at 102) prefills the first chunk of "a": its token is a placeholder
    times.observe_step(step_with([Piece("a", 0, 32, final=False)]), {"a": RequestOutput("a", 7, token_ids=[7])}, 1.0,
                       metrics)
    clock.now = 104.5  # the final chunk gives the first token
    times.observe_step(step_with([Piece("a", 32, 8, final=True)]), {"a": RequestOutput("a", 9, token_ids=[9])}, 1.0,
                       metrics)
    clock.now = 106.0  # a decode step: nothing more to time
    times.observe_step(step_with([]), {"a": RequestOutput("a", 3, token_ids=[3])}, 1.0, metrics)
    got = sums(metrics.render())
    assert got["dsa_serve:request_queue_time_seconds_sum"] == pytest.approx(2.0)
    assert got["dsa_serve:request_prefill_time_seconds_sum"] == pytest.approx(2.5)
    assert got["dsa_serve:request_queue_time_seconds_count"] == got["dsa_serve:request_prefill_time_seconds_count"] == 1
    assert times.arrived == {} and times.scheduled == {}


def test_a_request_that_ends_early_is_forgotten():
    clock, metrics = Clock(), ServeMetrics("engine-0", "m")
    times = RequestTimes(clock)
    times.arrive("a")
    times.observe_step(step_with([Piece("a", 0, 32, final=False)]), {}, 0.5, metrics)
    times.forget("a")  # aborted mid-prefill
    assert times.arrived == {} and times.scheduled == {}


@dataclass
class FakeScheduler:
    running: int = 1
    waiting: list = field(default_factory=list)
    free: list = field(default_factory=lambda: [90, 70])
    config: SimpleNamespace = field(default_factory=lambda: SimpleNamespace(num_pages=100))

    def num_running(self) -> int:
        return self.running

    def free_pages(self) -> list[int]:
        return self.free


def test_the_status_line_comes_every_interval_while_busy_and_never_when_idle():
    clock, stats, scheduler = Clock(), EngineStats(), FakeScheduler(waiting=["w"])
    log = EngineLog(interval_s=5.0, clock=clock)
    lines = []
    for _ in range(12):  # 12 steps of 1 s: 100 prompt tokens, 10 tokens, 4 verifications accepting 6 drafts each
        clock.now += 1.0
        stats.prefilled, stats.generated, stats.drafts, stats.accepted = (stats.prefilled + 100, stats.generated + 10,
                                                                           stats.drafts + 4, stats.accepted + 6)
        lines.append(log.after_step(stats, 1.0, scheduler))
    logged = [line for line in lines if line]
    assert [i for i, line in enumerate(lines) if line] == [4, 9]  # 5 s after the first step began, then 5 s later
    assert logged[0] == ("engine: 1 running, 1 waiting, KV 20.0% (max cp_rank 30.0%), prefill 100.0 tokens/s, "
                         "generation 10.0 tokens/s, mean acceptance length 2.50")
    scheduler.running, scheduler.waiting = 0, []
    clock.now += 1.0
    assert log.after_step(stats, 1.0, scheduler) is None  # this step left the engine idle
    clock.now += 600.0  # idle: no steps, no lines; the next busy period does not count the idle time
    scheduler.running = 1
    for _ in range(5):
        clock.now += 1.0
        stats.generated += 20
        line = log.after_step(stats, 1.0, scheduler)
    assert "generation 20.0 tokens/s" in line and "acceptance" not in line and "prefill 0.0 tokens/s" in line


def test_the_interval_is_checked():
    with pytest.raises(ValueError, match="interval_s must be > 0"):
        EngineLog(interval_s=0)


LINE = re.compile(r"engine: \d+ running, \d+ waiting, KV \d+\.\d% \(max cp_rank \d+\.\d%\), prefill \d+\.\d tokens/s, "
                  r"generation \d+\.\d tokens/s(, mean acceptance length (\d+\.\d\d))?"
                  r"(, prefix cache hit rate \d+\.\d%)?")


def test_a_real_engine_reports_its_times_counters_and_status_lines(caplog):
    """The default model with k = 2 MTP drafts: every request's queue and prefill time observed once, vLLM's
    speculative counters equal to the engine's own counts, and status lines while it ran."""
    metrics = ServeMetrics("engine-0", "default_model")
    options = EngineOptions(num_speculative_steps=2, num_pages=64, page_size=8, prefill_token_budget=32,
                            max_steps_per_call=1)
    engine = start_local_engine(resolve_model_dir(None), options, metrics)
    clock = Clock()

    def tick() -> float:  # one read per step: each step is a second later
        clock.now += 1.0
        return clock.now

    engine.monitor.log = EngineLog(interval_s=1.5, clock=tick)
    requests = make_requests([5, 40, 12, 3], 12, 6000, prompt_seed=3, temperature=0.0, ignore_eos=True)
    with caplog.at_level(logging.INFO, logger="dsa_serve.engine"):
        run_all(engine, requests)
    got, stats = sums(metrics.render()), engine.stats
    for name in ("request_queue_time_seconds", "request_prefill_time_seconds", "request_decode_time_seconds",
                 "request_time_per_output_token_seconds", "request_generation_tokens"):
        assert got[f"dsa_serve:{name}_count"] == len(requests), name
    assert got["dsa_serve:request_prompt_tokens_sum"] == sum(len(r.prompt_token_ids) for r in requests)
    assert got["dsa_serve:request_generation_tokens_sum"] == 12 * len(requests)
    assert stats.drafts > 0 and stats.drafted == 2 * stats.drafts
    assert got["dsa_serve:spec_decode_num_drafts_total"] == stats.drafts
    assert got["dsa_serve:spec_decode_num_draft_tokens_total"] == stats.drafted
    assert got["dsa_serve:spec_decode_num_accepted_tokens_total"] == stats.accepted == sum(stats.accepted_per_position)
    assert got["dsa_serve:spec_decode_num_accepted_tokens_per_pos_total"] == stats.accepted
    assert stats.prefilled == sum(len(r.prompt_token_ids) for r in requests)
    lines = [r.getMessage() for r in caplog.records if r.name == "dsa_serve.engine"]
    assert len(lines) >= 2 and all(LINE.fullmatch(line) for line in lines), lines
    lengths = [float(m.group(2)) for m in map(LINE.fullmatch, lines) if m.group(2)]
    assert lengths and all(1.0 <= length <= 3.0 for length in lengths), lines  # 1 + accepted / drafts, k = 2
    assert engine.monitor.times.arrived == {} and engine.monitor.times.scheduled == {}
