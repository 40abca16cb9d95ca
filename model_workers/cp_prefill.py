"""One rank's part of a CP prefill batch (docs/architecture.md, 'Per-layer data flow under CP prefill'): target
forward, gather, logits, prompt logprobs, MTP draft.

Every rank runs the same sequence of collectives (one per layer, one per hidden-state gather, one gather of the
next-token ids when a request of the batch asks for prompt logprobs), so the sizes match on all ranks by
construction. With `meta.cp_size == 1` and a `LocalComm` the same code is the non-CP path (one rank, no
collectives, no padding). Only the owner of a request reports it (and scores its prompt).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from cp_router.cp.metadata import RankMetadata
from cp_router.plans import NEXT_ID_SAMPLED, PrefillShard, RequestOutput
from model_workers.comm import LocalComm
from model_workers.cp_rows import CPRows, gather_rows_global
from model_workers.grammar.compile_cache import GrammarCache
from model_workers.grammar.request_grammar import RequestGrammar
from model_workers.logits_processing import TokenHistory
from model_workers.models.common.topk_sharing import TopkMemo, position_slots
from model_workers.models.family import ModelFamily
from model_workers.page_table import PageTable
from model_workers.sampler import sample, token_logprob, token_logprobs

PROMPT_LOGPROB_ROWS = 256  # prompt logprobs are scored this many rows at a time: logits [256, vocab] at most


@dataclass
class PrefillContext:
    """What one rank's prefill needs besides the shard: its model, backend, group and request state."""

    model: torch.nn.Module  # any family's model
    family: ModelFamily  # its record (models/family.py)
    backend: object  # the family's backend, bound per forward with this rank's `CPRows`
    comm: LocalComm
    cp_rank: int  # the worker's rank: it reports the requests it owns
    tables: list[PageTable]  # per request of the batch, this rank's pages (prefix + extend), num_tokens = prefix
    page_size: int
    device: torch.device
    draft_hidden: dict[str, torch.Tensor] = field(default_factory=dict)  # owned: MTP output at the last row [D]
    draft_topk: dict[str, torch.Tensor] = field(default_factory=dict)  # owned, index sharing: its top-k slots [k']
    histories: dict[str, TokenHistory] = field(default_factory=dict)  # owned, with penalties: tokens so far
    grammar_cache: GrammarCache | None = None  # compiled grammars of this process (None: no tokenizer to compile)
    grammars: dict[str, RequestGrammar] = field(default_factory=dict)  # owned, constrained: the matcher so far


def last_rows_global(meta: RankMetadata) -> torch.Tensor:
    """[R] stream index of each request's last extend token."""
    return torch.tensor(meta.stream_offsets[1:], dtype=torch.long) - 1


def fill_sampled(next_ids_local: torch.Tensor, request_index_local: torch.Tensor, sampled: torch.Tensor):
    """MTP input ids [T_logical]: NEXT_ID_SAMPLED rows take their request's sampled token (sampled [R])."""
    return torch.where(next_ids_local == NEXT_ID_SAMPLED, sampled[request_index_local], next_ids_local)


def topk_positions_global(ctx: PrefillContext, batch, meta: RankMetadata, topk_slots: torch.Tensor) -> torch.Tensor:
    """Top-k cache slots [T_logical, k] of this rank -> key positions [N, k] in global order (-1 padded).

    Positions, unlike slots, mean the same on every rank, so the owner can map them onto its own pages.
    """
    slot_to_position = torch.full((ctx.backend.cache.num_slots,), -1, dtype=torch.long, device=ctx.device)
    for key_slots in batch.key_slots:
        slot_to_position[key_slots] = torch.arange(key_slots.numel(), device=ctx.device)
    positions_local = torch.where(topk_slots >= 0, slot_to_position[topk_slots.clamp_min(0)], -1)  # [T_logical, k]
    return gather_rows_global(ctx.comm, meta, positions_local, "topk", fill_value=-1)  # [N, k]


def run_prefill(ctx: PrefillContext, shard: PrefillShard, return_logits: bool,
                with_draft: bool = True) -> dict[str, RequestOutput]:
    """Runs this rank's shard; returns the outputs of the requests this rank owns. `with_draft`: the MTP layer runs
    too (`drafts_needed`), filling each output's draft and the owner's draft state."""
    meta, model = shard.meta, ctx.model
    batch = ctx.family.cp_batch(ctx.backend.cache, ctx.tables, meta, ctx.page_size, ctx.device)
    rows = CPRows(ctx.comm, meta)
    ids_local = shard.token_ids_local.to(ctx.device)  # [T_logical]
    hidden_local = model(ids_local, batch.positions, ctx.backend.bind(batch, rows))  # [T_logical, D]
    for s, table in enumerate(ctx.tables):
        table.num_tokens = meta.prefix_lens[s] + meta.extend_lens[s]
    hidden_global = gather_rows_global(ctx.comm, meta, hidden_local, "hidden")  # [N, D]
    last_rows = last_rows_global(meta).to(ctx.device)  # [R]
    logits = model.logits(hidden_global[last_rows])  # [R, vocab] float32
    eos_ids = model.config.eos_token_ids
    histories = [TokenHistory.of(req.context_ids, req.num_generated, model.config.vocab_size)
                 if req.sampling.needs_history and req.context_ids else None for req in shard.requests]
    grammars = [start_grammar(ctx, req, eos_ids) for req in shard.requests]
    sampled = torch.tensor([next_token(logits[s], req, eos_ids, histories[s], grammars[s])
                            for s, req in enumerate(shard.requests)])  # [R] int64, equal on every rank
    outputs = {}
    for s, req in enumerate(shard.requests):
        if req.owner_rank == ctx.cp_rank:
            token, emits = int(sampled[s]), req.final_chunk and req.resume_token is None
            if histories[s] is not None:
                histories[s].add(token)
                ctx.histories[req.request_id] = histories[s]
            if grammars[s] is not None:
                grammars[s].advance(token)
                grammars[s].commit()
                ctx.grammars[req.request_id] = grammars[s]
            out = RequestOutput(req.request_id, token, logits[s].cpu() if return_logits else None,
                                token_ids=[] if req.resume_token is not None else [token])
            if emits:
                out.finish_reason = req.sampling.finish_reason(token, req.num_generated + 1, eos_ids)
            if emits and req.sampling.logprobs is not None:
                out.logprobs = [token_logprob(logits[s], token, req.sampling.logprobs)]
            outputs[req.request_id] = out
    score_prompt(ctx, shard, hidden_global, outputs)
    if with_draft and model.num_mtp_layers > 0:
        run_mtp_prefill(ctx, shard, batch, hidden_local, sampled, outputs, return_logits)
    return outputs


def drafts_needed(num_speculative_steps: int, return_logits: bool) -> bool:
    """Whether a prefill step runs the MTP layer: for speculation (its first draft, the draft state) or to ship the
    draft logits (return_logits). Without either nothing reads its output or its KV rows, and it is one layer in five
    of the default model's prefill."""
    return num_speculative_steps > 0 or return_logits


def next_token(logits: torch.Tensor, req, eos_ids: tuple[int, ...], history, grammar) -> int:
    """The token after a request's chunk (logits [vocab]): a resumed request's streamed token, a sample on a
    final chunk (masked by its grammar, if any), else an argmax placeholder (a non-final chunk's token is never
    used)."""
    if req.resume_token is not None:
        return req.resume_token
    if req.final_chunk:
        allowed = grammar.allowed() if grammar is not None else None
        return sample(logits, req.sampling, eos_ids, req.num_generated, history=history, allowed=allowed)
    return int(logits.argmax())


def start_grammar(ctx: PrefillContext, req, eos_ids: tuple[int, ...]) -> RequestGrammar | None:
    """A constrained request's matcher at its final chunk, after the output a recompute folded into the context;
    every rank that samples its token needs it (all ranks of a CP batch), and its owner keeps it."""
    spec = req.sampling.grammar
    if spec is None or not req.final_chunk or (req.resume_token is not None and req.owner_rank != ctx.cp_rank):
        return None
    if ctx.grammar_cache is None:
        raise ValueError(f"request {req.request_id} is constrained ({spec.kind}) but this worker has no grammar "
                         "backend: the checkpoint folder has no tokenizer.json")
    output_ids = req.context_ids[len(req.context_ids) - req.num_generated :] if req.num_generated else ()
    return RequestGrammar.start(ctx.grammar_cache, spec, tuple(req.sampling.stop_ids(eos_ids)) or eos_ids,
                                tuple(output_ids))


def score_prompt(ctx: PrefillContext, shard: PrefillShard, hidden_global: torch.Tensor,
                 outputs: dict[str, RequestOutput]) -> None:
    """Prompt logprobs of the owned requests that asked: row i of a chunk scores the token after it (the next
    chunk's first one at a non-final chunk's last row; a final chunk's last row predicts the sampled token and
    is no prompt logprob). hidden_global [N, D] in global stream order, equal on every rank."""
    meta = shard.meta
    if all(req.prompt_logprobs is None for req in shard.requests):
        return  # the same answer on every rank: the gather below runs on all of them or on none
    next_local = shard.next_ids_local.to(ctx.device)  # [T_logical] t_{i+1}, NEXT_ID_SAMPLED where sampled
    next_global = gather_rows_global(ctx.comm, meta, next_local, "ids", fill_value=NEXT_ID_SAMPLED)  # [N]
    for s, req in enumerate(shard.requests):
        out = outputs.get(req.request_id)
        if req.prompt_logprobs is None or out is None:
            continue  # not asked for, or owned by another rank
        start, end = meta.stream_offsets[s], meta.stream_offsets[s + 1] - (1 if req.final_chunk else 0)
        for block in range(start, end, PROMPT_LOGPROB_ROWS):
            rows = slice(block, min(block + PROMPT_LOGPROB_ROWS, end))
            logits = ctx.model.logits(hidden_global[rows])  # [r, vocab] float32
            out.prompt_logprobs += token_logprobs(logits, next_global[rows], req.prompt_logprobs)


def run_mtp_prefill(
    ctx: PrefillContext,
    shard: PrefillShard,
    batch,
    hidden_local: torch.Tensor,
    sampled: torch.Tensor,
    outputs: dict[str, RequestOutput],
    return_logits: bool,
) -> None:
    """MTP layer 0 over the same layout: ids t_{i+1}, hidden h_i, positions i; fills the draft of `outputs`.

    `hidden_local` is this rank's shard of the gathered target hidden states: with one layout for target
    and draft, shard(gather_rerange(...)) returns exactly these rows.
    """
    meta, model = shard.meta, ctx.model
    request_index_local = meta.request_index_local[: meta.num_logical]  # [T_logical]
    next_ids = fill_sampled(shard.next_ids_local, request_index_local, sampled).to(ctx.device)  # [T_logical]
    mtp_layer_id = model.config.num_hidden_layers
    memo = TopkMemo(mtp_layer_id) if model.config.index_share_for_mtp_iteration else None
    backend = ctx.backend.bind(batch, CPRows(ctx.comm, meta), memo)
    mtp_local = model.mtp_forward(next_ids, hidden_local, batch.positions, backend)  # [T_logical, D]
    mtp_global = gather_rows_global(ctx.comm, meta, mtp_local, "hidden")  # [N, D]
    draft_logits = model.draft_logits(mtp_global[last_rows_global(meta).to(ctx.device)])  # [R, vocab]
    topk_global = topk_positions_global(ctx, batch, meta, memo.kept) if memo is not None else None
    for s, req in enumerate(shard.requests):
        out = outputs.get(req.request_id)
        if out is None:
            continue
        out.draft_token_id = int(draft_logits[s].argmax())
        ctx.draft_hidden[req.request_id] = mtp_global[meta.stream_offsets[s + 1] - 1]  # [D]
        out.draft_logits = draft_logits[s].cpu() if return_logits else None
        if topk_global is not None:
            start, end = meta.stream_offsets[s], meta.stream_offsets[s + 1]
            out.mtp_topk_positions = topk_global[start:end].cpu()  # [L_s, k]
            last_row = topk_global[end - 1].cpu()  # [k] key positions
            ctx.draft_topk[req.request_id] = position_slots(ctx.tables[s], last_row, ctx.page_size).to(ctx.device)
