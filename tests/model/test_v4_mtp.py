"""DeepSeek-V4's MTP block against one built from `transformers`' own V4 modules: draft logits at every position,
one forward and chunked (its window crosses chunk boundaries)."""

import pytest
import torch

from model_workers.runner import ExtendItem, ModelRunner
from support.v4_models import TINY_V4, HFMTPReference, hf_v4, ours_like


@pytest.fixture(scope="module")
def models():
    target = hf_v4(TINY_V4, 5)
    mtp = HFMTPReference(target, 6)
    ours = ours_like(target, TINY_V4, num_mtp_layers=1)
    ours.load_state_dict(mtp.our_weights(TINY_V4["num_hidden_layers"]), strict=False)
    return target, mtp, ours


@pytest.mark.parametrize("chunks", [[30], [7, 9, 14], [1] * 30])
def test_draft_logits_equal_the_transformers_built_block(models, chunks):
    target, mtp, ours = models
    ids = torch.randint(2, 128, (31,), generator=torch.Generator().manual_seed(8)).tolist()
    expected = mtp.draft_logits(target, ids)  # [30, V]
    runner = ModelRunner(ours, num_pages=4, page_size=16)
    (table,) = runner.standalone_tables([len(ids)])
    hidden = runner.extend([ExtendItem(table, ids)])  # [31, N·D] target streams
    got, start = [], 0
    for size in chunks:  # MTP position i takes t_{i+1} and the target's streams at i
        mtp_hidden = runner.extend_mtp([ExtendItem(table, ids[start + 1 : start + 1 + size])],
                                       hidden[start : start + size], [start])
        with torch.no_grad():
            got.append(ours.mtp_logits(mtp_hidden))
        start += size
    torch.testing.assert_close(torch.cat(got), expected, atol=1e-4, rtol=0)


def test_a_draft_vocabulary_restricts_the_v4_draft_to_its_tokens(models):
    _, _, ours = models
    hidden = torch.randn(5, ours.config.hc_mult * ours.config.hidden_size, generator=torch.Generator().manual_seed(3))
    token_ids = torch.arange(0, ours.config.vocab_size, 3)
    with torch.no_grad():
        full = ours.mtp_logits(hidden)  # [5, V]
        ours.set_draft_vocab(token_ids)
        try:
            drafted = ours.draft_logits(hidden)
        finally:
            ours.set_draft_vocab(None)
    torch.testing.assert_close(drafted[:, token_ids], full[:, token_ids], atol=1e-5, rtol=0)
    assert set(drafted.argmax(-1).tolist()) <= set(token_ids.tolist())
    torch.testing.assert_close(ours.draft_logits(hidden), full)  # back to the full vocabulary
