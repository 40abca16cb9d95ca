"""Speculative sampling preserves the target distribution in the served engine: the first three tokens of
many seeded requests (T = 0.7, top-k 3, k = 2 drafts from a random MTP layer) against the distribution this
test computes itself from the `transformers` reference model: softmax(top-3 logits / T) at every position."""

import pytest
import torch

from cluster.engine_setup import run_all
from cluster.engine_spec import EngineOptions
from cp_router.protocol import EngineRequest
from support.engines import local_engine
from support.stats import chi_square_p
from support.tiny_models import add_mtp_layer, reference_model, save_reference

TEMPERATURE, TOP_K, K, SAMPLES, LENGTH = 0.7, 3, 2, 3000, 3
PROMPT = (5, 17, 99, 3, 64, 23)
HEAD_SCALE = 8.0  # the tiny model's logits are nearly flat; scaled, its top-3 gaps make T = 0.7 and T = 1 differ


@pytest.fixture(scope="module")
def sharp_checkpoint(tmp_path_factory):
    """A tiny random V3.2 + MTP checkpoint whose LM head is scaled (sharper next-token distributions)."""
    model = reference_model("v32", seed=4)
    with torch.no_grad():
        model.lm_head.weight.mul_(HEAD_SCALE)
    folder = save_reference(model, tmp_path_factory.mktemp("v32_sharp"))
    add_mtp_layer(folder)
    return model, folder


def next_token_probs(ref, ids: list[int]) -> dict[int, float]:
    """The reference's distribution of the next token under temperature and top-k, as the test computes it."""
    with torch.no_grad():
        logits = ref(torch.tensor([ids])).logits[0, -1].double()  # [V]
    top = logits.topk(TOP_K)
    probs = (top.values / TEMPERATURE).softmax(-1)
    return dict(zip(top.indices.tolist(), probs.tolist()))


def expected_sequences(ref) -> dict[tuple[int, ...], float]:
    """P(t1, t2, t3 | prompt) over every continuation the top-k support allows."""
    sequences = {(): 1.0}
    for _ in range(LENGTH):
        sequences = {seq + (t,): p * q for seq, p in sequences.items()
                     for t, q in next_token_probs(ref, list(PROMPT) + list(seq)).items()}
    return sequences


def test_speculative_sampling_in_the_engine_matches_softmax_at_temperature(sharp_checkpoint):
    ref, folder = sharp_checkpoint
    expected = expected_sequences(ref)
    engine = local_engine(folder, EngineOptions(num_speculative_steps=K, num_pages=SAMPLES * 2 + 8, page_size=8))
    requests = [EngineRequest(f"s{i}", PROMPT, LENGTH, temperature=TEMPERATURE, top_k=TOP_K, seed=i, ignore_eos=True)
                for i in range(SAMPLES)]
    counts = {seq: 0 for seq in expected}
    for result in run_all(engine, requests):
        seq = tuple(result["token_ids"])
        assert seq in counts, f"{seq} lies outside the top-{TOP_K} support"
        counts[seq] += 1
    assert 0 < engine.stats.accepted < engine.stats.drafted  # drafts were both accepted and rejected
    cells = sorted(expected, key=expected.get, reverse=True)
    big = [s for s in cells if expected[s] * SAMPLES >= 5]  # the rest pooled into one cell (>= 5 expected each)
    observed = torch.tensor([counts[s] for s in big] + [sum(counts[s] for s in cells if s not in big)], dtype=torch.float64)
    probs = torch.tensor([expected[s] for s in big] + [sum(expected[s] for s in cells if s not in big)], dtype=torch.float64)
    keep = probs > 0
    assert chi_square_p(observed[keep], probs[keep] / probs[keep].sum()) > 1e-3
