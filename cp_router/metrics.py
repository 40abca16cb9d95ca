"""Prometheus metrics (`dsa_serve:` prefix), one registry per process, merged across replicas for /metrics.

Who records what: each engine replica owns a `ServeMetrics(replica=<its id>)` and records the request
lifecycle (wrap each request's chunk stream in `track_stream`) and its scheduler state (running/waiting,
KV pages per CP rank, speculative and CP prefill counters, preemptions). The ingress owns one labelled
`replica="ingress"` (configurable) and counts every error response it sends, by error type
(`count_error`). `/metrics` merges the texts: `merge_metrics_text`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import AsyncIterator, Callable, Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

from cp_router.protocol import EngineChunk

PREFIX = "dsa_serve:"
LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
TOKEN_GAP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
REQUEST_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0, 640.0)


@dataclass(frozen=True)
class MetricSpec:
    kind: type  # Counter | Gauge | Histogram
    name: str  # without PREFIX; counters are exposed with a `_total` suffix
    help: str
    labels: tuple[str, ...] = ()  # besides `replica`
    buckets: tuple[float, ...] = ()


METRIC_SPECS = {spec.name: spec for spec in (
    MetricSpec(Histogram, "time_to_first_token_seconds", "Arrival to first generated token", (), LATENCY_BUCKETS),
    MetricSpec(Histogram, "inter_token_latency_seconds", "Gap between consecutive generated tokens", (),
               TOKEN_GAP_BUCKETS),
    MetricSpec(Histogram, "e2e_request_latency_seconds", "Arrival to finish of a request", (), REQUEST_BUCKETS),
    MetricSpec(Counter, "prompt_tokens", "Prompt tokens prefilled"),
    MetricSpec(Counter, "generation_tokens", "Tokens generated"),
    MetricSpec(Gauge, "num_requests_running", "Requests scheduled on the engine (prefill or decode)"),
    MetricSpec(Gauge, "num_requests_waiting", "Requests queued for admission"),
    MetricSpec(Gauge, "kv_pages_used", "KV cache pages in use on a CP rank", ("cp_rank",)),
    MetricSpec(Gauge, "kv_pages_total", "KV cache pages of a CP rank", ("cp_rank",)),
    MetricSpec(Counter, "spec_decode_draft_tokens", "Tokens proposed by the MTP draft"),
    MetricSpec(Counter, "spec_decode_accepted_tokens", "Draft tokens accepted by verification"),
    MetricSpec(Counter, "cp_prefill_bytes", "Bytes all-gathered across CP ranks during prefill"),
    MetricSpec(Histogram, "cp_prefill_seconds", "Duration of one CP prefill step", (), LATENCY_BUCKETS),
    MetricSpec(Counter, "num_preemptions", "Requests preempted for lack of KV pages (requeued)"),
    MetricSpec(Counter, "request_success", "Finished requests by finish reason", ("finished_reason",)),
    MetricSpec(Counter, "request_errors", "Failed or rejected requests by error type", ("error_type",)),
)}


def exposed_sample_names() -> set[str]:
    """Every sample name the metrics above can expose (what dashboards may reference)."""
    suffixes = {Counter: ("_total",), Gauge: ("",), Histogram: ("_bucket", "_sum", "_count")}
    return {PREFIX + spec.name + suffix for spec in METRIC_SPECS.values() for suffix in suffixes[spec.kind]}


class ServeMetrics:
    """All dsa_serve metrics of one replica, in a registry of their own."""

    def __init__(self, replica: str):
        self.replica = replica
        self.registry = CollectorRegistry()
        self._families = {name: self._build(spec) for name, spec in METRIC_SPECS.items()}

    def _build(self, spec: MetricSpec):
        extra = {"buckets": spec.buckets} if spec.kind is Histogram else {}
        return spec.kind(PREFIX + spec.name, spec.help, ("replica", *spec.labels), registry=self.registry, **extra)

    def _child(self, name: str, *labels: str):
        return self._families[name].labels(self.replica, *labels)

    def observe_first_token(self, seconds: float, prompt_tokens: int) -> None:
        self._child("time_to_first_token_seconds").observe(seconds)
        self._child("prompt_tokens").inc(prompt_tokens)

    def observe_tokens(self, count: int, gap_seconds: float | None) -> None:
        """`count` new tokens arrived `gap_seconds` after the previous ones (None for the first ones)."""
        self._child("generation_tokens").inc(count)
        if gap_seconds is not None:
            for _ in range(count):
                self._child("inter_token_latency_seconds").observe(gap_seconds / count)

    def observe_finish(self, finish_reason: str, seconds: float) -> None:
        self._child("e2e_request_latency_seconds").observe(seconds)
        self._child("request_success", finish_reason).inc()

    def count_error(self, error_type: str) -> None:
        self._child("request_errors", error_type).inc()

    def set_requests(self, running: int, waiting: int) -> None:
        self._child("num_requests_running").set(running)
        self._child("num_requests_waiting").set(waiting)

    def set_kv_pages(self, cp_rank: int, used: int, total: int) -> None:
        self._child("kv_pages_used", str(cp_rank)).set(used)
        self._child("kv_pages_total", str(cp_rank)).set(total)

    def add_speculation(self, drafted: int, accepted: int) -> None:
        self._child("spec_decode_draft_tokens").inc(drafted)
        self._child("spec_decode_accepted_tokens").inc(accepted)

    def observe_cp_prefill(self, gathered_bytes: int, seconds: float) -> None:
        self._child("cp_prefill_bytes").inc(gathered_bytes)
        self._child("cp_prefill_seconds").observe(seconds)

    def add_preemptions(self, count: int = 1) -> None:
        self._child("num_preemptions").inc(count)

    def render(self) -> str:
        return generate_latest(self.registry).decode()


async def track_stream(metrics: ServeMetrics, chunks: AsyncIterator[EngineChunk],
                       clock: Callable[[], float] = time.monotonic) -> AsyncIterator[EngineChunk]:
    """Pass `chunks` through, recording TTFT, inter-token gaps, tokens and the finish of one request.

    The clock starts when the wrapper is first iterated (the request's arrival at the engine). A stream the
    consumer stops reading before its finish reason counts as finished with reason "abort".
    """
    start = clock()
    last_token_at: float | None = None
    finished = False
    try:
        async for chunk in chunks:
            now = clock()
            if chunk.token_ids:
                if last_token_at is None:
                    metrics.observe_first_token(now - start, chunk.prompt_tokens)
                metrics.observe_tokens(len(chunk.token_ids), None if last_token_at is None else now - last_token_at)
                last_token_at = now
            if chunk.finish_reason is not None:
                finished = True
                metrics.observe_finish(chunk.finish_reason, now - start)
            yield chunk
    finally:
        if not finished:
            metrics.observe_finish("abort", clock() - start)


class _Families:
    """A collector that yields pre-built metric families (for rendering a merge)."""

    def __init__(self, families: list[Metric]):
        self.families = families

    def collect(self) -> list[Metric]:
        return self.families


def _sample_key(sample) -> tuple:
    return sample.name, tuple(sorted(sample.labels.items()))


def merge_metrics_text(texts: Iterable[str]) -> str:
    """Merge Prometheus text expositions (one per replica) into one: each family once, all its samples.

    Raises ValueError when a family has two types or a series appears twice (two replicas sharing a label).
    """
    merged: dict[str, Metric] = {}
    seen: set[tuple] = set()
    for text in texts:
        for family in text_string_to_metric_families(text):
            target = merged.setdefault(family.name, Metric(family.name, family.documentation, family.type))
            if target.type != family.type:
                raise ValueError(f"metric {family.name}: type {family.type} here, {target.type} in another text")
            for sample in family.samples:
                if _sample_key(sample) in seen:
                    raise ValueError(f"series {sample.name}{sample.labels} appears twice; replica labels must differ")
                seen.add(_sample_key(sample))
                target.samples.append(sample)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Families(list(merged.values())))
    return generate_latest(registry).decode()
