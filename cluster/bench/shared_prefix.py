"""The shared-prefix workload of `dsa-serve bench serve`: its flags and its requests (pure functions).

Every prompt is random token ids of the model's vocabulary (1..vocab_size-1; 0 is the default model's EOS), drawn
from generators seeded by name, so nothing downloads and every run, and both sides of a run, send the same ids.

* documents: --num-docs documents of --doc-len tokens, each asked --questions-per-doc questions; a question is its
  document followed by --question-len tokens of its own. `document_passes` gives two passes: every document's
  first question, then the others question by question (each of those shares its first --doc-len tokens with a
  request already answered).
* chat: --conversations conversations of --turns turns. Turn 0 is an opening document of --doc-len tokens (not
  one of the documents above) plus a user part of --question-len tokens; turn t + 1 resends turn t's prompt, turn
  t's answer (its text encoded again, as a chat client resends the text it got) and a new user part
  (`next_prompt`, `run_conversation`).
* no sharing: --num-prompts distinct prompts of --prompt-len tokens (16 unless given).
"""

from __future__ import annotations

import argparse
import random
import time
from dataclasses import dataclass
from typing import Awaitable, Callable

WORKLOAD = "shared-prefix"
DEFAULTS = {"doc_len": 8192, "num_docs": 4, "questions_per_doc": 4, "question_len": 32, "conversations": 2,
            "turns": 8, "throughput_rounds": 3}
DEFAULT_CONCURRENCY, DEFAULT_PROMPT_LEN = "32", 16
FLAG_HELP = {
    "doc_len": "tokens per document, and per chat opening (default 8192; 4096 for 4k documents)",
    "num_docs": "documents (default 4)",
    "questions_per_doc": "questions per document (default 4)",
    "question_len": "tokens per question and per chat user part (default 32)",
    "conversations": "chat conversations, all running at once (default 2)",
    "turns": "turns per conversation; each resends the conversation so far (default 8)",
    "throughput_rounds": "alternating cache-on / cache-off rounds of the no-sharing phase (default 3)",
}


def add_shared_prefix_arguments(bench: argparse.ArgumentParser) -> None:
    """The workload's own flags (None until `resolve_shared_prefix` fills in the defaults)."""
    for name, text in FLAG_HELP.items():
        bench.add_argument("--" + name.replace("_", "-"), type=int, default=None, help=f"--workload {WORKLOAD}: {text}")
    bench.add_argument("--off-url", default=None,
                       help=f"--workload {WORKLOAD} with --url: a second running server, started with "
                            "--disable-radix-cache, measured as the cache-off side")


def reject_shared_prefix_flags(args: argparse.Namespace) -> None:
    """ValueError naming a shared-prefix flag given to another workload."""
    for name in [*FLAG_HELP, "off_url"]:
        if getattr(args, name, None) is not None:
            flag = "--" + name.replace("_", "-")
            raise ValueError(f"{flag} is a --workload {WORKLOAD} flag (this run is --workload {args.workload})")


def resolve_shared_prefix(args: argparse.Namespace) -> None:
    """Fills the workload's defaults into `args` (serve.py `check_arguments` calls it); ValueError naming the flag
    out of range."""
    for name, default in DEFAULTS.items():
        value = default if getattr(args, name) is None else getattr(args, name)
        if value < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
        setattr(args, name, value)
    if args.skip_in_process is False:
        raise ValueError(f"--no-skip-in-process: --workload {WORKLOAD} compares two servers, no in-process engine")
    args.skip_in_process = True
    args.concurrency = args.concurrency or DEFAULT_CONCURRENCY
    if "," in args.concurrency:
        raise ValueError(f"--concurrency: --workload {WORKLOAD} takes one level (its no-sharing phase), got "
                         f"{args.concurrency!r}")
    args.prompt_len = args.prompt_len or DEFAULT_PROMPT_LEN
    if args.off_url is not None and args.url is None:
        raise ValueError("--off-url is the cache-off side of a --url run; without --url both servers start here")
    if args.off_url is not None and not args.off_url.startswith(("http://", "https://")):
        raise ValueError(f"--off-url must start with http:// or https://, got {args.off_url!r}")


@dataclass(frozen=True)
class Sizes:
    doc_len: int
    num_docs: int
    questions_per_doc: int
    question_len: int
    conversations: int
    turns: int
    prompt_len: int
    num_prompts: int

    @classmethod
    def from_args(cls, args: argparse.Namespace, num_prompts: int) -> "Sizes":
        return cls(args.doc_len, args.num_docs, args.questions_per_doc, args.question_len, args.conversations,
                   args.turns, args.prompt_len, num_prompts)


def random_ids(generator: random.Random, vocab_size: int, count: int) -> list[int]:
    return [generator.randrange(1, vocab_size) for _ in range(count)]


def document_passes(sizes: Sizes, vocab_size: int) -> tuple[list[list[int]], list[list[int]]]:
    """(every document's first question, the other questions ordered question by question)."""
    generator = random.Random(f"{WORKLOAD}/documents")
    documents = [random_ids(generator, vocab_size, sizes.doc_len) for _ in range(sizes.num_docs)]
    questions = [[doc + random_ids(generator, vocab_size, sizes.question_len) for _ in range(sizes.questions_per_doc)]
                 for doc in documents]
    later = [questions[d][j] for j in range(1, sizes.questions_per_doc) for d in range(sizes.num_docs)]
    return [asked[0] for asked in questions], later


@dataclass(frozen=True)
class Conversation:
    opening: list[int]  # turn 0's prompt
    user_parts: list[list[int]]  # what turns 1.. add after the previous answer


def conversations(sizes: Sizes, vocab_size: int) -> list[Conversation]:
    generator = random.Random(f"{WORKLOAD}/chat")
    return [Conversation(random_ids(generator, vocab_size, sizes.doc_len + sizes.question_len),
                         [random_ids(generator, vocab_size, sizes.question_len) for _ in range(sizes.turns - 1)])
            for _ in range(sizes.conversations)]


def distinct_prompts(sizes: Sizes, vocab_size: int) -> list[list[int]]:
    """--num-prompts prompts of --prompt-len tokens, no two starting with the same token (nothing to share)."""
    generator = random.Random(f"{WORKLOAD}/no-sharing")
    firsts = generator.sample(range(1, vocab_size), min(sizes.num_prompts, vocab_size - 1))
    return [[firsts[i % len(firsts)], *random_ids(generator, vocab_size, sizes.prompt_len - 1)]
            for i in range(sizes.num_prompts)]


def next_prompt(prompt: list[int], answer_ids: list[int], user_ids: list[int]) -> list[int]:
    """The next turn's prompt: the whole conversation so far, then the new user part."""
    return [*prompt, *answer_ids, *user_ids]


async def run_conversation(send: Callable[[list[int]], Awaitable], conversation: Conversation,
                           encode: Callable[[str], list[int]]) -> list:
    """The turns of one conversation, one after the other; `send(ids)` returns a load.RequestTiming whose `text`
    is the answer; its timings in turn order."""
    timings = [await send(conversation.opening)]
    prompt = conversation.opening
    for user_ids in conversation.user_parts:
        prompt = next_prompt(prompt, encode(timings[-1].text), user_ids)
        timings.append(await send(prompt))
    return timings


async def run_conversations(send: Callable, all_conversations: list[Conversation],
                            encode: Callable[[str], list[int]]) -> tuple[list, float]:
    """Every conversation at once; (the timings of all turns, wall seconds)."""
    import asyncio

    start = time.perf_counter()
    per_conversation = await asyncio.gather(*[run_conversation(send, c, encode) for c in all_conversations])
    return [timing for timings in per_conversation for timing in timings], time.perf_counter() - start


ANSWER_SLACK = 2  # an answer's text encoded again may take more tokens than were generated


def longest_prompt(sizes: Sizes, max_tokens: int) -> int:
    """An upper bound on the longest prompt the workload sends (the last chat turn, usually)."""
    chat = sizes.doc_len + sizes.question_len + (sizes.turns - 1) * (ANSWER_SLACK * max_tokens + sizes.question_len)
    return max(chat, sizes.doc_len + sizes.question_len, sizes.prompt_len)


def kv_pages(sizes: Sizes, max_tokens: int, page_size: int, concurrency: int, speculative_steps: int) -> int:
    """Pages per rank for every document and conversation held in the cache at once, plus one request in flight
    (a CP prefill holds a request on every rank), or the no-sharing phase's streams, whichever is more."""
    def pages(tokens: int) -> int:
        return -(-(tokens + max_tokens + speculative_steps + 1) // page_size) + 1

    held = (sizes.num_docs + sizes.conversations + 1) * pages(longest_prompt(sizes, max_tokens))
    return max(held, concurrency * pages(sizes.prompt_len))
