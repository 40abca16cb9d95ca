"""Capacity and context of a served engine: one pydantic model behind both the CLI flags and the Serve YAML.

`EngineLimits` names vLLM's settings (`max_model_len`, `max_num_seqs`, `max_num_batched_tokens`, ...):
`add_limit_arguments` turns each field into a `--flag` of the same name, and `ServeAppArgs` inherits the
fields, so the two cannot drift. `resolve_limits` sizes the KV cache (pages, or a memory budget per rank)
and the effective context window once at start-up: the smaller of the model's window and what one request
can hold in a rank's pages, so that no request the ingress accepts can fail for its size.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict, Field

DEFAULT_NUM_KV_PAGES = 256


class EngineLimits(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    max_model_len: int | None = Field(None, ge=1, description=(
        "context window per request, prompt + completion (default: the model's window, capped by what the KV "
        "cache of one rank holds)"))
    num_kv_pages: int | None = Field(None, ge=1, description=(
        f"KV pages per rank (default: from --kv-cache-memory-gib, else {DEFAULT_NUM_KV_PAGES})"))
    kv_cache_memory_gib: float | None = Field(None, gt=0, description=(
        "KV cache memory per rank in GiB: pages = floor(GiB * 2^30 / (page_size * KV bytes per token))"))
    page_size: int = Field(64, ge=1, description="tokens per KV page")
    max_num_seqs: int = Field(256, ge=1, description="requests running at once (prefilling or decoding)")
    max_num_batched_tokens: int | None = Field(None, ge=2, description=(
        "prompt tokens per prefill step, the whole CP group's (the chunk; default: 2048 per CP rank)"))
    cp_min_prefill_tokens: int = Field(512, ge=0, description=(
        "new prompt tokens a prefill step needs before it runs across the CP group; in a smaller step each prompt "
        "runs whole on the rank that will decode it, without collectives, which is faster below a few hundred "
        "tokens (0: CP for every step that splits)"))
    max_queued_requests: int = Field(4096, ge=1, description="waiting requests before new ones get 503")


def add_limit_arguments(parser: argparse.ArgumentParser) -> None:
    """One --flag per `EngineLimits` field, with its type, default and description."""
    for name, field in EngineLimits.model_fields.items():
        kind = float if "float" in str(field.annotation) else int
        parser.add_argument("--" + name.replace("_", "-"), type=kind, default=field.default, help=field.description)


PREFILL_TOKENS_PER_RANK = 2048  # the default prefill chunk per CP rank (see `prefill_chunk_tokens`)


def prefill_chunk_tokens(max_num_batched_tokens: int | None, cp_size: int) -> int:
    """Prompt tokens of one prefill step: the setting, else PREFILL_TOKENS_PER_RANK per CP rank, so that each rank's
    share of a step (its time, its activations) is that of one rank at C = 1. Measured at C = 2 on the default
    model (CPU, three alternating runs): an 8k prompt in chunks of 4096 took 1.34-1.40 s against 1.49-1.66 s in
    chunks of 2048 (one unchunked batch: 1.28-1.31 s)."""
    return max_num_batched_tokens if max_num_batched_tokens is not None else PREFILL_TOKENS_PER_RANK * cp_size


def limits_from(source) -> dict:
    """The `EngineLimits` fields of an argparse namespace or a ServeAppArgs, as a dict."""
    return {name: getattr(source, name) for name in EngineLimits.model_fields}


@dataclass(frozen=True)
class ResolvedLimits:
    num_pages: int  # per rank
    page_size: int
    max_model_len: int  # what the ingress admits: prompt + max_tokens <= this


def kv_room(num_pages: int, page_size: int, num_speculative_steps: int) -> int:
    """The longest prompt + completion one request can hold: its pages also take the k + 1 tokens a
    speculative step writes past its last accepted one."""
    return num_pages * page_size - num_speculative_steps - 1


def resolve_limits(limits: EngineLimits, model_window: int, kv_bytes_per_token: float,
                   num_speculative_steps: int) -> ResolvedLimits:
    """Pages and the effective window; a ValueError naming the flags when they cannot hold together."""
    if limits.num_kv_pages is not None and limits.kv_cache_memory_gib is not None:
        raise ValueError("--num-kv-pages and --kv-cache-memory-gib both size the KV cache; give one of them")
    if limits.num_kv_pages is not None:
        num_pages = limits.num_kv_pages
    elif limits.kv_cache_memory_gib is not None:
        num_pages = int(limits.kv_cache_memory_gib * 2**30 // (limits.page_size * kv_bytes_per_token))
        if num_pages < 1:
            raise ValueError(f"--kv-cache-memory-gib {limits.kv_cache_memory_gib:g} holds no page of "
                             f"{limits.page_size} tokens x {kv_bytes_per_token:g} bytes")
    else:
        num_pages = DEFAULT_NUM_KV_PAGES
    room = kv_room(num_pages, limits.page_size, num_speculative_steps)
    if room < 1:
        raise ValueError(f"{num_pages} KV pages x {limits.page_size} tokens hold no request with "
                         f"{num_speculative_steps} speculative steps; raise --num-kv-pages or --page-size")
    if limits.max_model_len is None:
        return ResolvedLimits(num_pages, limits.page_size, min(model_window, room))
    if limits.max_model_len > model_window:
        raise ValueError(f"--max-model-len {limits.max_model_len} exceeds the model's window "
                         f"(max_position_embeddings = {model_window}); allowed: 1..{model_window}")
    if limits.max_model_len > room:
        needed = -(-(limits.max_model_len + num_speculative_steps + 1) // limits.page_size)
        raise ValueError(f"--max-model-len {limits.max_model_len} does not fit the KV cache: one request then needs "
                         f"{needed} pages of {limits.page_size} tokens, a rank has {num_pages} (--num-kv-pages / "
                         f"--kv-cache-memory-gib); allowed: at most {room}")
    return ResolvedLimits(num_pages, limits.page_size, limits.max_model_len)
