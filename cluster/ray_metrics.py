"""The dsa_serve metrics on Ray's metrics export as well as on the ingress's /metrics.

Inside a Ray Serve replica every `ServeMetrics` record is copied into a `ray.util.metrics` Counter / Gauge /
Histogram. Ray's per-node metrics agent serves them on its metrics export port (`ray start
--metrics-export-port`; KubeRay sets 8080 and its PodMonitor scrapes it) with Ray's `ray_` prefix and `_` for
the `:` Ray no longer accepts in names: `dsa_serve:num_requests_running` is `ray_dsa_serve_num_requests_running`,
a counter `dsa_serve:prompt_tokens_total` is `ray_dsa_serve_prompt_tokens_total`, with the same `replica` and
`model_name` labels (and Ray's own: WorkerId, NodeAddress, SessionName, ...). Ray rebuilds a histogram's `_sum`
from bucket midpoints, so means from Ray's export are approximate; the ingress's /metrics has exact sums.
"""

from __future__ import annotations

import os
import socket
import sys

from prometheus_client import Counter, Gauge, Histogram

from cp_router.metrics import REPLICA_LABELS, MetricSpec, ServeMetrics

RAY_NAME_PREFIX = "dsa_serve_"  # Ray adds its own `ray_` in front
_RAY_METRICS: dict[str, object] = {}  # one Ray metric per name and process (the colocated server has two ServeMetrics)


def serve_replica_tag() -> str | None:
    """The Serve replica id of this process, None outside a Serve replica (Ray Serve not even imported)."""
    if "ray.serve" not in sys.modules:
        return None
    from ray import serve
    from ray.serve.exceptions import RayServeException

    try:
        return serve.get_replica_context().replica_tag
    except RayServeException:
        return None


def replica_label(role: str) -> str:
    """`<role>-<Serve replica id>` inside a Serve replica, else `<role>-<hostname>:<pid>`: distinct per replica."""
    tag = serve_replica_tag()
    return f"{role}-{tag}" if tag is not None else f"{role}-{socket.gethostname()}:{os.getpid()}"


def ray_metric(spec: MetricSpec):
    """The process's Ray metric of `spec`, created on first use."""
    if spec.name not in _RAY_METRICS:
        from ray.util import metrics

        kind = {Counter: metrics.Counter, Gauge: metrics.Gauge, Histogram: metrics.Histogram}[spec.kind]
        extra = {"boundaries": list(spec.buckets)} if spec.kind is Histogram else {}
        _RAY_METRICS[spec.name] = kind(RAY_NAME_PREFIX + spec.name, spec.help, tag_keys=(*REPLICA_LABELS, *spec.labels),
                                       **extra)
    return _RAY_METRICS[spec.name]


class RayMetricsMirror:
    """A `MetricsMirror` into `ray.util.metrics` (what Ray's metrics agent exports)."""

    def record(self, spec: MetricSpec, value: float, tags: dict[str, str]) -> None:
        metric = ray_metric(spec)
        if spec.kind is Counter:
            if value > 0:  # Ray's Counter takes positive increments only
                metric.inc(value, tags=tags)
        elif spec.kind is Gauge:
            metric.set(value, tags=tags)
        else:
            metric.observe(value, tags=tags)


def replica_metrics(role: str, model_name: str, replica: str | None = None, ray_export: bool = True) -> ServeMetrics:
    """The metrics of one replica: labelled `replica` (default `replica_label(role)`) and `model_name`, and
    mirrored into Ray's metrics export when `ray_export` and this process is a Serve replica."""
    mirror = RayMetricsMirror() if ray_export and serve_replica_tag() is not None else None
    return ServeMetrics(replica or replica_label(role), model_name, mirror)
