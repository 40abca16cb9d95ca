"""Property tests of docs/architecture.md, 'Invariants', 1, 2, 3 and 5, and of the causal key ranges.

Oracles are naive python re-derivations of docs/architecture.md, 'CP strategies and their layouts',
independent of cp_router's code.
"""

import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from cp_router.cp import (
    CP_IMPLS,
    CP_STRATEGIES,
    build_cp_metadata,
    can_split,
    gather_rerange,
    pad_local_rows,
    shard,
    shard_positions,
)

SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.filter_too_much])
DTYPES = [torch.float32, torch.bfloat16, torch.int64]
TRAILING_SHAPES = [(), (3,), (2, 3)]


@st.composite
def cp_batches(draw):
    """(cp_size, strategy, impl, extend_lens, prefix_lens) of a splittable batch."""
    cp_size = draw(st.integers(1, 8))
    strategy = draw(st.sampled_from(CP_STRATEGIES))
    impl = draw(st.sampled_from(CP_IMPLS))
    num_requests = draw(st.integers(1, 6))
    length = st.one_of(st.integers(1, 2 * cp_size + 1), st.integers(1, 300))  # short ones below C and 2C too
    extend_lens = draw(st.lists(length, min_size=num_requests, max_size=num_requests))
    prefix_lens = draw(st.lists(st.integers(0, 300), min_size=num_requests, max_size=num_requests))
    assume(can_split(extend_lens, cp_size, strategy))
    return cp_size, strategy, impl, extend_lens, prefix_lens


@st.composite
def global_tensors(draw, num_tokens):
    """[N, *trailing] tensor of a random dtype, random values."""
    dtype = draw(st.sampled_from(DTYPES))
    trailing = draw(st.sampled_from(TRAILING_SHAPES))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    if dtype == torch.int64:
        return torch.randint(-(2**40), 2**40, (num_tokens, *trailing), generator=gen)
    return torch.randn((num_tokens, *trailing), generator=gen).to(dtype)


def reference_layout(extend_lens, cp_size, strategy):
    """C lists of stream indices, straight from docs/architecture.md, 'CP strategies and their layouts'."""
    num_tokens = sum(extend_lens)
    if strategy == "interleave":
        return [[i for i in range(num_tokens) if i % cp_size == r] for r in range(cp_size)]
    prev, nxt = [[] for _ in range(cp_size)], [[] for _ in range(cp_size)]
    start = 0
    for extend_len in extend_lens:
        sizes = [extend_len // (2 * cp_size) + (1 if b < extend_len % (2 * cp_size) else 0) for b in range(2 * cp_size)]
        blocks = []
        for size in sizes:
            blocks.append(list(range(start, start + size)))
            start += size
        for r in range(cp_size):
            prev[r] += blocks[r]
            nxt[r] += blocks[2 * cp_size - 1 - r]
    return [prev[r] + nxt[r] for r in range(cp_size)]


def reference_labels(extend_lens, prefix_lens):
    """Per stream token (request, global position); per packed key (request, position)."""
    token_req, token_pos, key_req, key_pos = [], [], [], []
    for s, (extend_len, prefix_len) in enumerate(zip(extend_lens, prefix_lens)):
        token_req += [s] * extend_len
        token_pos += [prefix_len + t for t in range(extend_len)]
        key_req += [s] * (prefix_len + extend_len)
        key_pos += list(range(prefix_len + extend_len))
    return [torch.tensor(v) for v in (token_req, token_pos, key_req, key_pos)]


@SETTINGS
@given(batch=cp_batches(), data=st.data())
def test_round_trip_bit_exact_with_equal_collective_sizes(batch, data):
    """Invariants 1 and 5: gather_rerange(all_gather(pad(shard(x)))) == x; every rank sends the same rows."""
    cp_size, strategy, impl, extend_lens, prefix_lens = batch
    meta = build_cp_metadata(extend_lens, prefix_lens, cp_size, strategy, impl)
    x = data.draw(global_tensors(meta.num_tokens))  # [N, ...]
    sent = [pad_local_rows(shard(meta, x, r), meta.collective_rows) for r in range(cp_size)]
    assert len({t.shape for t in sent}) == 1 and sent[0].shape[0] == meta.collective_rows
    if impl == "v2":
        assert len(set(meta.per_rank_actual_token)) == 1
        assert meta.per_rank_actual_token[0] == meta.collective_rows
    restored = gather_rerange(meta, torch.cat(sent))  # [N, ...]
    assert restored.dtype == x.dtype and torch.equal(restored, x)


@SETTINGS
@given(batch=cp_batches(), data=st.data())
def test_shards_partition_the_stream_with_zero_tail_padding(batch, data):
    """Invariant 2, and the layout is exactly the architecture page's."""
    cp_size, strategy, impl, extend_lens, prefix_lens = batch
    meta = build_cp_metadata(extend_lens, prefix_lens, cp_size, strategy, impl)
    assert [t.tolist() for t in meta.local_to_global] == reference_layout(extend_lens, cp_size, strategy)
    assert torch.equal(torch.cat(meta.local_to_global).sort().values, torch.arange(meta.num_tokens))
    x = data.draw(global_tensors(meta.num_tokens))  # [N, ...]
    for cp_rank in range(cp_size):
        logical = meta.per_rank_logical_token[cp_rank]
        x_local = shard(meta, x, cp_rank)  # [T_physical, ...]
        assert x_local.shape[0] == meta.per_rank_physical_token[cp_rank] >= logical
        assert torch.equal(x_local[:logical], x[meta.local_to_global[cp_rank]])
        assert not x_local[logical:].any()
    if impl == "legacy":
        assert meta.per_rank_actual_token == meta.per_rank_logical_token
        assert sum(meta.per_rank_physical_token) % meta.align == 0  # the whole batch padded to the alignment
    else:
        assert meta.collective_rows % meta.align == 0


@SETTINGS
@given(batch=cp_batches())
def test_positions_are_global_and_both_impls_agree(batch):
    """Invariant 3: shard_positions(meta)[j] is the global position of local row j (prefix included)."""
    cp_size, strategy, impl, extend_lens, prefix_lens = batch
    meta = build_cp_metadata(extend_lens, prefix_lens, cp_size, strategy, impl)
    other_impl = build_cp_metadata(extend_lens, prefix_lens, cp_size, strategy, "v2" if impl == "legacy" else "legacy")
    _, token_pos, _, _ = reference_labels(extend_lens, prefix_lens)
    for cp_rank in range(cp_size):
        logical = meta.per_rank_logical_token[cp_rank]
        positions_local = shard_positions(meta, cp_rank)  # [T_physical]
        assert positions_local.shape[0] == meta.per_rank_physical_token[cp_rank]
        assert torch.equal(positions_local[:logical], token_pos[meta.local_to_global[cp_rank]])
        assert not positions_local[logical:].any()
        assert torch.equal(shard_positions(other_impl, cp_rank)[:logical], positions_local[:logical])


@SETTINGS
@given(batch=cp_batches())
def test_causal_range_is_exactly_own_request_up_to_own_position(batch):
    """Each local query's [key_start, key_end) holds exactly the packed keys of its own request at
    global position <= its own: checked as sets on a sample of rows, by endpoints on every row."""
    cp_size, strategy, impl, extend_lens, prefix_lens = batch
    meta = build_cp_metadata(extend_lens, prefix_lens, cp_size, strategy, impl)
    token_req, token_pos, key_req, key_pos = reference_labels(extend_lens, prefix_lens)
    assert meta.key_offsets[-1] == key_req.numel()
    keys = torch.arange(key_req.numel())  # [K]
    first_key = torch.tensor([int((key_req == s).nonzero()[0]) for s in range(len(extend_lens))])  # [R]
    for cp_rank in range(cp_size):
        logical = meta.per_rank_logical_token[cp_rank]
        idx_global = meta.local_to_global[cp_rank]  # [T_logical]
        req, pos = token_req[idx_global], token_pos[idx_global]  # [T_logical]
        start, end = meta.key_start_local[cp_rank][:logical], meta.key_end_local[cp_rank][:logical]
        assert torch.equal(meta.request_index_local[cp_rank][:logical], req)
        assert torch.equal(start, first_key[req]) and torch.equal(end, first_key[req] + pos + 1)
        rows = torch.linspace(0, logical - 1, min(logical, 16)).long()  # [<=16] sample of local rows
        in_range = (keys >= start[rows, None]) & (keys < end[rows, None])  # [rows, K]
        allowed = (key_req == req[rows, None]) & (key_pos <= pos[rows, None])  # [rows, K]
        assert torch.equal(in_range, allowed)
