"""`bench prefill`'s timing loop: the configs take turns prefill by prefill, and each keeps its median run."""

from types import SimpleNamespace

import cluster.bench.prefill_runs as prefill_runs
from cluster.engine_spec import EngineOptions


def test_configs_take_turns_and_each_keeps_its_median(monkeypatch):
    calls = []
    walls = iter([0.3, 0.9, 0.1, 0.8, 0.2, 0.7, 0.5, 0.4, 0.6, 0.45, 0.55, 0.35])  # a, b, a, b, ... per length

    def fake_spec(model, cp, options):  # the engine spec without reading a checkpoint
        return SimpleNamespace(cp=cp, options=options)

    def fake_engine(spec, workers):
        return SimpleNamespace(name=workers, budget=spec.options.prefill_token_budget)

    async def fake_prefill_once(engine, prompt, request_id):
        calls.append((engine.name, len(prompt), request_id))
        return {"wall_s": 0.0 if request_id.endswith("warm-0") else next(walls), "engine": engine.name,
                "budget": engine.budget}

    monkeypatch.setattr(prefill_runs, "resolve_engine_spec", fake_spec)
    monkeypatch.setattr(prefill_runs, "engine_over_workers", fake_engine)
    monkeypatch.setattr(prefill_runs, "_prefill_once", fake_prefill_once)
    one, two = SimpleNamespace(cp_size=1), SimpleNamespace(cp_size=2)
    options = EngineOptions(prefill_token_budget=None)
    prompts = {512: [1] * 512, 4096: [2] * 4096}
    timed = prefill_runs.interleaved_prefills("model", [(one, "a", options), (two, "b", options)], prompts, 3,
                                              ("served",))
    order = [(name, n) for name, n, request_id in calls if not request_id.endswith("warm-0")]
    assert order == [(c, n) for n in (512, 4096) for _ in range(3) for c in ("a", "b")]  # turns, not blocks
    assert [timed[0]["served"][n]["wall_s"] for n in prompts] == [0.2, 0.55]  # medians of a's three runs each
    assert [timed[1]["served"][n]["wall_s"] for n in prompts] == [0.8, 0.4]
    assert timed[0]["served"][512]["budget"] == 2048 and timed[1]["served"][512]["budget"] == 4096  # per rank
