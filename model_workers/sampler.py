"""Per-request sampling and speculative verification from float32 logits.

Randomness is counter-based: the noise a request's output token number `index` is drawn with is a pure function of
(seed, index), so the same seed gives the same tokens whatever else shares the batch, on whichever rank samples,
and after a preemption recomputes the request.

A draw is Gumbel-max (an exponential race): token i wins when p_i / E_i is largest, E_i ~ Exp(1) a hash of
(seed, index, i); that picks i with probability p_i. Speculation shares that noise: the draft for position `index`
races its own distribution q against the same E, and verification draws the target's token at each position
exactly as plain decoding does, accepting drafts while they equal it. So speculation never changes a token, greedy
or seeded, for any k: the output is plain decoding's (given the same target logits); only how many positions one
forward settles changes. A draft equals the target's token whenever q and p put their winner on the same token
under the shared noise (the Gumbel coupling), about as often as Leviathan et al.'s min(1, p/q) test accepts.
Greedy is the same rule with one-hot distributions: the longest matching prefix plus one token.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from cp_router.sampling import SamplingParams
from model_workers.grammar.request_grammar import RequestGrammar
from model_workers.logits_processing import TokenHistory, needs_processing, process_logits

_MASK64 = (1 << 64) - 1


def uniform(seed: int, index: int) -> float:
    """A uniform in [0, 1) from (seed, index) by splitmix64 (stateless, identical on every process)."""
    z = (seed * 0x9E3779B97F4A7C15 + index * 0xBF58476D1CE4E5B9 + 2 * 0x94D049BB133111EB + 1) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return ((z ^ (z >> 31)) >> 11) / float(1 << 53)


def mask_disallowed(logits: torch.Tensor, allowed: torch.Tensor | None) -> torch.Tensor:
    """Logits [V] with the tokens a grammar does not allow (allowed [V] bool) at -inf. When nothing allowed is
    left (a draft vocabulary without them, or blocked stop ids where only a stop may come), the logits stay as
    they are: a token the grammar rejects is then verified away (drafts) or ends the constraint."""
    if allowed is None:
        return logits
    masked = torch.where(allowed.to(logits.device), logits, float("-inf"))
    return masked if bool(masked.amax() > float("-inf")) else logits


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
    """Gumbel-max draw from probs [V] (need not sum to 1) with the noise keyed by u in [0, 1): the argmax of
    probs_i / E_i over the tokens with mass, E_i ~ Exp(1) a pure function of (u, i) (`race_noise`), so a token's
    noise is the same whichever distribution races it and only the tokens with mass need any."""
    p = probs.detach().cpu().float().numpy()  # [V]
    ids = np.flatnonzero(p > 0)  # [S]
    if ids.size == 0:
        return 0
    return int(ids[np.argmax(p[ids] / race_noise(u, ids))])


def race_noise(u: float, token_ids: np.ndarray) -> np.ndarray:
    """Exp(1) noise [S] float32 of the tokens `token_ids` [S] for the draw keyed by u: splitmix64 of (key, id), its
    top 23 bits a uniform strictly inside (0, 1) in float32 (with 24, the largest rounds to 1 and its noise to 0)."""
    z = token_ids.astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15) + np.uint64(int(u * (1 << 53)))
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    z = z ^ (z >> np.uint64(31))
    return -np.log(((z >> np.uint64(41)).astype(np.float32) + np.float32(0.5)) * np.float32(1 / (1 << 23)))


def sample(
    logits: torch.Tensor, params: SamplingParams, eos_ids: tuple[int, ...], index: int, argmax: int | None = None,
    history: TokenHistory | None = None, allowed: torch.Tensor | None = None,
) -> int:
    """Output token number `index` from raw logits [V]; `argmax` of the raw logits when the caller has it
    (batched); `history` the request's tokens when its penalties need them; `allowed` [V] bool the grammar's."""
    blocked = params.blocked_ids(eos_ids, index)
    if params.greedy and not blocked and not needs_processing(params):
        return (int(logits.argmax()) if argmax is None else argmax) if allowed is None \
            else int(mask_disallowed(logits.float(), allowed).argmax())
    probs = target_probs(logits, params, blocked, history, allowed)
    return int(probs.argmax()) if params.greedy else draw(probs, uniform(params.seed, index))


def draft_token(
    draft_logits: torch.Tensor, params: SamplingParams, eos_ids: tuple[int, ...], index: int, argmax: int | None = None,
    history: TokenHistory | None = None, allowed: torch.Tensor | None = None,
) -> int:
    """The draft's proposal for output `index`: drawn from the draft's distribution with the request's options and
    grammar, racing the same noise the target's token at `index` will be drawn with (module docstring)."""
    return sample(draft_logits, params, eos_ids, index, argmax, history, allowed)


def verify(
    target_logits: torch.Tensor,
    drafts: list[int],
    params: SamplingParams,
    eos_ids: tuple[int, ...],
    index: int,
    argmax: list[int] | None = None,
    history: TokenHistory | None = None,
    grammar: RequestGrammar | None = None,
) -> tuple[int, list[int]]:
    """target_logits [k+1, V] at the verified positions -> (accepted drafts m, the m + 1 output tokens).

    Row j's token is plain decoding's output number index + j: sampled with that position's noise, penalties that
    see `history` plus drafts[:j], and the grammar's mask after drafts[:j]. Drafts are accepted while they equal
    it. `argmax` [k+1]: the rows' argmax when the caller computed them batched. The grammar is left where it was
    (the caller pushes the tokens it emits).
    """
    argmax = argmax or [None] * len(target_logits)
    tokens: list[int] = []
    try:
        for j in range(len(drafts) + 1):
            row_history = history.with_tokens(drafts[:j]) if history is not None else None
            allowed = grammar.allowed() if grammar is not None else None
            target = sample(target_logits[j], params, eos_ids, index + j, argmax[j], row_history, allowed)
            if j == len(drafts) or target != drafts[j]:
                return j, tokens + [target]
            tokens.append(target)
            if grammar is not None:
                grammar.advance(target)
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
