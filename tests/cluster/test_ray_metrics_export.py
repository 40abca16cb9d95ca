"""The dsa_serve metrics on Ray's metrics export (what KubeRay's PodMonitor scrapes on `metrics-export-port`), from
the real Serve app: a local Ray with a known `_metrics_export_port`, the app of cluster.serve_app (C = 2, the
default model, 2 MTP drafts), a few completions and one rejected request. Every series of the ingress's /metrics
(engine replica and ingress alike) is then on Ray's export as `ray_dsa_serve_*` with the same labels and value;
histograms by count, since Ray rebuilds their sums from bucket midpoints."""

from __future__ import annotations

import os
import time

import httpx
import pytest
import ray
from prometheus_client.parser import text_string_to_metric_families
from ray import serve

from cluster.serve_app import APP_NAME, build_application, validate_args
from cluster.serve_settings import API_KEY_ENV
from support.serve_process import free_port

pytestmark = pytest.mark.slow  # a Ray Serve deployment driven end to end (minutes): `make test-slow`

EXPORT_TIMEOUT_S = 120  # Ray's workers report every few seconds; its agent serves what it last received
MODEL = "tiny-dsa"


@pytest.fixture(scope="module")
def served():
    """(base URL of the app, URL of Ray's metrics export) over a local Ray started for this module."""
    metrics_port, http_port = free_port(), free_port()
    api_key = os.environ.pop(API_KEY_ENV, None)
    ray.init(address="local", num_cpus=4, include_dashboard=False, _metrics_export_port=metrics_port,
             log_to_driver=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": http_port})
        args = validate_args({"speculative_num_steps": 2, "served_model_name": [MODEL]})
        serve.run(build_application(args, 1), name=APP_NAME, route_prefix="/")
        yield f"http://127.0.0.1:{http_port}", f"http://127.0.0.1:{metrics_port}/metrics"
    finally:
        serve.shutdown()
        ray.shutdown()
        if api_key is not None:
            os.environ[API_KEY_ENV] = api_key


def series(text: str, prefix: str) -> dict[tuple, float]:
    """(name without `prefix`, labels) -> value of every `prefix` sample; histograms by count and bucket only."""
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.startswith(prefix) and not sample.name.endswith(("_created", "_sum", "_bucket")):
                out[(sample.name.removeprefix(prefix), tuple(sorted(sample.labels.items())))] = sample.value
    return out


def on_ray(expected: dict[tuple, float], exported: dict[tuple, float]) -> dict[tuple, tuple]:
    """The expected series Ray's export lacks or shows with another value: {series: (expected, exported)}.
    Ray's series carry more labels (WorkerId, NodeAddress, ...); a counter Ray never saw above 0 is absent."""
    by_labels: dict[tuple, float] = {}
    for (name, labels), value in exported.items():
        ours = tuple((k, v) for k, v in labels if k in ("replica", "model_name", "cp_rank", "position",
                                                        "finished_reason", "error_type"))
        by_labels[(name, ours)] = by_labels.get((name, ours), 0.0) + value
    default = {key: 0.0 for key in expected if key[0].endswith("_total")}
    return {key: (value, by_labels.get(key, default.get(key))) for key, value in expected.items()
            if by_labels.get(key, default.get(key)) != value}


def test_every_ingress_series_is_on_rays_metrics_export(served):
    base_url, export_url = served
    with httpx.Client(base_url=base_url, timeout=300) as client:
        for prompt in ("hello world", "the quick brown fox jumps over the lazy dog " * 3, "one two three"):
            body = {"model": MODEL, "prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
            assert client.post("/v1/completions", json=body).status_code == 200
        assert client.post("/v1/completions", json={"model": "other", "prompt": "x"}).status_code == 404
        expected = series(client.get("/metrics").text, "dsa_serve:")
    replicas = {dict(labels)["replica"] for _, labels in expected}
    assert {r.split("-")[0] for r in replicas} == {"engine", "ingress"} and len(replicas) == 2, replicas
    assert all(dict(labels)["model_name"] == MODEL for _, labels in expected)
    assert [v for (name, _), v in expected.items() if name == "request_queue_time_seconds_count"] == [3]
    deadline, missing = time.monotonic() + EXPORT_TIMEOUT_S, None
    while time.monotonic() < deadline:
        exported = series(httpx.get(export_url, timeout=30).text, "ray_dsa_serve_")
        missing = on_ray({(name.replace(":", "_"), labels): v for (name, labels), v in expected.items()}, exported)
        if not missing:
            break
        time.sleep(2)
    assert not missing, missing
    print("\n".join(sorted({f"ray_dsa_serve_{name}" for name, _ in exported})))


@pytest.mark.parametrize("argv, copied", [([], True), (["--no-ray-metrics-export"], False)])
def test_no_ray_metrics_export_leaves_the_metrics_on_the_ingress_only(monkeypatch, argv, copied):
    """`serve --no-ray-metrics-export` reaches IngressSettings; a replica's metrics then have no Ray mirror (the
    metrics of a process outside Serve never have one)."""
    from cluster import cli, ray_metrics
    from cluster.commands.serve import app_args

    args = app_args(cli.build_parser().parse_args(["serve", *argv]))
    assert args.ingress.ray_metrics_export is copied
    assert ray_metrics.replica_metrics("engine", MODEL, None, copied).mirror is None  # not a Serve replica
    monkeypatch.setattr(ray_metrics, "serve_replica_tag", lambda: "dsa-serve#DSAServer#abc")
    metrics = ray_metrics.replica_metrics("engine", MODEL, None, args.ingress.ray_metrics_export)
    assert isinstance(metrics.mirror, ray_metrics.RayMetricsMirror) is copied
    assert metrics.replica == "engine-dsa-serve#DSAServer#abc"
