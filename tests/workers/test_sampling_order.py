"""Sampling order: temperature first, then top-k, min-p and top-p (sampler.target_probs' docstring, vLLM's order),
checked against an independent reference at temperatures != 1, for the distribution itself, the plain sampler's
draws and the first token of speculative verification; and the checks' power against the order bug (temperature
applied after min-p / top-p), which test_sampler.py cannot see (its top-p tests run at T = 1 and its speculative
test takes target_probs as the expected answer).

The reference is transformers' logits warpers composed here in vLLM's order, not in transformers' `generate` order
(temperature, top-k, top-p, min-p: top-p before min-p, which keeps more tokens when both are set). vLLM v1 applies
min-p before top-k; the two commute (each keeps tokens by their logit's distance from the top token, which both
keep). At the boundaries the warpers agree with target_probs, so no hand-written nucleus is needed:
TopPLogitsWarper drops a token when the ascending cumulative mass up to and including it is <= 1 - top_p, i.e. when
the likelier tokens already hold >= top_p, so the token crossing top_p is kept, as in target_probs; MinPLogitsWarper
drops p < min_p * max p of the distribution it is handed (here after temperature); TopKLogitsWarper keeps ties.
"""

import pytest
import torch
from transformers.generation.logits_process import (MinPLogitsWarper, TemperatureLogitsWarper, TopKLogitsWarper,
                                                    TopPLogitsWarper)

from cp_router.sampling import SamplingParams
from model_workers import sampler
from model_workers.sampler import draft_token, sample, target_probs, verify
from support.stats import chi_square_p

CASES = [  # (vocabulary size, logits seed, sampling options)
    (64, 1, dict(temperature=0.5, top_p=0.8)),
    (128, 2, dict(temperature=0.5, min_p=0.1)),
    (96, 3, dict(temperature=0.7, top_k=5)),
    (200, 4, dict(temperature=1.5, top_p=0.9, top_k=20)),
    (150, 5, dict(temperature=0.8, min_p=0.05, top_p=0.7)),
]
NUCLEUS = dict(temperature=0.5, top_p=0.8)
MIN_P = dict(temperature=0.5, min_p=0.1)
SPECULATIVE = [(NUCLEUS, dict(temperature=1.0, top_p=0.95)), (MIN_P, dict(temperature=0.9, top_k=12))]
VOCAB, SAMPLES, SPEC_SAMPLES = 100, 6000, 4000  # fixed seeds 0..n-1: every run draws the same tokens
TV_BOUND = 0.05  # the order bug moves 0.16 (top-p) and 0.18 (min-p) of the mass here


def random_logits(vocab: int, seed: int, scale: float = 1.5) -> torch.Tensor:
    return torch.randn(vocab, generator=torch.Generator().manual_seed(seed)) * scale  # [V]


TARGET = random_logits(VOCAB, 12)  # [V]
DRAFT = TARGET + random_logits(VOCAB, 21, 1.0)  # [V]: a related model, so drafts are both accepted and rejected


def expected_probs(logits: torch.Tensor, temperature: float, top_k: int = 0, min_p: float = 0.0,
                   top_p: float = 1.0) -> torch.Tensor:
    """The reference distribution [V] float64: transformers' warpers in vLLM's order, then softmax."""
    warpers = [TemperatureLogitsWarper(temperature)]
    warpers += [TopKLogitsWarper(top_k)] if top_k else []
    warpers += [MinPLogitsWarper(min_p)] if min_p else []
    warpers += [TopPLogitsWarper(top_p)] if top_p < 1 else []
    scores = logits.double()[None]  # [1, V]
    for warper in warpers:
        scores = warper(None, scores)
    return scores.softmax(-1)[0]


def buggy_target_probs(logits, params, blocked, *unused) -> torch.Tensor:
    """A scratch copy of sampler.target_probs with the order bug: top-k, min-p and top-p cut the T = 1 distribution
    and temperature reshapes the survivors afterwards (no penalties, blocked ids, grammar mask or greedy: these
    tests use none; `unused`: target_probs' later arguments, history and the like)."""
    logits = logits.float()
    if 0 < params.top_k < logits.shape[-1]:
        logits = logits.masked_fill(logits < logits.topk(params.top_k).values[-1], float("-inf"))
    probs = logits.softmax(-1)  # [V]
    if params.min_p > 0:
        probs = probs.masked_fill(probs < params.min_p * probs.max(), 0.0)
        probs = probs / probs.sum()
    if params.top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        mass_before = sorted_probs.cumsum(-1) - sorted_probs
        sorted_probs = sorted_probs.masked_fill(mass_before >= params.top_p, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
    return (logits / params.temperature).masked_fill(probs == 0, float("-inf")).softmax(-1)


def fit(counts: torch.Tensor, expected: torch.Tensor) -> tuple[int, float, float]:
    """counts [V] of draws against expected [V]: (draws outside the expected support, chi-square p-value on the
    support with cells expecting fewer than 5 draws pooled, total variation between the empirical and expected)."""
    support = expected > 0
    small = support & (expected * counts.sum() < 5)
    big = support & ~small
    observed = torch.cat([counts[big], counts[small].sum()[None]])
    probs = torch.cat([expected[big], expected[small].sum()[None]])
    keep = probs > 0
    total_variation = float((counts / counts.sum() - expected).abs().sum()) / 2
    return int(counts[~support].sum()), chi_square_p(observed[keep], probs[keep] / probs[keep].sum()), total_variation


def plain_counts(logits: torch.Tensor, options: dict, samples: int) -> torch.Tensor:
    """How often `sample` outputs each token [V] as output 0 of requests seeded 0..samples-1."""
    tokens = [sample(logits, SamplingParams(**options, seed=seed), (), 0) for seed in range(samples)]
    return torch.bincount(torch.tensor(tokens), minlength=logits.numel()).double()


def speculative_counts(options: dict, draft_options: dict, samples: int) -> tuple[torch.Tensor, int]:
    """The first token of `verify` with one draft from `draft_token` (the draft model sampling with its own
    options), per seed 0..samples-1: counts [V] and how many drafts were accepted."""
    rows = torch.stack([TARGET, TARGET])  # [2, V]: the draft's position, then the bonus position
    tokens, accepted = [], 0
    for seed in range(samples):
        draft = draft_token(DRAFT, SamplingParams(**draft_options, seed=seed), (), 0)
        num_accepted, out = verify(rows, [draft], SamplingParams(**options, seed=seed), (), 0)
        tokens.append(out[0])
        accepted += num_accepted
    return torch.bincount(torch.tensor(tokens), minlength=VOCAB).double(), accepted


@pytest.mark.parametrize("vocab,seed,options", CASES)
def test_target_probs_match_the_reference_order(vocab, seed, options):
    logits = random_logits(vocab, seed)
    expected = expected_probs(logits, **options)
    probs = target_probs(logits, SamplingParams(**options), [])
    assert torch.equal(probs > 0, expected > 0), "supports differ"
    torch.testing.assert_close(probs.double(), expected, atol=1e-6, rtol=0)


@pytest.mark.parametrize("vocab,seed,options", [case for case in CASES if set(case[2]) & {"top_p", "min_p"}])
def test_the_order_bug_changes_these_distributions(vocab, seed, options):
    """Power of the test above: the bug moves every case with top-p or min-p (with top-k alone it is harmless:
    dividing by T keeps the logits' order)."""
    logits = random_logits(vocab, seed)
    expected = expected_probs(logits, **options)
    buggy = buggy_target_probs(logits, SamplingParams(**options), []).double()
    assert not torch.equal(buggy > 0, expected > 0)
    assert float((buggy - expected).abs().sum()) / 2 > 0.05  # total variation


def test_sampled_tokens_follow_the_reference():
    counts = plain_counts(TARGET, NUCLEUS, SAMPLES)
    outside, p_value, total_variation = fit(counts, expected_probs(TARGET, **NUCLEUS))
    assert outside == 0, f"{outside} draws outside the T = 0.5, top-p 0.8 nucleus"
    assert p_value > 1e-3 and total_variation < TV_BOUND


@pytest.mark.parametrize("options,draft_options", SPECULATIVE)
def test_speculative_first_token_follows_the_reference(options, draft_options):
    counts, accepted = speculative_counts(options, draft_options, SPEC_SAMPLES)
    assert 0 < accepted < SPEC_SAMPLES  # drafts were both accepted and rejected
    outside, p_value, total_variation = fit(counts, expected_probs(TARGET, **options))
    assert outside == 0, f"{outside} first tokens outside the target's support"
    assert p_value > 1e-3 and total_variation < TV_BOUND


def test_the_sampling_checks_fail_with_the_order_bug(monkeypatch):
    """The checks above, rerun with the bug patched into sampler.target_probs for this test only (monkeypatch
    restores it) on the first quarter of their seeds, the same draws they would make: many land outside the
    support (the bug's nucleus is wider at T = 0.5) and the total variation is far above the bound. (The
    chi-square alone would miss it: within the true support the bug's conditional distribution is the same.)"""
    monkeypatch.setattr(sampler, "target_probs", buggy_target_probs)
    fits = [fit(plain_counts(TARGET, NUCLEUS, SAMPLES // 4), expected_probs(TARGET, **NUCLEUS))]
    for options, draft_options in SPECULATIVE:
        fits.append(fit(speculative_counts(options, draft_options, SPEC_SAMPLES // 4)[0],
                        expected_probs(TARGET, **options)))
    for (outside, _, total_variation), samples in zip(fits, [SAMPLES, SPEC_SAMPLES, SPEC_SAMPLES]):
        assert outside > samples // 4 // 20 and total_variation > 2 * TV_BOUND


def test_greedy_verification_is_the_raw_argmax_whatever_the_sampling_options():
    """Temperature 0 means greedy: no division by it, and top-k / min-p / top-p never move the argmax. A zero
    logit bias routes every row through target_probs' greedy branch; the seed plays no part."""
    rows = torch.stack([random_logits(VOCAB, seed) for seed in (31, 32, 33)])  # [3, V]
    best = rows.argmax(-1).tolist()
    wrong = (best[1] + 1) % VOCAB
    for seed in (0, 9):
        params = SamplingParams(top_k=5, min_p=0.1, top_p=0.8, logit_bias=((wrong, 0.0),), seed=seed)
        assert target_probs(rows[0], params, []).tolist() == torch.eye(VOCAB)[best[0]].tolist()
        assert draft_token(rows[0], params, (), 0) == best[0]
        assert verify(rows, best[:2], params, (), 0) == (2, best)
        assert verify(rows, [best[0], wrong], params, (), 0) == (1, best[:2])
