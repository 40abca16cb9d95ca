"""Prometheus metrics: names, labels, request-lifecycle tracking over engine chunks, and the replica merge."""

from __future__ import annotations

import asyncio

import pytest
from prometheus_client.parser import text_string_to_metric_families

from cp_router.metrics import METRIC_SPECS, PREFIX, ServeMetrics, exposed_sample_names, merge_metrics_text, track_stream
from cp_router.protocol import EngineChunk


def record_everything(metrics: ServeMetrics) -> None:
    metrics.observe_first_token(0.2, prompt_tokens=5)
    metrics.observe_tokens(2, gap_seconds=0.04)
    metrics.observe_finish("stop", 1.5)
    metrics.count_error("context_length_exceeded")
    metrics.set_requests(running=3, waiting=1)
    metrics.set_kv_pages(cp_rank=1, used=7, total=64)
    metrics.add_speculation(drafted=6, accepted=4)
    metrics.observe_cp_prefill(gathered_bytes=4096, seconds=0.01)
    metrics.add_preemptions()


def samples(text: str) -> dict[tuple, float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples
            if not s.name.endswith("_created")}


def test_every_metric_is_prefixed_and_labelled_by_replica():
    metrics = ServeMetrics("engine-3")
    record_everything(metrics)
    rendered = samples(metrics.render())
    assert {name for name, _ in rendered} == exposed_sample_names()
    assert all(name.startswith(PREFIX) and dict(labels)["replica"] == "engine-3" for name, labels in rendered)
    assert rendered[("dsa_serve:kv_pages_used", (("cp_rank", "1"), ("replica", "engine-3")))] == 7
    assert rendered[("dsa_serve:spec_decode_accepted_tokens_total", (("replica", "engine-3"),))] == 4
    assert rendered[("dsa_serve:inter_token_latency_seconds_count", (("replica", "engine-3"),))] == 2
    assert len(METRIC_SPECS) == 16


def chunk(tokens: int, finish: str | None, completion: int) -> EngineChunk:
    return EngineChunk(tuple(range(tokens)), "x" * tokens, finish, prompt_tokens=4, completion_tokens=completion)


async def replay(metrics: ServeMetrics, chunks: list[EngineChunk], times: list[float], stop_after: int | None = None):
    """Feed `chunks` through track_stream with a fake clock; stop reading after `stop_after` chunks."""

    async def source():
        for item in chunks:
            yield item

    stream = track_stream(metrics, source(), clock=iter(times).__next__)
    read = 0
    async for _ in stream:
        read += 1
        if read == stop_after:
            break
    await stream.aclose()


def test_track_stream_records_the_request_lifecycle():
    metrics = ServeMetrics("r0")
    chunks = [chunk(1, None, 1), chunk(2, None, 3), chunk(0, "length", 3)]
    asyncio.run(replay(metrics, chunks, times=[10.0, 10.5, 10.7, 10.9]))
    got = samples(metrics.render())
    replica = (("replica", "r0"),)
    assert got[("dsa_serve:time_to_first_token_seconds_sum", replica)] == pytest.approx(0.5)
    assert got[("dsa_serve:inter_token_latency_seconds_count", replica)] == 2
    assert got[("dsa_serve:inter_token_latency_seconds_sum", replica)] == pytest.approx(0.2)
    assert got[("dsa_serve:e2e_request_latency_seconds_sum", replica)] == pytest.approx(0.9)
    assert got[("dsa_serve:prompt_tokens_total", replica)] == 4
    assert got[("dsa_serve:generation_tokens_total", replica)] == 3
    assert got[("dsa_serve:request_success_total", (("finished_reason", "length"), *replica))] == 1


def test_an_abandoned_stream_counts_as_aborted():
    metrics = ServeMetrics("r0")
    asyncio.run(replay(metrics, [chunk(1, None, 1), chunk(1, None, 2)], times=[0.0, 0.1, 0.2, 0.3], stop_after=1))
    got = samples(metrics.render())
    assert got[("dsa_serve:request_success_total", (("finished_reason", "abort"), ("replica", "r0")))] == 1


def test_merge_keeps_each_family_once_with_every_replica():
    replicas = [ServeMetrics(f"engine-{i}") for i in range(3)]
    for metrics in replicas:
        record_everything(metrics)
    merged = merge_metrics_text(metrics.render() for metrics in replicas)
    type_lines = [line for line in merged.splitlines() if line.startswith("# TYPE ")]
    assert len(type_lines) == len(set(type_lines))
    expected = {}
    for metrics in replicas:
        expected.update(samples(metrics.render()))
    assert samples(merged) == expected
    assert merge_metrics_text([merged]) == merged
    assert {dict(labels)["replica"] for _, labels in samples(merged)} == {"engine-0", "engine-1", "engine-2"}


def test_merge_rejects_a_series_reported_twice():
    first, second = ServeMetrics("engine-0"), ServeMetrics("engine-0")
    first.add_preemptions()
    second.add_preemptions()
    with pytest.raises(ValueError, match="appears twice"):
        merge_metrics_text([first.render(), second.render()])


def test_merge_rejects_conflicting_types():
    gauge = "# TYPE dsa_serve:x gauge\ndsa_serve:x{replica=\"a\"} 1\n"
    counter = "# TYPE dsa_serve:x counter\ndsa_serve:x_total{replica=\"b\"} 1\n"
    with pytest.raises(ValueError, match="dsa_serve:x: type counter"):
        merge_metrics_text([gauge, counter])
