"""Prometheus metrics: names, labels, request-lifecycle tracking over engine chunks, the replica merge, a mirror,
and scrapes where some engine replicas do not answer."""

from __future__ import annotations

import asyncio

import pytest
from prometheus_client.parser import text_string_to_metric_families

from cp_router.metrics import METRIC_SPECS, PREFIX, ServeMetrics, exposed_sample_names, merge_metrics_text, track_stream
from cp_router.protocol import EngineChunk


def record_everything(metrics: ServeMetrics) -> None:
    metrics.observe_first_token(0.2, prompt_tokens=5)
    metrics.observe_tokens(2, gap_seconds=0.04)
    metrics.observe_finish("stop", 1.5, decode_seconds=1.3, lengths=(5, 3))
    metrics.observe_queue_time(0.05)
    metrics.observe_prefill_time(0.15)
    metrics.count_error("context_length_exceeded")
    metrics.count_scrape_errors(1)
    metrics.set_requests(running=3, waiting=1)
    metrics.set_kv_pages(cp_rank=1, used=7, total=64)
    metrics.add_speculation(drafts=3, draft_tokens=6, accepted_per_position=[3, 1])
    metrics.observe_cp_prefill(gathered_bytes=4096, seconds=0.01)
    metrics.add_preemptions()
    metrics.add_prefix_cache(queries=400, hits=256)
    metrics.set_prefix_cache_pages(cp_rank=1, pages=4)
    metrics.count_structured_output("json_schema")
    metrics.observe_grammar_compile(0.02)
    metrics.observe_grammar_mask(0.0004)
    metrics.observe_handoff(nbytes=1 << 20, seconds=0.003, retries=1)


def samples(text: str) -> dict[tuple, float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples
            if not s.name.endswith("_created")}


LABELS = (("model_name", "tiny-dsa"), ("replica", "engine-3"))


def test_every_metric_is_prefixed_and_labelled_by_replica_and_model():
    metrics = ServeMetrics("engine-3", "tiny-dsa")
    record_everything(metrics)
    rendered = samples(metrics.render())
    assert {name for name, _ in rendered} == exposed_sample_names()
    assert all(name.startswith(PREFIX) and dict(labels)["replica"] == "engine-3"
               and dict(labels)["model_name"] == "tiny-dsa" for name, labels in rendered)
    assert rendered[("dsa_serve:kv_pages_used", (("cp_rank", "1"), *LABELS))] == 7
    assert rendered[("dsa_serve:inter_token_latency_seconds_count", LABELS)] == 2
    assert rendered[("dsa_serve:request_time_per_output_token_seconds_sum", LABELS)] == pytest.approx(1.3 / 2)
    assert rendered[("dsa_serve:request_generation_tokens_sum", LABELS)] == 3
    assert rendered[("dsa_serve:metrics_scrape_errors_total", LABELS)] == 1
    assert rendered[("dsa_serve:prefix_cache_hits_total", LABELS)] == 256
    assert rendered[("dsa_serve:prefix_cache_pages", (("cp_rank", "1"), *LABELS))] == 4
    assert rendered[("dsa_serve:structured_output_requests_total", (("constraint_type", "json_schema"), *LABELS))] == 1
    assert rendered[("dsa_serve:grammar_mask_seconds_count", LABELS)] == 1
    assert rendered[("dsa_serve:pd_handoff_bytes_total", LABELS)] == 1 << 20
    assert rendered[("dsa_serve:pd_prefill_retries_total", LABELS)] == 1
    assert len(METRIC_SPECS) == 36


def test_speculative_counters_are_vllms_and_give_the_mean_acceptance_length():
    metrics = ServeMetrics("engine-3", "tiny-dsa")
    metrics.add_speculation(drafts=3, draft_tokens=6, accepted_per_position=[3, 1])
    metrics.add_speculation(drafts=1, draft_tokens=2, accepted_per_position=[0, 0])
    metrics.add_speculation(drafts=0, draft_tokens=0, accepted_per_position=[0, 0])  # a step without verification
    got = samples(metrics.render())
    drafts, accepted = got[("dsa_serve:spec_decode_num_drafts_total", LABELS)], \
        got[("dsa_serve:spec_decode_num_accepted_tokens_total", LABELS)]
    assert (drafts, accepted, got[("dsa_serve:spec_decode_num_draft_tokens_total", LABELS)]) == (4, 4, 8)
    assert 1 + accepted / drafts == 2.0
    per_position = {dict(labels)["position"]: value for (name, labels), value in got.items()
                    if name == "dsa_serve:spec_decode_num_accepted_tokens_per_pos_total"}
    assert per_position == {"0": 3, "1": 1}


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
    metrics = ServeMetrics("r0", "m")
    chunks = [chunk(1, None, 1), chunk(2, None, 3), chunk(0, "length", 3)]
    asyncio.run(replay(metrics, chunks, times=[10.0, 10.5, 10.7, 10.9]))
    got = samples(metrics.render())
    replica = (("model_name", "m"), ("replica", "r0"))
    assert got[("dsa_serve:time_to_first_token_seconds_sum", replica)] == pytest.approx(0.5)
    assert got[("dsa_serve:inter_token_latency_seconds_count", replica)] == 2
    assert got[("dsa_serve:inter_token_latency_seconds_sum", replica)] == pytest.approx(0.2)
    assert got[("dsa_serve:e2e_request_latency_seconds_sum", replica)] == pytest.approx(0.9)
    assert got[("dsa_serve:prompt_tokens_total", replica)] == 4
    assert got[("dsa_serve:generation_tokens_total", replica)] == 3
    assert got[("dsa_serve:request_success_total", (("finished_reason", "length"), *replica))] == 1
    assert got[("dsa_serve:request_decode_time_seconds_sum", replica)] == pytest.approx(0.4)  # first token -> finish
    assert got[("dsa_serve:request_time_per_output_token_seconds_sum", replica)] == pytest.approx(0.4 / 2)
    assert got[("dsa_serve:request_prompt_tokens_sum", replica)] == 4
    assert got[("dsa_serve:request_generation_tokens_sum", replica)] == 3


def test_an_abandoned_stream_counts_as_aborted():
    metrics = ServeMetrics("r0", "m")
    asyncio.run(replay(metrics, [chunk(1, None, 1), chunk(1, None, 2)], times=[0.0, 0.1, 0.2, 0.3], stop_after=1))
    got = samples(metrics.render())
    replica = (("model_name", "m"), ("replica", "r0"))
    assert got[("dsa_serve:request_success_total", (("finished_reason", "abort"), *replica))] == 1
    assert got[("dsa_serve:request_generation_tokens_sum", replica)] == 1
    assert ("dsa_serve:request_time_per_output_token_seconds_count", replica) not in got  # one token: no decode


def test_a_stream_failing_before_any_chunk_has_no_lengths():
    metrics = ServeMetrics("r0", "m")

    async def failing():
        raise RuntimeError("rank 1 died")
        yield  # an async generator

    async def consume():
        with pytest.raises(RuntimeError, match="rank 1 died"):
            async for _ in track_stream(metrics, failing(), clock=iter([0.0, 0.1]).__next__):
                pass

    asyncio.run(consume())
    got, replica = samples(metrics.render()), (("model_name", "m"), ("replica", "r0"))
    assert got[("dsa_serve:request_success_total", (("finished_reason", "abort"), *replica))] == 1
    assert got[("dsa_serve:e2e_request_latency_seconds_sum", replica)] == pytest.approx(0.1)
    assert ("dsa_serve:request_prompt_tokens_count", replica) not in got
    assert ("dsa_serve:request_decode_time_seconds_count", replica) not in got


def test_merge_keeps_each_family_once_with_every_replica():
    replicas = [ServeMetrics(f"engine-{i}", "m") for i in range(3)]
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
    first, second = ServeMetrics("engine-0", "m"), ServeMetrics("engine-0", "m")
    first.add_preemptions()
    second.add_preemptions()
    with pytest.raises(ValueError, match="appears twice"):
        merge_metrics_text([first.render(), second.render()])


def test_merge_rejects_conflicting_types():
    gauge = "# TYPE dsa_serve:x gauge\ndsa_serve:x{replica=\"a\"} 1\n"
    counter = "# TYPE dsa_serve:x counter\ndsa_serve:x_total{replica=\"b\"} 1\n"
    with pytest.raises(ValueError, match="dsa_serve:x: type counter"):
        merge_metrics_text([gauge, counter])


class ListMirror:
    """A MetricsMirror that keeps what it is given."""

    def __init__(self):
        self.records = []

    def record(self, spec, value, tags):
        self.records.append((spec.name, value, tags))


def test_a_mirror_sees_every_record_with_every_label():
    mirror = ListMirror()
    record_everything(ServeMetrics("engine-3", "tiny-dsa", mirror))
    assert {name for name, _, _ in mirror.records} == set(METRIC_SPECS)
    labels = {"replica": "engine-3", "model_name": "tiny-dsa"}
    assert ("kv_pages_used", 7, {**labels, "cp_rank": "1"}) in mirror.records
    assert ("spec_decode_num_accepted_tokens_per_pos", 1, {**labels, "position": "1"}) in mirror.records
    assert ("inter_token_latency_seconds", 0.02, labels) in mirror.records
