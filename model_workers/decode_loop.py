"""Decode on the owner rank: plain steps, or MTP chain drafts verified by one target forward (no collectives).

Cache positions of a request that has emitted t_n (not yet cached): the target holds t_0..t_{n-1} at
positions 0..n-1; the MTP layer holds positions 0..n-1 too (position i took t_{i+1} and the target hidden
h_i) and `draft_hidden` is its output at position n-1, which predicts t_{n+1}. One speculative step:
1. draft: k tokens, the MTP layer fed its own output hidden (positions n, n+1, ... hold temporary KV);
2. verify: the target extends [t_n, d_1..d_k] at positions n..n+k, one forward; m drafts are accepted and
   one more token comes from the target (correction or bonus);
3. roll back both caches to n + m + 1 positions and draft-extend the MTP layer over positions n..n+m with
   the accepted tokens and their target hidden states (overwriting the temporary draft KV).

Under expert parallelism (docs/parallelism.md, 'Expert parallelism and DP-attention decode') decode is DP
attention in lockstep: each rank decodes the requests it owns, but every MoE layer is a group exchange, so every
rank runs the same forwards. Each step
starts with one small all-gather of every rank's live request count (`group_counts`); the step runs while
any rank has one, and a rank without any joins each forward with zero rows. The draft chain and the verify
forward take their row counts from that all-gather; the draft-extend (accepted counts vary) agrees anew.
"""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict
from dataclasses import dataclass, field

import torch

from cp_router.plans import RequestOutput
from cp_router.sampling import SamplingParams
from model_workers.models.common.topk_sharing import TopkMemo, reuse_rows
from model_workers.expert_parallel import dp_forward_rows
from model_workers.page_table import PageTable
from model_workers.grammar.request_grammar import RequestGrammar
from model_workers.logits_processing import TokenHistory
from model_workers.runner import ExtendItem, ModelRunner
from model_workers.sampler import draft_token, sample, token_logprob, verify


@dataclass
class HeldRequest:
    """What the owner rank keeps of a request between steps (its pages belong to the scheduler)."""

    sampling: SamplingParams
    draft_hidden: torch.Tensor | None = None  # [D] MTP output at the last cached position
    draft_topk: torch.Tensor | None = None  # [k'] MTP top-k slots there (MTP index sharing only)
    history: TokenHistory | None = None  # prompt and output tokens, when its penalties need them
    grammar: RequestGrammar | None = None  # structured outputs: the matcher over its output so far


@dataclass
class DecodeState:
    """One request during one worker call."""

    request_id: str
    held: HeldRequest
    table: PageTable  # the plan's pages; num_tokens = positions cached
    last_token: int  # emitted, not yet cached
    index: int  # output number of the next token
    budget: int  # tokens it may still emit; the request ends when it reaches 0
    out: RequestOutput = field(init=False)
    finished: bool = False

    def __post_init__(self):
        self.out = RequestOutput(self.request_id, self.last_token, token_ids=[])


def emit(state: DecodeState, tokens: list[int], rows: torch.Tensor, eos_ids: tuple[int, ...]) -> int:
    """Appends tokens until one finishes the request (`SamplingParams.finish_reason`: a stop id / EOS past
    min_tokens, or max_tokens); rows [len(tokens), V] raw logits. Returns how many were kept."""
    params, kept = state.held.sampling, 0
    for j, token in enumerate(tokens):
        if params.logprobs is not None:
            state.out.logprobs.append(token_logprob(rows[j], token, params.logprobs))
        state.out.token_ids.append(token)
        if state.held.history is not None:
            state.held.history.add(token)
        if state.held.grammar is not None:
            state.held.grammar.advance(token)
        kept, state.budget, state.index = kept + 1, state.budget - 1, state.index + 1
        state.out.finish_reason = params.finish_reason(token, state.index, eos_ids)  # "length" at budget 0
        if state.out.finish_reason is not None:
            state.finished = True
            break
    if state.held.grammar is not None:
        state.held.grammar.commit()
    state.last_token = state.out.token_id = state.out.token_ids[-1]
    return kept


class DecodeClock:
    """Seconds inside model forwards (plain / draft / verify, logits included) and step counts."""

    def __init__(self):
        self.seconds: dict[str, float] = defaultdict(float)
        self.steps: dict[str, int] = defaultdict(int)

    @contextlib.contextmanager
    def timed(self, phase: str):
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[phase] += time.perf_counter() - start


def allowed_next(state: DecodeState) -> torch.Tensor | None:
    """The tokens the request's grammar allows next ([V] bool), None when unconstrained."""
    return state.held.grammar.allowed() if state.held.grammar is not None else None


def group_rows(runner: ModelRunner, counts: list[int] | None, per_request: int, is_extend: bool):
    """The expert exchange rows of a forward where every request brings `per_request` rows (None: no EP)."""
    if counts is None:
        return None
    return dp_forward_rows([c * per_request for c in counts], runner.exchange.ep_rank, is_extend)


def plain_step(runner: ModelRunner, states: list[DecodeState], return_logits: bool, clock: DecodeClock,
               counts: list[int] | None = None) -> None:
    """One token per request: target forward of [t_n] each, sample. `counts`: live requests per rank (EP)."""
    model, eos_ids = runner.model, runner.model.config.eos_token_ids
    with clock.timed("plain"):
        items = [ExtendItem(s.table, [s.last_token]) for s in states]
        hidden = runner.decode(items, rows=group_rows(runner, counts, 1, False))  # [B, D]
        logits = model.logits(hidden)  # [B, V] float32
    clock.steps["plain"] += 1
    argmax = logits.argmax(-1).tolist()  # [B]
    for b, state in enumerate(states):
        token = sample(logits[b], state.held.sampling, eos_ids, state.index, argmax[b], state.held.history,
                       allowed_next(state))
        emit(state, [token], logits[b : b + 1], eos_ids)
        if return_logits:
            state.out.logits = logits[b].cpu()


def sharing_memo(runner: ModelRunner, states: list[DecodeState]) -> TopkMemo | None:
    """The MTP layer's top-k memo when the checkpoint shares it across draft steps (GLM-5.2), else None."""
    sharing = runner.model.config.index_share_for_mtp_iteration
    if not states or not sharing or any(s.held.draft_topk is None for s in states):
        return None
    return TopkMemo(runner.model.config.num_hidden_layers)


def draft_chain(
    runner: ModelRunner, states: list[DecodeState], k: int, shared: TopkMemo | None,
    counts: list[int] | None = None,
) -> list[list[int]]:
    """k draft tokens per request (MTP layer on its own output hidden), drawn with the noise verification uses."""
    model, eos_ids = runner.model, runner.model.config.eos_token_ids
    starts = [s.table.num_tokens for s in states]  # n per request
    hidden = torch.stack([s.held.draft_hidden for s in states]) if states else runner.empty_hidden()  # [B, D]
    drafts: list[list[int]] = [[] for _ in states]
    for j in range(k):
        draft_logits = model.draft_logits(hidden)  # [B, V] (a draft vocabulary's tokens only, if set)
        argmax = draft_logits.argmax(-1).tolist()  # [B]
        for b, state in enumerate(states):
            history = state.held.history.with_tokens(drafts[b]) if state.held.history is not None else None
            token = draft_token(draft_logits[b], state.held.sampling, eos_ids, state.index + j, argmax[b], history,
                                allowed_next(state))
            drafts[b].append(token)
            if state.held.grammar is not None:  # the next draft's mask follows this one (taken back below)
                state.held.grammar.advance(token)
        if j < k - 1:  # MTP position n + j takes (d_j, its own previous output)
            items = [ExtendItem(s.table, [drafts[b][j]]) for b, s in enumerate(states)]
            if shared is not None:  # top-k of the last draft-extend row + the chain's own keys n..n+j
                tables = [s.table for s in states]
                shared.reuse = reuse_rows([s.held.draft_topk for s in states], tables, starts, j, runner.page_size)
            hidden = runner.extend_mtp(items, hidden, [n + j for n in starts], topk_memo=shared, is_extend=False,
                                       rows=group_rows(runner, counts, 1, False))  # [B, D]
    for state in states:
        if state.held.grammar is not None:
            state.held.grammar.rollback(k)
    return drafts


def speculative_step(runner: ModelRunner, states: list[DecodeState], k: int, clock: DecodeClock,
                     counts: list[int] | None = None) -> None:
    """Draft k, verify k + 1 in one target forward, roll back, draft-extend the accepted tokens.
    `counts`: live requests per rank (EP lockstep), else None."""
    model, cache, eos_ids = runner.model, runner.cache, runner.model.config.eos_token_ids
    starts = [s.table.num_tokens for s in states]  # n per request
    for state, n in zip(states, starts):
        cache.check_room(state.table, n + k + 1)
    shared = sharing_memo(runner, states)
    with clock.timed("draft"):
        drafts = draft_chain(runner, states, k, shared, counts)
    verify_items = [ExtendItem(s.table, [s.last_token] + d) for s, d in zip(states, drafts)]
    with clock.timed("verify"):
        verify_rows = group_rows(runner, counts, k + 1, True)
        hidden = runner.extend(verify_items, rows=verify_rows)  # [B*(k+1), D]
        hidden = hidden.view(len(states), k + 1, hidden.shape[-1])  # [B, k+1, D]
        logits = model.logits(hidden)  # [B, k+1, V]
    clock.steps["speculative"] += 1
    argmax = logits.argmax(-1).tolist()  # [B, k+1]
    extend_items, extend_rows, extend_starts, extended = [], [], [], []
    for b, (state, n) in enumerate(zip(states, starts)):
        params = state.held.sampling
        accepted, tokens = verify(logits[b], drafts[b], params, eos_ids, state.index, argmax[b], state.held.history,
                                  state.held.grammar)
        state.out.drafted += k
        for j in range(accepted):
            state.out.accepted_per_position[j] += 1
        state.table.num_tokens = n + accepted + 1  # roll back: the rejected drafts' KV is overwritten later
        kept = emit(state, tokens, logits[b], eos_ids)
        # a request that ended too: its MTP rows of the kept positions complete its pages (prefix caching)
        extend_items.append(ExtendItem(state.table, tokens[:kept]))
        extend_rows.append(hidden[b, :kept])  # [m+1, D] target hidden at positions n..n+m
        extend_starts.append(n)
        extended.append(state)
    if extended or counts is not None:  # under EP every rank joins the draft-extend, rows or not
        if shared is not None:
            shared.reuse = None  # the draft-extend selects its own top-k and records it
        with clock.timed("draft"):
            prev_hidden = torch.cat(extend_rows) if extend_rows else runner.empty_hidden()
            mtp_hidden = runner.extend_mtp(extend_items, prev_hidden, extend_starts, topk_memo=shared)
        ends = torch.tensor([len(it.token_ids) for it in extend_items]).cumsum(0) - 1  # [B'] last row each
        for state, row in zip(extended, ends.tolist()):
            state.held.draft_hidden = mtp_hidden[row]  # [D]
            state.held.draft_topk = None if shared is None else shared.kept[row]  # [k']


def run_decode(
    runner: ModelRunner, states: list[DecodeState], num_steps: int, k: int, return_logits: bool,
    clock: DecodeClock | None = None,
) -> dict[str, RequestOutput]:
    """Up to `num_steps` steps; a request stops early at its budget or a stop id / EOS."""
    clock = clock or DecodeClock()
    use_mtp = k > 0 and runner.model.num_mtp_layers > 0
    for state in states:
        state.out.accepted_per_position = [0] * (k if use_mtp else 0)
    for _ in range(num_steps):
        active = [s for s in states if not s.finished and s.budget > 0]
        counts = group_counts(runner, len(active))
        if not (active if counts is None else sum(counts)):
            break
        if use_mtp:
            speculative_step(runner, active, k, clock, counts)
        else:
            plain_step(runner, active, return_logits, clock, counts)
    return {s.request_id: s.out for s in states}


def group_counts(runner: ModelRunner, num_active: int) -> list[int] | None:
    """Expert parallelism: every rank's live request count this step (one small all-gather); else None."""
    return None if runner.exchange is None else runner.exchange.sync_rows(num_active)

