"""The Grafana dashboard shows what operators watch: mean acceptance length and acceptance per draft position,
KV use per CP rank, the request histograms; every query is narrowed by the model and replica variables."""

from __future__ import annotations

import json
from pathlib import Path

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "dsa-serve-dashboard.json"
SELECTOR = '{model_name=~"$model_name",replica=~"$replica"'


def panels() -> dict[str, list[dict]]:
    return {panel["title"]: panel["targets"] for panel in json.loads(DASHBOARD.read_text())["panels"]}


def test_every_query_is_narrowed_by_model_and_replica():
    dashboard = json.loads(DASHBOARD.read_text())
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["model_name"]["query"] == "label_values(dsa_serve:num_requests_running, model_name)"
    assert 'model_name=~"$model_name"' in variables["replica"]["query"]
    for title, targets in panels().items():
        for target in targets:
            metrics = target["expr"].count("dsa_serve:")
            assert metrics and target["expr"].count(SELECTOR) == metrics, (title, target["expr"])


def test_acceptance_length_per_position_and_kv_use_panels():
    by_title = panels()
    (length,) = by_title["Mean acceptance length (1 + accepted / drafts)"]
    assert length["expr"].startswith("1 + sum by (replica) (rate(dsa_serve:spec_decode_num_accepted_tokens_total")
    assert "/ sum by (replica) (rate(dsa_serve:spec_decode_num_drafts_total" in length["expr"]
    per_position = by_title["Draft acceptance by position and overall"][0]
    assert per_position["expr"].startswith("sum by (position) (rate(dsa_serve:spec_decode_num_accepted_tokens_per_pos")
    assert "{{position}}" in per_position["legendFormat"]
    (kv,) = by_title["KV cache usage per CP rank (used / total pages)"]
    assert "dsa_serve:kv_pages_used" in kv["expr"].split(" / ")[0] and "kv_pages_total" in kv["expr"].split(" / ")[1]
    assert "{{cp_rank}}" in kv["legendFormat"]


def test_the_request_histograms_have_quantile_panels():
    exprs = [target["expr"] for targets in panels().values() for target in targets]
    quantiles = " ".join(expr for expr in exprs if "histogram_quantile" in expr)
    for name in ("request_queue_time_seconds", "request_prefill_time_seconds", "request_decode_time_seconds",
                 "request_time_per_output_token_seconds", "request_prompt_tokens", "request_generation_tokens"):
        assert f"dsa_serve:{name}_bucket" in quantiles, name
