"""The issue #19 serving targets read the short workload's 1- and 32-stream runs, HTTP against in-process."""

from benchmarks.targets import TARGETS, evaluate


def serve_result(ttft_ratio_1: float, http_32: float, local_32: float, transformers_32: float) -> dict:
    runs = [
        {"concurrency": 1, "ttft_p50_ratio": ttft_ratio_1, "output_tokens_per_s": 50.0,
         "in_process": {"output_tokens_per_s": 50.0}, "transformers": {"output_tokens_per_s": 60.0}},
        {"concurrency": 32, "ttft_p50_ratio": 4.0, "output_tokens_per_s": http_32,
         "in_process": {"output_tokens_per_s": local_32}, "transformers": {"output_tokens_per_s": transformers_32}},
    ]
    return {"bench": "serve", "runs": runs}


def verdicts(result: dict) -> dict[str, tuple[str, str]]:
    return {target.name: (text, verdict) for target, text, verdict in evaluate({"serve": [result]})}


def find(rows: dict, prefix: str) -> tuple[str, str]:
    (match,) = [value for name, value in rows.items() if name.startswith(prefix)]
    return match


def test_targets_met():
    rows = verdicts(serve_result(ttft_ratio_1=1.10, http_32=920.0, local_32=1000.0, transformers_32=900.0))
    assert find(rows, "serving TTFT p50") == ("1.100", "PASS")  # the 32-stream 4.0 is not this target's
    assert find(rows, "serving tokens/s HTTP") == ("0.92x (920.0 vs 1000.0 tok/s)", "PASS")
    assert find(rows, "short-prompt decode in process") == ("1.11x (1000.0 vs 900.0 tok/s)", "PASS")


def test_targets_missed():
    rows = verdicts(serve_result(ttft_ratio_1=1.22, http_32=680.0, local_32=1000.0, transformers_32=1100.0))
    assert find(rows, "serving TTFT p50")[1] == "MISS"
    assert find(rows, "serving tokens/s HTTP") == ("0.68x (680.0 vs 1000.0 tok/s)", "MISS")
    assert find(rows, "short-prompt decode in process")[1] == "MISS"


def test_long_workload_runs_are_not_short_targets():
    result = serve_result(1.0, 950.0, 1000.0, 900.0) | {"workload": "long"}
    rows = verdicts(result)
    assert find(rows, "serving tokens/s HTTP") == ("not measured", "not measured")
    assert len(rows) == len(TARGETS)
