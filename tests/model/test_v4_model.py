"""DeepSeek-V4 end to end against `transformers`: prefill logits, chunked prefill at chunk sizes misaligned with
both compression rates, token-by-token decode, batches, rolled-back speculation, and 32 greedy tokens."""

import pytest
import torch

from model_workers.runner import ExtendItem, ModelRunner
from support.v4_models import TINY_V4, hf_v4, ours_like


@pytest.fixture(scope="module")
def pair():
    reference = hf_v4(TINY_V4, 1)
    return reference, ours_like(reference, TINY_V4)


def prompt(length: int, seed: int) -> list[int]:
    return torch.randint(2, TINY_V4["vocab_size"], (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def run_chunks(model, ids: list[int], chunks: list[int]) -> torch.Tensor:
    """Logits [len(ids), V] of one request extended chunk by chunk."""
    runner = ModelRunner(model, num_pages=16, page_size=16)
    (table,) = runner.standalone_tables([len(ids)])
    out, start = [], 0
    for size in chunks:
        hidden = runner.extend([ExtendItem(table, ids[start : start + size])])
        with torch.no_grad():
            out.append(model.logits(hidden))
        start += size
    assert start == len(ids)
    return torch.cat(out)


@pytest.mark.parametrize("length", [7, 37, 70])
def test_prefill_logits_equal_transformers(pair, length):
    reference, ours = pair
    ids = prompt(length, length)
    with torch.no_grad():
        expected = reference(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(run_chunks(ours, ids, [length]), expected, atol=1e-4, rtol=0)


@pytest.mark.parametrize("chunks", [[3] * 15 + [1], [5, 7, 11, 13, 10], [1] * 46])
def test_chunked_prefill_and_decode_equal_one_forward(pair, chunks):
    _, ours = pair
    ids = prompt(sum(chunks), 5)
    whole = run_chunks(ours, ids, [len(ids)])
    torch.testing.assert_close(run_chunks(ours, ids, chunks), whole, atol=2e-5, rtol=0)


def test_a_batch_of_requests_equals_each_alone(pair):
    _, ours = pair
    prompts = [prompt(n, 40 + n) for n in (9, 30, 17)]
    runner = ModelRunner(ours, num_pages=16, page_size=16)
    tables = runner.standalone_tables([len(p) for p in prompts])
    splits = [[4, 5], [13, 17], [8, 9]]
    rows = [[] for _ in prompts]
    for step in range(2):  # two batched steps: every request extends by its next chunk
        items, lengths = [], []
        for s, p in enumerate(prompts):
            start = sum(splits[s][:step])
            items.append(ExtendItem(tables[s], p[start : start + splits[s][step]]))
            lengths.append(splits[s][step])
        hidden = runner.extend(items)
        with torch.no_grad():
            for s, part in enumerate(ours.logits(hidden).split(lengths)):
                rows[s].append(part)
    for s, p in enumerate(prompts):
        torch.testing.assert_close(torch.cat(rows[s]), run_chunks(ours, p, [len(p)]), atol=2e-5, rtol=0)


def test_rolled_back_drafts_leave_no_trace(pair):
    """Verify-style steps that write k + 1 tokens and keep fewer, some of them across window-closing positions
    of both rates, then continue: the logits equal a run that never saw the rejected tokens."""
    _, ours = pair
    ids = prompt(40, 9)
    runner = ModelRunner(ours, num_pages=16, page_size=16)
    (table,) = runner.standalone_tables([64])
    runner.extend([ExtendItem(table, ids[:6])])
    got = []
    position = 6
    for keep in (1, 3, 2, 4, 1, 2, 3, 1, 4, 2, 3, 1):
        drafts = ids[position : position + keep] + [int(t) % 100 + 2 for t in range(4 - keep + 1)]
        hidden = runner.extend([ExtendItem(table, drafts)])  # writes positions position..position+4
        with torch.no_grad():
            got.append(ours.logits(hidden[:keep]))
        position += keep
        table.num_tokens = position  # the rejected drafts' state is behind the new end
    expected = run_chunks(ours, ids[:position], [position])[6:]
    torch.testing.assert_close(torch.cat(got), expected, atol=2e-5, rtol=0)


def test_32_greedy_tokens_equal_transformers_generate(pair):
    reference, ours = pair
    ids = prompt(21, 3)
    with torch.no_grad():
        expected = reference.generate(torch.tensor([ids]), max_new_tokens=32, do_sample=False, eos_token_id=None,
                                      pad_token_id=0)[0, len(ids):].tolist()
    runner = ModelRunner(ours, num_pages=16, page_size=16)
    (table,) = runner.standalone_tables([len(ids) + 32])
    tokens, feed = [], ids
    for _ in range(32):
        hidden = runner.extend([ExtendItem(table, feed)])
        with torch.no_grad():
            feed = [int(ours.logits(hidden[-1:]).argmax())]
        tokens += feed
    assert tokens == expected


def test_hash_routing_reads_each_rows_own_token_id(pair, monkeypatch):
    """The checkpoint's tid2eid sends tokens to different experts, so a row routed by its neighbour's id changes
    the output: CP / EP equality therefore also proves that ids follow their rows."""
    from model_workers.models.deepseek_v4.blocks import V4Gate

    _, ours = pair
    ids = prompt(20, 12)
    aligned = run_chunks(ours, ids, [20])
    original = V4Gate.forward
    monkeypatch.setattr(V4Gate, "forward", lambda self, x, token_ids=None: original(self, x, token_ids.roll(1)))
    shifted = run_chunks(ours, ids, [20])
    assert (shifted - aligned).abs().amax(-1).min() > 1e-3  # every row changes


def test_kv_bytes_per_token_measured_equal_the_formula(pair):
    """What the cache holds for a request after n tokens: compressed entries that grow by (Dh + d_I) / m per token
    on CSA layers and Dh / m' on HCA layers (the formula `bytes_per_token`), plus a bounded state."""
    _, ours = pair
    runner = ModelRunner(ours, num_pages=16, page_size=16)
    (table,) = runner.standalone_tables([96])
    stored = []
    for length in (32, 96):
        runner.extend([ExtendItem(table, prompt(length - table.num_tokens, length))])
        stored.append(runner.cache.stored_bytes(table))
    element = 4  # float32 model
    assert stored[1]["compressed_sparse_attention"]["entries"] == 2 * (96 // 4) * (32 + 16) * element
    assert stored[1]["heavily_compressed_attention"]["entries"] == (96 // 8) * 32 * element
    assert stored[1]["sliding_attention"]["entries"] == 0
    growth = sum(part["entries"] for part in stored[1].values()) - sum(part["entries"] for part in stored[0].values())
    assert growth == runner.cache.bytes_per_token() * (96 - 32)
    assert stored[1]["sliding_attention"]["state"] == stored[0]["sliding_attention"]["state"]  # a window tail
    assert sum(part["state"] for part in stored[1].values()) <= runner.cache.request_bytes()


def test_small_query_blocks_give_the_same_logits(pair, monkeypatch):
    """Queries are attended in blocks (window rows as one contiguous run per block, indexer picks per block):
    blocks of 5 give transformers' logits too."""
    reference, ours = pair
    monkeypatch.setattr("model_workers.models.deepseek_v4.attention.QUERY_BLOCK", 5)
    ids = prompt(37, 37)
    with torch.no_grad():
        expected = reference(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(run_chunks(ours, ids, [20, 17]), expected, atol=1e-4, rtol=0)


@pytest.mark.parametrize("page_size", [4, 16, 32])
def test_compressed_entries_live_in_the_requests_pages(pair, page_size):
    """Entries are paged (entry w in the page holding position w·m): scattered pages of any page size that the
    rates (4, 8) divide or that divides them give the same logits, and the pages hold the entries."""
    from model_workers.page_table import PageTable

    _, ours = pair
    ids = prompt(45, 45)
    runner = ModelRunner(ours, num_pages=40, page_size=page_size)
    pages = list(range(39, 39 - (45 + page_size - 1) // page_size, -1))  # descending, far from 0
    table = PageTable(pages)
    hidden = runner.extend([ExtendItem(table, ids[:20])])
    hidden = torch.cat([hidden, runner.extend([ExtendItem(table, ids[20:])])])
    with torch.no_grad():
        torch.testing.assert_close(ours.logits(hidden), run_chunks(ours, ids, [45]), atol=2e-5, rtol=0)
    hca = runner.cache.entries[(2, "compressor")]  # layer 2 is HCA (rate 8)
    written = torch.nonzero(hca.abs().sum(-1)).flatten()
    assert written.numel() == 45 // 8 and bool((written >= min(pages) * max(1, page_size // 8)).all())


def test_page_sizes_the_rates_do_not_divide_are_refused(pair):
    _, ours = pair
    with pytest.raises(ValueError, match="page_size=6 and the compressed_sparse_attention rate 4 must divide"):
        ModelRunner(ours, num_pages=4, page_size=6)
