"""Per-request sampling and speculative verification from float32 logits.

Randomness is counter-based: the uniform used for a request's output token number `index` is a pure
function of (seed, index, slot), so the same seed gives the same tokens whatever else shares the batch,
on whichever rank samples, and after a preemption recomputes the request. Slots separate the uses of one
position: the draft's own draw, the accept test and the target draw (residual or bonus).

Speculative sampling (Leviathan et al.): draft token d ~ q is accepted with probability min(1, p(d)/q(d));
on rejection the token comes from normalize(max(0, p - q)); after k accepted drafts a bonus token from p.
Greedy verification is the same rule with one-hot p and q: the longest matching prefix plus one token.
"""

from __future__ import annotations

import math

import torch

from cp_router.sampling import SamplingParams
from model_workers.grammar.request_grammar import RequestGrammar
from model_workers.logits_processing import TokenHistory, needs_processing, process_logits

SLOT_DRAFT, SLOT_ACCEPT, SLOT_TARGET = 0, 1, 2
_MASK64 = (1 << 64) - 1


def uniform(seed: int, index: int, slot: int) -> float:
    """A uniform in [0, 1) from (seed, index, slot) by splitmix64 (stateless, identical on every process)."""
    z = (seed * 0x9E3779B97F4A7C15 + index * 0xBF58476D1CE4E5B9 + slot * 0x94D049BB133111EB + 1) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return ((z ^ (z >> 31)) >> 11) / float(1 << 53)


def mask_disallowed(logits: torch.Tensor, allowed: torch.Tensor | None) -> torch.Tensor:
    """Logits [V] with the tokens a grammar does not allow (allowed [V] bool) at -inf. When nothing allowed is
    left (a draft vocabulary without them, or blocked stop ids where only a stop may come), the logits stay as
    they are: a token the grammar rejects is then verified away (drafts) or ends the constraint."""
    if allowed is None:
        return logits
    masked = logits.masked_fill(~allowed.to(logits.device), float("-inf"))
    return masked if bool(torch.isfinite(masked).any()) else logits


def target_probs(logits: torch.Tensor, params: SamplingParams, blocked: list[int],
                 history: TokenHistory | None = None, allowed: torch.Tensor | None = None) -> torch.Tensor:
    """Raw logits [V] -> the distribution tokens are drawn from [V] float32 (one-hot when greedy): bias and
    penalties (logits_processing.py), blocked ids, the grammar's mask (`allowed` [V] bool), temperature, top-k,
    min-p, top-p."""
    logits = process_logits(logits.float(), params, history)
    if blocked:
        logits = logits.clone()
        logits[blocked] = float("-inf")
    logits = mask_disallowed(logits, allowed)
    if params.greedy:
        return torch.nn.functional.one_hot(logits.argmax(), logits.shape[-1]).float()
    logits = logits / params.temperature
    if 0 < params.top_k < logits.shape[-1]:
        kth = logits.topk(params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = logits.softmax(-1)  # [V]
    if params.min_p > 0:
        probs = probs.masked_fill(probs < params.min_p * probs.max(), 0.0)
        probs = probs / probs.sum()
    if params.top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        mass_before = sorted_probs.cumsum(-1) - sorted_probs
        sorted_probs = sorted_probs.masked_fill(mass_before >= params.top_p, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
        probs = probs / probs.sum()
    return probs


def draw(probs: torch.Tensor, u: float) -> int:
    """Inverse-CDF draw from probs [V] (need not sum to 1) with the uniform u in [0, 1)."""
    probs = probs.cpu()
    cdf = probs.double().cumsum(-1)  # [V]
    index = int(torch.searchsorted(cdf, torch.tensor([u * float(cdf[-1])], dtype=torch.float64), right=True))
    index = min(index, probs.shape[-1] - 1)
    while probs[index] <= 0 and index > 0:  # a plateau of the cdf: step back onto a token with mass
        index -= 1
    return index


def sample(
    logits: torch.Tensor, params: SamplingParams, eos_ids: tuple[int, ...], index: int, argmax: int | None = None,
    history: TokenHistory | None = None, allowed: torch.Tensor | None = None,
) -> int:
    """Output token number `index` from raw logits [V]; `argmax` of the raw logits when the caller has it
    (batched); `history` the request's tokens when its penalties need them; `allowed` [V] bool the grammar's."""
    blocked = params.blocked_ids(eos_ids, index)
    if params.greedy and not blocked and not needs_processing(params) and allowed is None:
        return int(logits.argmax()) if argmax is None else argmax
    probs = target_probs(logits, params, blocked, history, allowed)
    return int(probs.argmax()) if params.greedy else draw(probs, uniform(params.seed, index, SLOT_TARGET))


def draft_token(
    draft_logits: torch.Tensor, params: SamplingParams, eos_ids: tuple[int, ...], index: int, argmax: int | None = None,
    history: TokenHistory | None = None, allowed: torch.Tensor | None = None,
) -> tuple[int, torch.Tensor | None]:
    """The draft's proposal for output `index`: (token, q [V]); q is None when greedy (argmax, no q needed).
    The draft samples with the request's options and grammar too (better acceptance; verification alone keeps it
    exact)."""
    if params.greedy:
        if needs_processing(params) or allowed is not None:
            return int(mask_disallowed(process_logits(draft_logits.float(), params, history), allowed).argmax()), None
        return (int(draft_logits.argmax()) if argmax is None else argmax), None
    q = target_probs(draft_logits, params, params.blocked_ids(eos_ids, index), history, allowed)
    return draw(q, uniform(params.seed, index, SLOT_DRAFT)), q


def verify(
    target_logits: torch.Tensor,
    drafts: list[int],
    draft_probs: list[torch.Tensor | None],
    params: SamplingParams,
    eos_ids: tuple[int, ...],
    index: int,
    argmax: list[int] | None = None,
    history: TokenHistory | None = None,
    grammar: RequestGrammar | None = None,
) -> tuple[int, list[int]]:
    """target_logits [k+1, V] at the verified positions -> (accepted drafts m, the m + 1 output tokens).

    Row j scores output number index + j; drafts[j] was proposed for it with distribution draft_probs[j].
    `argmax` [k+1]: the rows' argmax when the caller computed them batched. Row j's penalties see `history`
    plus drafts[:j], and its grammar mask is the matcher's after drafts[:j]: what plain decoding would have seen
    at that position. The grammar is left where it was (the caller pushes the tokens it emits).
    """
    argmax = argmax or [None] * len(target_logits)
    tokens: list[int] = []
    try:
        for j, (draft, q) in enumerate(zip(drafts, draft_probs)):
            blocked = params.blocked_ids(eos_ids, index + j)
            row_history = history.with_tokens(drafts[:j]) if history is not None else None
            allowed = grammar.allowed() if grammar is not None else None
            if params.greedy:
                target = sample(target_logits[j], params, eos_ids, index + j, argmax[j], row_history, allowed)
                if target != draft:
                    return j, tokens + [target]
            else:
                p = target_probs(target_logits[j], params, blocked, row_history, allowed)  # [V]
                if not uniform(params.seed, index + j, SLOT_ACCEPT) * float(q[draft]) < float(p[draft]):
                    residual = (p - q).clamp_min(0.0)  # [V]
                    residual = residual if float(residual.sum()) > 0 else p
                    return j, tokens + [draw(residual, uniform(params.seed, index + j, SLOT_TARGET))]
            tokens.append(draft)
            if grammar is not None:
                grammar.advance(draft)
        k = len(drafts)
        last_history = history.with_tokens(drafts) if history is not None else None
        allowed = grammar.allowed() if grammar is not None else None
        return k, tokens + [sample(target_logits[k], params, eos_ids, index + k, argmax[k], last_history, allowed)]
    finally:
        if grammar is not None:
            grammar.rollback(len(tokens))


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, num_top: int) -> list[tuple[int, float, tuple, int]]:
    """Per row of raw logits [R, V] and its token (tokens [R] int64): (token, its logprob under the model, the
    num_top most likely (id, logprob), the token's 1-based rank among all V tokens: 1 + how many are likelier)."""
    logprobs = logits.float().log_softmax(-1)  # [R, V]
    chosen = logprobs.gather(-1, tokens.to(logprobs.device).long()[:, None])  # [R, 1]
    ranks = ((logprobs > chosen).sum(-1) + 1).tolist()  # [R]
    top = logprobs.topk(num_top, -1) if num_top > 0 else None
    top_ids = top.indices.tolist() if top is not None else [[]] * len(ranks)  # [R, num_top]
    top_values = top.values.tolist() if top is not None else [[]] * len(ranks)  # [R, num_top]
    return [(token, value if math.isfinite(value) else -1e30, tuple(zip(ids, values)), rank)
            for token, value, rank, ids, values in zip(tokens.tolist(), chosen[:, 0].tolist(), ranks, top_ids,
                                                       top_values)]


def token_logprob(logits: torch.Tensor, token: int, num_top: int) -> tuple[int, float, tuple, int]:
    """`token_logprobs` of one row: raw logits [V] and its token."""
    return token_logprobs(logits[None], torch.tensor([token]), num_top)[0]
