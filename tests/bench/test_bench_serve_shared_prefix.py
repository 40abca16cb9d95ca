"""`dsa-serve bench serve --workload shared-prefix`: its requests (documents share their prefix, chat turns resend the
conversation, the no-sharing prompts share nothing), the usage it reads from a stream, the report arithmetic from
usage numbers, the harness's table and targets, flag errors, and one end-to-end run against the two servers it
starts (cache on and off; the default model at --cp-size 1)."""

from __future__ import annotations

import asyncio
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.cli import main as harness_main
from benchmarks.tables import serve_table
from benchmarks.targets import evaluate
from cluster.bench.load import RequestTiming, apply_sse_line
from cluster.bench.shared_prefix import (
    Conversation, Sizes, conversations, distinct_prompts, document_passes, kv_pages, longest_prompt,
    run_conversation, run_conversations,
)
from cluster.bench.shared_prefix_report import (
    RATIOS, documents_summary, no_sharing_summary, ratios_and_targets, side_summary, summary_text,
)
from cluster.cli import main as cli_main

REPO = Path(__file__).resolve().parents[2]
SIZES = Sizes(doc_len=10, num_docs=3, questions_per_doc=3, question_len=4, conversations=2, turns=3, prompt_len=5,
              num_prompts=6)
VOCAB = 100


def test_questions_about_a_document_share_exactly_the_document():
    first, later = document_passes(SIZES, VOCAB)
    assert (len(first), len(later)) == (3, 6) and {len(p) for p in first + later} == {14}
    assert all(1 <= token < VOCAB for p in first + later for token in p)
    for index, prompt in enumerate(later):  # question by question: later[(j - 1) * num_docs + d]
        document = index % SIZES.num_docs
        assert prompt[:10] == first[document][:10] and prompt[10:] != first[document][10:]
    assert len({tuple(p[:10]) for p in first}) == 3  # three different documents
    assert len({tuple(p[10:]) for p in first + later}) == 9  # every question its own
    assert document_passes(SIZES, VOCAB) == (first, later)  # the same ids every run


def test_each_chat_turn_resends_the_conversation_and_its_answer():
    sent = []

    async def send(ids: list[int]) -> RequestTiming:
        sent.append(ids)
        return RequestTiming(0.0, [0.1], 2, texts=[f"a{len(sent)}", "!"])

    def encode(text: str) -> list[int]:
        return [ord(c) for c in text]

    conversation = Conversation(opening=[1, 2, 3], user_parts=[[7, 8], [9]])
    timings = asyncio.run(run_conversation(send, conversation, encode))
    assert len(timings) == 3
    assert sent == [[1, 2, 3], [1, 2, 3, *encode("a1!"), 7, 8], [1, 2, 3, *encode("a1!"), 7, 8, *encode("a2!"), 9]]

    built = conversations(SIZES, VOCAB)
    assert len(built) == 2 and all(len(c.opening) == 14 and len(c.user_parts) == 2 for c in built)
    first, _ = document_passes(SIZES, VOCAB)
    assert built[0].opening[:10] != built[1].opening[:10]
    assert all(c.opening[:10] != p[:10] for c in built for p in first)  # not the documents' phase's
    sent.clear()
    all_turns, wall_s = asyncio.run(run_conversations(send, built, encode))
    assert len(all_turns) == len(sent) == 6 and wall_s >= 0


def test_no_sharing_prompts_start_differently_and_the_cache_is_sized_for_everything_held():
    prompts = distinct_prompts(SIZES, VOCAB)
    assert len(prompts) == 6 and {len(p) for p in prompts} == {5} and len({p[0] for p in prompts}) == 6
    longest = longest_prompt(SIZES, max_tokens=8)
    assert longest == 10 + 4 + 2 * (2 * 8 + 4)  # the last chat turn, answers counted twice over
    pages = -(-(longest + 8 + 2 + 1) // 16) + 1
    assert kv_pages(SIZES, 8, 16, concurrency=2, speculative_steps=2) == (3 + 2 + 1) * pages


def test_the_streamed_usage_gives_prompt_and_cached_tokens():
    timing = RequestTiming(0.0)
    apply_sse_line(timing, 'data: {"choices": [{"text": "ab"}], "usage": null}', 1.0)
    apply_sse_line(timing, 'data: {"choices": [], "usage": {"prompt_tokens": 300, "completion_tokens": 4, '
                           '"prompt_tokens_details": {"cached_tokens": 256}}}', 1.1)
    assert (timing.tokens, timing.prompt_tokens, timing.cached_tokens, timing.text) == (4, 300, 256, "ab")
    plain = RequestTiming(0.0)
    apply_sse_line(plain, 'data: {"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 1}}', 1.0)
    assert (plain.prompt_tokens, plain.cached_tokens) == (9, None)


def timed(ttft: float, prompt: int, cached: int | None, tokens: int = 4) -> RequestTiming:
    return RequestTiming(0.0, [ttft, ttft + 0.1], tokens, prompt_tokens=prompt, cached_tokens=cached)


def measured_phases() -> dict:
    """Usage and timings as a cache-on and a cache-off server would answer: documents of 1000 tokens asked twice,
    a two-turn chat, three rounds of unshared prompts."""
    on_docs = documents_summary(([timed(2.0, 1032, 0)], 2.5), ([timed(0.1, 1032, 1000)], 0.5))
    off_docs = documents_summary(([timed(2.0, 1032, 0)], 2.5), ([timed(2.0, 1032, None)], 2.5))
    chat_on = side_summary([timed(2.0, 1032, 0), timed(0.2, 1100, 1024), timed(0.3, 1168, 1088)], 4.0)
    chat_off = side_summary([timed(2.0, 1032, 0), timed(2.1, 1100, 0), timed(2.2, 1168, 0)], 8.0)
    rounds = {"on": [([timed(0.1, 16, 0, 40)], 1.0), ([timed(0.1, 16, 0, 40)], 2.0), ([timed(0.1, 16, 0, 40)], 1.0)],
              "off": [([timed(0.1, 16, 0, 40)], 1.0), ([timed(0.1, 16, 0, 40)], 1.0), ([timed(0.1, 16, 0, 40)], 2.0)]}
    return {"documents": {"on": on_docs, "off": off_docs}, "chat": {"on": chat_on, "off": chat_off},
            "no_sharing": {side: no_sharing_summary(r) for side, r in rounds.items()}}


def test_report_arithmetic_from_usage_numbers():
    phases = measured_phases()
    on_docs, off_docs = phases["documents"]["on"], phases["documents"]["off"]
    assert (on_docs["prompt_tokens"], on_docs["cached_tokens"], on_docs["prefilled_tokens"]) == (2064, 1000, 1064)
    assert on_docs["hit_rate"] == pytest.approx(1000 / 2064) and on_docs["num_requests"] == 2
    assert on_docs["later_questions"]["hit_rate"] == pytest.approx(1000 / 1032)
    assert (off_docs["cached_tokens"], off_docs["cached_tokens_reported"], off_docs["hit_rate"]) == (0, 1, 0.0)
    assert on_docs["output_tokens_per_s"] == pytest.approx(8 / 3.0)
    assert phases["no_sharing"]["on"]["round_output_tokens_per_s"] == [40.0, 20.0, 40.0]
    assert phases["no_sharing"]["on"]["median_round_output_tokens_per_s"] == 40.0
    values, targets = ratios_and_targets(phases)
    assert values["cached_prefix_ttft_p50_ratio"] == pytest.approx(0.1 / 2.0)
    assert values["chat_prefilled_tokens_ratio"] == pytest.approx((3300 - 2112) / 3300)
    assert values["chat_ttft_p50_ratio"] == pytest.approx(0.3 / 2.1)
    assert values["no_sharing_throughput_ratio"] == pytest.approx(1.0)
    assert {name: t["met"] for name, t in targets.items()} == {
        "cached_prefix_ttft_p50_ratio": True, "chat_prefilled_tokens_ratio": False, "chat_ttft_p50_ratio": True,
        "no_sharing_throughput_ratio": True}
    assert targets["chat_prefilled_tokens_ratio"]["target"] == "<= 0.2"
    only_on = {phase: {"on": sides["on"]} for phase, sides in phases.items()}  # --url without --off-url
    values, targets = ratios_and_targets(only_on)
    assert set(values.values()) == {None} and {t["met"] for t in targets.values()} == {None}


def shared_prefix_result(doc_len: int = 8192) -> dict:
    phases = measured_phases()
    values, targets = ratios_and_targets(phases)
    sizes = {"doc_len": doc_len, "num_docs": 1, "questions_per_doc": 2, "question_len": 32, "conversations": 1,
             "turns": 3, "prompt_len": 16, "num_prompts": 1}
    return {"bench": "serve", "workload": "shared-prefix", "model": "default_model", "concurrency": 32,
            "server": {"cp_size": 2, "direct_ingress": True}, "sizes": sizes, "phases": phases, "ratios": values,
            "targets": targets}


def test_the_harness_tables_and_judges_a_shared_prefix_result(tmp_path):
    from cluster.bench.plot import save_plot

    result = shared_prefix_result()
    table = "\n".join(serve_table(result))
    assert "documents: later questions" in table and "chat_prefilled_tokens_ratio" in table
    (tmp_path / "results").mkdir()
    (tmp_path / "results" / "serve_shared_prefix.json").write_text(json.dumps(
        {**result, "command": "dsa-serve bench serve --workload shared-prefix --json"}))
    assert harness_main(["report", "--results", str(tmp_path / "results"), "--out", str(tmp_path / "B.md"),
                         "--plots-dir", str(tmp_path / "plots")]) == 0
    report = (tmp_path / "B.md").read_text()
    assert "| chat_ttft_p50_ratio |" in report and (tmp_path / "plots" / "serve_shared_prefix.png").is_file()
    rows = {target.name: (text, verdict) for target, text, verdict in evaluate({"serve": [result]})}
    prefix_rows = {name: row for name, row in rows.items() if name.startswith("prefix cache")}
    assert [verdict for _, verdict in prefix_rows.values()] == ["PASS", "MISS", "PASS", "PASS"]
    short_docs = {t.name: v for t, _, v in evaluate({"serve": [shared_prefix_result(doc_len=4096)]})}
    assert short_docs["prefix cache: TTFT of a request whose first 8k tokens are cached <= 0.1x cache off"] == (
        "not measured")
    text = summary_text(result)
    assert "later questions on" in text and "chat_prefilled_tokens_ratio: 0.360 (target <= 0.2: missed)" in text
    save_plot(result, str(tmp_path / "shared.png"))
    assert (tmp_path / "shared.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize("flags, named", [
    (["--doc-len", "0"], "--doc-len"), (["--turns", "0"], "--turns"), (["--concurrency", "8,32"], "--concurrency"),
    (["--off-url", "http://127.0.0.1:1"], "--off-url"), (["--no-skip-in-process"], "--no-skip-in-process"),
    (["--url", "http://127.0.0.1:1", "--off-url", "localhost:2"], "--off-url"),
])
def test_invalid_flags_exit_2_naming_the_flag(capsys, flags, named):
    assert cli_main(["bench", "serve", "--workload", "shared-prefix", *flags]) == 2
    assert named in capsys.readouterr().err


def test_workload_flags_belong_to_their_workload(capsys):
    assert cli_main(["bench", "serve", "--num-docs", "2"]) == 2
    assert "--num-docs is a --workload shared-prefix flag" in capsys.readouterr().err
    assert harness_main(["serve", "--workload", "shared-prefix", "--long-prompt-lens", "4096"]) == 2
    assert "--long-prompt-lens is a --workload long flag" in capsys.readouterr().err
    assert harness_main(["serve", "--workload", "long", "--turns", "2"]) == 2


def test_ratio_names_are_the_targets():
    assert set(RATIOS) == {"cached_prefix_ttft_p50_ratio", "chat_prefilled_tokens_ratio", "chat_ttft_p50_ratio",
                           "no_sharing_throughput_ratio"}


E2E_COMMAND = ["bench", "serve", "--workload", "shared-prefix", "--doc-len", "256", "--num-docs", "2",
               "--questions-per-doc", "2", "--turns", "2", "--conversations", "1", "--cp-size", "1",
               "--concurrency", "2", "--num-prompts", "4", "--max-tokens", "4", "--throughput-rounds", "1",
               "--warmup", "1", "--json"]


@pytest.mark.slow
def test_shared_prefix_end_to_end_against_the_two_servers_it_starts():
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    done = subprocess.run([sys.executable, "-m", "cluster.cli", *E2E_COMMAND], capture_output=True, text=True,
                          timeout=900, env=env, cwd=REPO)
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads(done.stdout.splitlines()[-1])
    assert (result["workload"], result["server"]["cp_size"]) == ("shared-prefix", 1)
    phases = result["phases"]
    for side in ("on", "off"):
        docs, chat, unshared = phases["documents"][side], phases["chat"][side], phases["no_sharing"][side]
        assert (docs["num_requests"], chat["num_requests"], unshared["num_requests"]) == (4, 2, 4)
        assert docs["prompt_tokens"] == 4 * (256 + 32) and docs["tokens_per_request"] == [4]
        assert unshared["cached_tokens"] == 0 and docs["first_questions"]["cached_tokens"] == 0
    off, on = {p: phases[p]["off"] for p in phases}, {p: phases[p]["on"] for p in phases}
    assert all(m["cached_tokens"] == 0 and m["prefilled_tokens"] == m["prompt_tokens"] for m in off.values())
    assert on["documents"]["later_questions"]["hit_rate"] >= 192 / 288  # at least 3 of each document's 4 pages
    assert on["chat"]["cached_tokens"] >= 192 and on["chat"]["prefilled_tokens"] < off["chat"]["prefilled_tokens"]
    for name, value in result["ratios"].items():
        assert isinstance(value, float) and math.isfinite(value) and value > 0, (name, value)
        assert result["targets"][name]["met"] in (True, False)
