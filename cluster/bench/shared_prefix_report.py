"""The report of `dsa-serve bench serve --workload shared-prefix`: per side and phase what the responses' usage says
(hit rate, prefilled tokens) and how fast (TTFT, tokens/s), the on / off ratios against their targets, the summary
lines and the plot. Pure arithmetic on load.RequestTiming lists and the result dict.
"""

from __future__ import annotations

import statistics
from pathlib import Path

from cluster.bench.load import summarize
from cluster.bench.serve_result import ratio

SIDES = ("on", "off")
PHASES = ("documents", "chat", "no_sharing")
# ratio name: (the phase, the block within a side (None: the side's own), the key, p50 or None, "<=" / ">=", limit)
RATIOS = {
    "cached_prefix_ttft_p50_ratio": ("documents", "later_questions", "ttft_s", "p50", "<=", 0.10),
    "chat_prefilled_tokens_ratio": ("chat", None, "prefilled_tokens", None, "<=", 0.20),
    "chat_ttft_p50_ratio": ("chat", None, "ttft_s", "p50", "<=", 0.25),
    "no_sharing_throughput_ratio": ("no_sharing", None, "median_round_output_tokens_per_s", None, ">=", 0.90),
}
DEFINITIONS = {
    "sides": "on: a server with the prefix cache (enable_prefix_caching), off: the same settings with "
             "--disable-radix-cache; both started here and up at once (or --url and --off-url); the cache-on "
             "server is flushed (POST /flush_cache) before each of its passes, so every pass starts cold",
    "order": "documents: on, then off; chat: on, then off; no sharing: --throughput-rounds rounds, on off, then "
             "off on, ...",
    "hit_rate": "sum of usage.prompt_tokens_details.cached_tokens / sum of usage.prompt_tokens over the phase's "
                "requests (a response without the field counts 0 cached)",
    "prefilled_tokens": "sum of prompt_tokens - cached_tokens: the prompt tokens the server computed",
    "documents": "concurrency 1: first_questions (each document's first question) then later_questions (the "
                 "others, each sharing its first doc_len tokens with an answered request)",
    "chat": "every conversation at once, its turns one after the other; each turn resends the previous prompt, "
            "the previous answer (its text encoded with the checkpoint's tokenizer) and a new user part",
    "no_sharing": "--num-prompts distinct random prompts at --concurrency streams, per round; "
                  "median_round_output_tokens_per_s: the median over the rounds",
    "ttft_s": "first streamed chunk - request sent",
    "output_tokens_per_s": "output tokens / wall seconds of the phase (all its passes)",
    "cached_prefix_ttft_p50_ratio": "documents: TTFT p50 of the later questions (the first doc_len tokens cached), "
                                    "on / off (target <= 0.1)",
    "chat_prefilled_tokens_ratio": "chat: prefilled tokens on / off (target <= 0.2)",
    "chat_ttft_p50_ratio": "chat: TTFT p50 on / off (target <= 0.25)",
    "no_sharing_throughput_ratio": "no sharing: median round output tokens/s on / off (target >= 0.9)",
}


def side_summary(timings: list, wall_s: float) -> dict:
    """load.summarize plus the usage totals: prompt, cached and prefilled tokens and the hit rate."""
    prompt = sum(t.prompt_tokens for t in timings)
    cached = sum(t.cached_tokens or 0 for t in timings)
    return {**summarize(timings, wall_s), "prompt_tokens": prompt, "cached_tokens": cached,
            "prefilled_tokens": prompt - cached, "hit_rate": cached / prompt if prompt else None,
            "cached_tokens_reported": sum(t.cached_tokens is not None for t in timings),
            "prompt_tokens_per_s": prompt / wall_s if wall_s else None}


def documents_summary(first: tuple[list, float], later: tuple[list, float]) -> dict:
    """Both passes together, and each on its own."""
    return {**side_summary(first[0] + later[0], first[1] + later[1]),
            "first_questions": side_summary(*first), "later_questions": side_summary(*later)}


def no_sharing_summary(rounds: list[tuple[list, float]]) -> dict:
    """All rounds together, each round's output tokens/s and their median."""
    per_round = [summarize(timings, wall_s)["output_tokens_per_s"] for timings, wall_s in rounds]
    pooled = side_summary([t for timings, _ in rounds for t in timings], sum(wall for _, wall in rounds))
    return {**pooled, "round_output_tokens_per_s": per_round,
            "median_round_output_tokens_per_s": statistics.median(per_round)}


def ratio_value(phases: dict, name: str) -> float | None:
    """Ratio `name` of RATIOS: the cache-on side's value over the cache-off side's (None when a side is missing)."""
    phase, block, key, q, _, _ = RATIOS[name]

    def value(side: str):
        measured = (phases.get(phase) or {}).get(side)
        if measured is None:
            return None
        measured = measured[block] if block else measured
        return measured[key][q] if q else measured[key]

    return ratio(value("on"), value("off"))


def ratios_and_targets(phases: dict) -> tuple[dict, dict]:
    """({ratio name: value}, {ratio name: {"target": "<= 0.1", "met": True / False / None}})."""
    values = {name: ratio_value(phases, name) for name in RATIOS}
    targets = {}
    for name, (*_, sign, limit) in RATIOS.items():
        value = values[name]
        met = None if value is None else (value <= limit if sign == "<=" else value >= limit)
        targets[name] = {"target": f"{sign} {limit:g}", "met": met}
    return values, targets


def _fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def side_line(phase: str, side: str, measured: dict) -> str:
    ttft = measured["ttft_s"]
    return (f"{phase} {side}: {measured['num_requests']} requests, hit rate {_fmt(measured['hit_rate'], '.1%')}, "
            f"prefilled {measured['prefilled_tokens']} of {measured['prompt_tokens']} prompt tokens, TTFT p50 "
            f"{_fmt(ttft['p50'], '.3f')}s p90 {_fmt(ttft['p90'], '.3f')}s, "
            f"{measured['output_tokens_per_s']:.1f} tok/s")


def summary_text(result: dict) -> str:
    lines = []
    for phase in PHASES:
        for side, measured in result["phases"][phase].items():
            lines.append(side_line(phase, side, measured))
            if phase == "documents":
                lines.append(side_line("  later questions", side, measured["later_questions"]))
    for name, value in result["ratios"].items():
        target = result["targets"][name]
        verdict = {True: "met", False: "missed", None: "not measured"}[target["met"]]
        lines.append(f"{name}: {_fmt(value, '.3f')} (target {target['target']}: {verdict})")
    return "\n".join(lines)


def phase_values(result: dict, side: str, pick) -> list[float]:
    nan = float("nan")
    return [pick(result["phases"][phase][side]) if side in result["phases"][phase] else nan for phase in PHASES]


def plot(result: dict, path: str) -> None:
    """Three panels, cache on against off per phase: TTFT p50 (documents: the later questions), prefilled
    tokens, output tokens/s."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    picks = [("TTFT p50 (s; documents: the later questions)", lambda m: (m.get("later_questions") or m)["ttft_s"]["p50"] or float("nan")),
             ("prefilled tokens", lambda m: m["prefilled_tokens"]),
             ("output tokens/s", lambda m: m["output_tokens_per_s"])]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.4))
    for ax, (title, pick) in zip(axes, picks):
        for j, side in enumerate(SIDES):
            ax.bar([i + (j - 0.5) * 0.4 for i in range(len(PHASES))], phase_values(result, side, pick), 0.4,
                   label=f"cache {side}")
        ax.set_xticks(range(len(PHASES)), list(PHASES))
        ax.set(title=title)
        ax.legend()
    sizes = result["sizes"]
    fig.suptitle(f"bench serve --workload shared-prefix: {Path(result['model']).name}, cp_size "
                 f"{result['server']['cp_size']}, {sizes['num_docs']} x {sizes['doc_len']}-token documents, "
                 f"{sizes['conversations']} x {sizes['turns']} chat turns")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
