"""Prometheus metrics (`dsa_serve:` prefix), one registry per process, merged across replicas for /metrics.

Who records what: each engine replica owns a `ServeMetrics(replica=<its id>, model_name=<served name>)` and
records the request lifecycle (wrap each request's chunk stream in `track_stream`; the engine adds queue and
prefill times from its scheduler), its scheduler state (running/waiting, KV pages per CP rank, speculative
counters named as vLLM's `spec_decode_*`, CP prefill counters, preemptions). The ingress owns one too and
counts every error response it sends, by error type (`count_error`), and every engine replica that did not
answer a scrape (`count_scrape_errors`). `/metrics` merges the texts: `merge_metrics_text`. Every series carries
`replica` and `model_name` labels. A `MetricsMirror` (cluster/ray_metrics.py) copies each record into Ray's
metrics export as well.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import AsyncIterator, Callable, Iterable, Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

from cp_router.protocol import EngineChunk

PREFIX = "dsa_serve:"
LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
TOKEN_GAP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
REQUEST_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0, 640.0)
GRAMMAR_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
TOKEN_COUNT_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000, 200000)
REPLICA_LABELS = ("replica", "model_name")  # on every series, before a metric's own labels
RECORD_METHOD = {Counter: "inc", Gauge: "set", Histogram: "observe"}  # what recording a value means, by kind


@dataclass(frozen=True)
class MetricSpec:
    kind: type  # Counter | Gauge | Histogram
    name: str  # without PREFIX; counters are exposed with a `_total` suffix
    help: str
    labels: tuple[str, ...] = ()  # besides REPLICA_LABELS
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
    # vLLM's spec_decode_* counters: mean acceptance length = 1 + num_accepted_tokens / num_drafts
    MetricSpec(Counter, "spec_decode_num_drafts", "Speculative verifications (one per request per verify step)"),
    MetricSpec(Counter, "spec_decode_num_draft_tokens", "Tokens proposed by the MTP draft"),
    MetricSpec(Counter, "spec_decode_num_accepted_tokens", "Draft tokens accepted by verification"),
    MetricSpec(Counter, "spec_decode_num_accepted_tokens_per_pos", "Accepted draft tokens at each draft position",
               ("position",)),
    MetricSpec(Counter, "cp_prefill_bytes", "Bytes all-gathered across CP ranks during prefill"),
    MetricSpec(Histogram, "cp_prefill_seconds", "Duration of one CP prefill step", (), LATENCY_BUCKETS),
    MetricSpec(Counter, "num_preemptions", "Requests preempted for lack of KV pages (requeued)"),
    # vLLM's prefix_cache_* counters: hit rate = prefix_cache_hits / prefix_cache_queries
    MetricSpec(Counter, "prefix_cache_queries", "Prompt tokens of requests that looked the prefix cache up"),
    MetricSpec(Counter, "prefix_cache_hits", "Prompt tokens found in the prefix cache (not prefilled)"),
    MetricSpec(Gauge, "prefix_cache_pages", "KV pages of a CP rank indexed by the prefix cache (in use or "
               "evictable)", ("cp_rank",)),
    MetricSpec(Counter, "request_success", "Finished requests by finish reason", ("finished_reason",)),
    MetricSpec(Counter, "request_errors", "Failed or rejected requests by error type", ("error_type",)),
    MetricSpec(Histogram, "request_queue_time_seconds", "Arrival to first scheduled in a prefill", (),
               REQUEST_BUCKETS),
    MetricSpec(Histogram, "request_prefill_time_seconds", "First scheduled in a prefill to the first token", (),
               LATENCY_BUCKETS),
    MetricSpec(Histogram, "request_decode_time_seconds", "First token to finish of a request", (), REQUEST_BUCKETS),
    MetricSpec(Histogram, "request_time_per_output_token_seconds", "Decode time of a request per token after the "
               "first", (), TOKEN_GAP_BUCKETS),
    MetricSpec(Histogram, "request_prompt_tokens", "Prompt length of a finished request", (), TOKEN_COUNT_BUCKETS),
    MetricSpec(Histogram, "request_generation_tokens", "Tokens generated by a finished request", (),
               TOKEN_COUNT_BUCKETS),
    MetricSpec(Counter, "metrics_scrape_errors", "Engine replicas that did not answer a /metrics scrape"),
    MetricSpec(Counter, "structured_output_requests", "Requests with a structured-output constraint, by its kind",
               ("constraint_type",)),
    MetricSpec(Histogram, "grammar_compile_seconds", "Compile time of a distinct constraint (the ingress's)", (),
               GRAMMAR_BUCKETS),
    # prefill/decode disaggregation, on the decode group's replicas (docs/disaggregation.md)
    MetricSpec(Counter, "pd_handoffs", "Requests handed from a prefill group to this decode group"),
    MetricSpec(Counter, "pd_handoff_bytes", "KV page bytes handed from prefill groups to this decode group"),
    MetricSpec(Histogram, "pd_handoff_seconds", "Transfer of a hand-off: first chunk to its arrival", (), GRAMMAR_BUCKETS),
    MetricSpec(Counter, "pd_prefill_retries", "Prefills tried again on a prefill group after one failed"),
    MetricSpec(Gauge, "pd_requests_waiting_for_decode_slot", "Requests waiting for KV room here before their prefill"),
    MetricSpec(Histogram, "grammar_mask_seconds", "Grammar mask time of one engine step with constrained requests "
               "(the slowest rank)", (), GRAMMAR_BUCKETS),
)}


class MetricsMirror(Protocol):
    """Another export the records are copied into (Ray's metrics agent: cluster/ray_metrics.py)."""

    def record(self, spec: MetricSpec, value: float, tags: dict[str, str]) -> None:
        """Counter: add `value`; Gauge: set it; Histogram: observe it. `tags` holds every label of the series."""
        ...


class MetricsScrapeError(RuntimeError):
    """Some engine replicas did not answer a metrics scrape: `text` merges the texts of those that did."""

    def __init__(self, text: str, failures: list[str]):
        super().__init__(f"{len(failures)} engine replica(s) did not answer: {'; '.join(failures)}")
        self.text, self.failures = text, failures


def exposed_sample_names() -> set[str]:
    """Every sample name the metrics above can expose (what dashboards may reference)."""
    suffixes = {Counter: ("_total",), Gauge: ("",), Histogram: ("_bucket", "_sum", "_count")}
    return {PREFIX + spec.name + suffix for spec in METRIC_SPECS.values() for suffix in suffixes[spec.kind]}


class ServeMetrics:
    """All dsa_serve metrics of one replica, in a registry of their own (and in `mirror`, when given)."""

    def __init__(self, replica: str, model_name: str, mirror: MetricsMirror | None = None):
        self.replica, self.model_name, self.mirror = replica, model_name, mirror
        self.registry = CollectorRegistry()
        self._families = {name: self._build(spec) for name, spec in METRIC_SPECS.items()}

    def _build(self, spec: MetricSpec):
        extra = {"buckets": spec.buckets} if spec.kind is Histogram else {}
        return spec.kind(PREFIX + spec.name, spec.help, (*REPLICA_LABELS, *spec.labels), registry=self.registry,
                         **extra)

    def _record(self, name: str, value: float, *labels: str) -> None:
        """Counter: add `value`; Gauge: set it; Histogram: observe it (here and in the mirror)."""
        spec, values = METRIC_SPECS[name], (self.replica, self.model_name, *labels)
        child = self._families[name].labels(*values)
        getattr(child, RECORD_METHOD[spec.kind])(value)
        if self.mirror is not None:
            self.mirror.record(spec, value, dict(zip((*REPLICA_LABELS, *spec.labels), values)))

    def observe_first_token(self, seconds: float, prompt_tokens: int) -> None:
        self._record("time_to_first_token_seconds", seconds)
        self._record("prompt_tokens", prompt_tokens)

    def observe_tokens(self, count: int, gap_seconds: float | None) -> None:
        """`count` new tokens arrived `gap_seconds` after the previous ones (None for the first ones)."""
        self._record("generation_tokens", count)
        if gap_seconds is not None:
            for _ in range(count):
                self._record("inter_token_latency_seconds", gap_seconds / count)

    def observe_finish(self, finish_reason: str, seconds: float, decode_seconds: float | None = None,
                       lengths: tuple[int, int] | None = None) -> None:
        """A request ended `seconds` after arrival, `decode_seconds` after its first token (None: it had none);
        `lengths`: its (prompt, generated) token counts (None: no chunk told them)."""
        self._record("e2e_request_latency_seconds", seconds)
        self._record("request_success", 1, finish_reason)
        if lengths is not None:
            self._record("request_prompt_tokens", lengths[0])
            self._record("request_generation_tokens", lengths[1])
        generated_tokens = lengths[1] if lengths is not None else 0
        if decode_seconds is not None:
            self._record("request_decode_time_seconds", decode_seconds)
            if generated_tokens > 1:
                self._record("request_time_per_output_token_seconds", decode_seconds / (generated_tokens - 1))

    def observe_queue_time(self, seconds: float) -> None:
        self._record("request_queue_time_seconds", seconds)

    def observe_prefill_time(self, seconds: float) -> None:
        self._record("request_prefill_time_seconds", seconds)

    def count_error(self, error_type: str) -> None:
        self._record("request_errors", 1, error_type)

    def count_scrape_errors(self, replicas: int) -> None:
        self._record("metrics_scrape_errors", replicas)

    def set_requests(self, running: int, waiting: int, reserving: int = 0) -> None:
        self._record("num_requests_running", running)
        self._record("num_requests_waiting", waiting)
        self._record("pd_requests_waiting_for_decode_slot", reserving)

    def observe_handoff(self, nbytes: int, seconds: float, retries: int) -> None:
        """A hand-off arrived: its page bytes, its transfer time, and the prefill attempts that failed before it."""
        for name, value in (("pd_handoffs", 1), ("pd_handoff_bytes", nbytes), ("pd_handoff_seconds", seconds),
                            ("pd_prefill_retries", retries)):
            self._record(name, value)

    def set_kv_pages(self, cp_rank: int, used: int, total: int) -> None:
        self._record("kv_pages_used", used, str(cp_rank))
        self._record("kv_pages_total", total, str(cp_rank))

    def add_speculation(self, drafts: int, draft_tokens: int, accepted_per_position: list[int]) -> None:
        """One step's verifications: `drafts` request-steps proposing `draft_tokens` tokens in all, of which
        `accepted_per_position[j]` were accepted at draft position j."""
        if not drafts:
            return
        self._record("spec_decode_num_drafts", drafts)
        self._record("spec_decode_num_draft_tokens", draft_tokens)
        self._record("spec_decode_num_accepted_tokens", sum(accepted_per_position))
        for position, accepted in enumerate(accepted_per_position):
            self._record("spec_decode_num_accepted_tokens_per_pos", accepted, str(position))

    def observe_cp_prefill(self, gathered_bytes: int, seconds: float) -> None:
        self._record("cp_prefill_bytes", gathered_bytes)
        self._record("cp_prefill_seconds", seconds)

    def add_preemptions(self, count: int = 1) -> None:
        self._record("num_preemptions", count)

    def add_prefix_cache(self, queries: int, hits: int) -> None:
        if queries:
            self._record("prefix_cache_queries", queries)
            self._record("prefix_cache_hits", hits)

    def set_prefix_cache_pages(self, cp_rank: int, pages: int) -> None:
        self._record("prefix_cache_pages", pages, str(cp_rank))

    def count_structured_output(self, constraint_type: str) -> None:
        self._record("structured_output_requests", 1, constraint_type)

    def observe_grammar_compile(self, seconds: float) -> None:
        self._record("grammar_compile_seconds", seconds)

    def observe_grammar_mask(self, seconds: float) -> None:
        self._record("grammar_mask_seconds", seconds)

    def render(self) -> str:
        return generate_latest(self.registry).decode()


async def track_stream(metrics: ServeMetrics, chunks: AsyncIterator[EngineChunk],
                       clock: Callable[[], float] = time.monotonic) -> AsyncIterator[EngineChunk]:
    """Pass `chunks` through, recording TTFT, inter-token gaps, tokens and the finish of one request (its
    decode time from the first token, its prompt and generation lengths).

    The clock starts when the wrapper is first iterated (the request's arrival at the engine). A stream the
    consumer stops reading before its finish reason counts as finished with reason "abort".
    """
    start = clock()
    first_token_at = last_token_at = last = None
    finished = False

    def finish(reason: str, now: float) -> None:
        decode_s = None if first_token_at is None else now - first_token_at
        lengths = None if last is None else (last.prompt_tokens, last.completion_tokens)
        metrics.observe_finish(reason, now - start, decode_s, lengths)

    try:
        async for last in chunks:
            now = clock()
            if last.token_ids:
                if last_token_at is None:
                    first_token_at = now
                    metrics.observe_first_token(now - start, last.prompt_tokens)
                metrics.observe_tokens(len(last.token_ids), None if last_token_at is None else now - last_token_at)
                last_token_at = now
            if last.finish_reason is not None:
                finished = True
                finish(last.finish_reason, now)
            yield last
    finally:
        if not finished:
            finish("abort", clock())


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
