"""/metrics when engine replicas do not answer: the ones that did are merged, the others counted and logged,
and the scrape still answers 200 (ServeEngineClient over a fake deployment handle, the ingress over it)."""

from __future__ import annotations

import asyncio
import logging

import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from cluster.http_api.ingress import build_app
from cluster.serve_client import ServeEngineClient
from cluster.serve_settings import IngressSettings
from cp_router.metrics import MetricsScrapeError, ServeMetrics
from support.http_fakes import INFO, FakeEngine, write_checkpoint_files


class Broadcast:
    def __init__(self, results: list):
        self.results = results

    async def results_async(self, timeout_s: float, return_exceptions: bool = False) -> list:
        failures = [r for r in self.results if isinstance(r, BaseException)]
        if failures and not return_exceptions:
            raise failures[0]
        return self.results


class Handle:
    """The broadcast half of a DeploymentHandle: one result per engine replica (a text, or its exception)."""

    def __init__(self, results: list):
        self.results = results

    def broadcast(self, method: str) -> Broadcast:
        assert method == "metrics_text"
        return Broadcast(self.results)


def engine_text(replica: str) -> str:
    metrics = ServeMetrics(replica, INFO.name)
    metrics.set_requests(running=2, waiting=0)
    return metrics.render()


def running(text: str) -> dict[str, float]:
    return {s.labels["replica"]: s.value for family in text_string_to_metric_families(text) for s in family.samples
            if s.name == "dsa_serve:num_requests_running"}


def scrape_errors(text: str) -> dict[str, float]:
    return {s.labels["replica"]: s.value for family in text_string_to_metric_families(text) for s in family.samples
            if s.name == "dsa_serve:metrics_scrape_errors_total"}


def test_the_client_merges_the_replicas_that_answered_and_names_the_others():
    client = ServeEngineClient(Handle([engine_text("engine-a"), RuntimeError("replica died"), engine_text("engine-c")]),
                               INFO)
    with pytest.raises(MetricsScrapeError) as raised:
        asyncio.run(client.metrics_text())
    assert raised.value.failures == ["RuntimeError: replica died"]
    assert running(raised.value.text) == {"engine-a": 2, "engine-c": 2}
    whole = ServeEngineClient(Handle([engine_text("engine-a"), engine_text("engine-c")]), INFO)
    assert running(asyncio.run(whole.metrics_text())) == {"engine-a": 2, "engine-c": 2}


@pytest.fixture
def checkpoint(tmp_path):
    return write_checkpoint_files(tmp_path)


def test_one_failing_replica_does_not_fail_the_scrape(checkpoint, caplog):
    handle = Handle([engine_text("engine-a"), RuntimeError("replica died"), engine_text("engine-c")])
    settings = IngressSettings(model_dir=str(checkpoint), metrics_replica="ingress-0")
    client = TestClient(build_app(ServeEngineClient(handle, INFO), settings))
    with caplog.at_level(logging.WARNING, logger="dsa_serve.metrics"):
        first, second = client.get("/metrics"), client.get("/metrics")
    assert first.status_code == second.status_code == 200
    assert running(second.text) == {"engine-a": 2, "engine-c": 2}
    assert scrape_errors(second.text) == {"ingress-0": 2}  # one replica missed each of two scrapes
    lines = [r.getMessage() for r in caplog.records if r.name == "dsa_serve.metrics"]
    assert lines == ["metrics scrape: 1 engine replica(s) did not answer: RuntimeError: replica died"] * 2


def test_no_engine_answering_still_serves_the_ingress_metrics(checkpoint, caplog):
    engine = FakeEngine()

    async def unreachable() -> str:
        raise TimeoutError("Timed out waiting for broadcast results.")

    engine.metrics_text = unreachable
    app = build_app(engine, IngressSettings(model_dir=str(checkpoint), metrics_replica="ingress-0"))
    with caplog.at_level(logging.WARNING, logger="dsa_serve.metrics"):
        response = TestClient(app).get("/metrics")
    assert response.status_code == 200 and scrape_errors(response.text) == {"ingress-0": 1}
    assert "engine metrics unavailable: TimeoutError" in caplog.text
