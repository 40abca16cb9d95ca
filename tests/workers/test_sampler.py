"""The sampler as pure functions: transforms, seeded draws, and speculative sampling preserving the target
distribution (chi-square on a tiny vocabulary, simulated decode loop with k drafts per step) and the very tokens
of plain decoding, seed by seed."""

import pytest
import torch

from cp_router.sampling import SamplingParams
from model_workers.sampler import draft_token, draw, sample, target_probs, uniform, verify
from support.stats import chi_square_p

V = 4  # tiny vocabulary: 16 cells for the pair of the first two tokens
SAMPLES = 8_000  # the pair's 16 cells; speculation's tokens are plain decoding's seed by seed (tested below)


def tables(seed: int = 0):
    """Target logits: p0 [V] for the first token, p1 [V, V] for the second given the first; drafts alike."""
    generator = torch.Generator().manual_seed(seed)
    target = (torch.randn(V, generator=generator) * 1.5, torch.randn(V, V, generator=generator) * 1.5)
    draft = (torch.randn(V, generator=generator), torch.randn(V, V, generator=generator))
    return target, draft


def first_two(params: SamplingParams, k: int, target, draft) -> tuple[int, int]:
    """The decode loop of `decode_loop.speculative_step` on the tables: steps until two tokens exist."""
    def logits_at(table, out: list[int]) -> torch.Tensor:
        return table[0] if not out else table[1][out[0]] if len(out) == 1 else torch.zeros(V)

    out: list[int] = []
    while len(out) < 2:
        drafts = []
        for j in range(k):
            drafts.append(draft_token(logits_at(draft, out + drafts), params, (), len(out) + j))
        if k == 0:
            out.append(sample(logits_at(target, out), params, (), len(out)))
            continue
        rows = torch.stack([logits_at(target, out + drafts[:j]) for j in range(k + 1)])  # [k+1, V]
        _, tokens = verify(rows, drafts, params, (), len(out))
        out += tokens
    return out[0], out[1]


@pytest.mark.parametrize("k,temperature,top_k", [(2, 1.0, 0), (3, 0.7, 3)])
def test_speculative_sampling_preserves_the_target_distribution(k, temperature, top_k):
    target, draft = tables()
    params = SamplingParams(temperature=temperature, top_k=top_k, max_tokens=4)
    p0 = target_probs(target[0], params, [])  # [V]
    p1 = torch.stack([target_probs(target[1][a], params, []) for a in range(V)])  # [V, V]
    expected = (p0[:, None] * p1).flatten()  # [V*V]
    counts = torch.zeros(V * V, dtype=torch.float64)
    for seed in range(SAMPLES):
        a, b = first_two(SamplingParams(temperature=temperature, top_k=top_k, max_tokens=4, seed=seed), k, target, draft)
        counts[a * V + b] += 1
    support = expected > 0
    assert counts[~support].sum() == 0, "a token outside top-k was produced"
    assert chi_square_p(counts[support], expected[support] / expected[support].sum()) > 1e-3


@pytest.mark.parametrize("k", [1, 2, 4])
def test_speculation_gives_plain_decodings_tokens_seed_by_seed(k):
    """The draft races the noise the target's token is drawn with: whatever it proposes, the output is k = 0's, and
    it proposes the target's token often (the coupling), so drafts are accepted as well as rejected."""
    target, draft = tables(1)
    accepted = 0
    for seed in range(300):
        params = SamplingParams(temperature=0.9, top_p=0.95, max_tokens=4, seed=seed)
        assert first_two(params, k, target, draft) == first_two(params, 0, target, draft)
        rows = torch.stack([target[0], target[1][0]])  # [2, V]
        accepted += verify(rows, [draft_token(draft[0], params, (), 0)], params, (), 0)[0]
    assert 100 < accepted < 300


def test_greedy_verification_is_the_longest_matching_prefix_plus_one():
    params = SamplingParams()
    rows = torch.tensor([[0.0, 5.0, 0.0], [0.0, 0.0, 5.0], [5.0, 0.0, 0.0]])  # target argmax 1, 2, 0
    assert verify(rows, [1, 2], params, (), 0) == (2, [1, 2, 0])
    assert verify(rows, [1, 0], params, (), 0) == (1, [1, 2])
    assert verify(rows, [2, 2], params, (), 0) == (0, [1])


def test_seeded_draws_are_a_function_of_seed_and_index_only():
    logits = torch.randn(50, generator=torch.Generator().manual_seed(0))
    params = SamplingParams(temperature=1.0, seed=7)
    first = [sample(logits, params, (), i) for i in range(20)]
    assert first == [sample(logits, params, (), i) for i in range(20)]
    other = [sample(logits, SamplingParams(temperature=1.0, seed=8), (), i) for i in range(20)]
    assert first != other
    assert 0 <= min(uniform(3, i) for i in range(100)) and max(uniform(3, i) for i in range(100)) < 1


def test_top_p_top_k_and_min_tokens_shape_the_distribution():
    logits = torch.tensor([3.0, 2.0, 1.0, 0.0, -1.0])
    probs = target_probs(logits, SamplingParams(temperature=1.0, top_p=0.8), [])
    assert probs[0] > 0 and probs[1] > 0 and probs[3:].sum() == 0 and abs(float(probs.sum()) - 1) < 1e-6
    assert (target_probs(logits, SamplingParams(temperature=1.0, top_k=2), []) > 0).sum() == 2
    params = SamplingParams(min_tokens=2, max_tokens=4, stop_token_ids=(1,))
    assert params.blocked_ids((0,), 1) == [1, 0] and params.blocked_ids((0,), 2) == []
    assert sample(logits, params, (0,), 0) == 2  # EOS 0 and stop id 1 are blocked before min_tokens
    assert sample(logits, params, (0,), 2) == 0
    assert draw(torch.tensor([0.0, 1.0, 0.0]), 0.999) == 1


@pytest.mark.parametrize("field,value", [("temperature", -0.1), ("top_p", 0.0), ("top_p", 1.5), ("top_k", -1),
                                         ("max_tokens", 0), ("min_tokens", 9), ("logprobs", -1)])
def test_bad_sampling_params_name_the_field(field, value):
    with pytest.raises(ValueError, match=f"^{field} must be"):
        SamplingParams(**{"max_tokens": 8, field: value})
