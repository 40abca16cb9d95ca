"""Plans cross the Ray call with their tensors as numpy arrays (cp_router/cp/wire.py): same values, dtypes, shapes."""

import pickle

import numpy as np
import torch

from cp_router.cp.metadata import build_cp_metadata
from cp_router.plans import PrefillRequest, PrefillShard
from cp_router.cp.wire import from_wire, to_wire


def shard() -> PrefillShard:
    meta = build_cp_metadata([5, 3], [0, 2], cp_size=2, strategy="zigzag", impl="v2").rank_view(1)
    rows = meta.num_logical
    return PrefillShard((PrefillRequest("a", 0), PrefillRequest("b", 1)), meta, torch.arange(rows) + 7,
                        torch.full((rows,), -1), ((1, 2), (3,)))


def test_a_shard_pickles_to_the_same_tensors_without_torch_storages():
    original = shard()
    data = pickle.dumps(original)
    assert b"torch.storage" not in data and b"_rebuild_tensor" not in data
    copy = pickle.loads(data)
    assert copy.requests == original.requests and copy.page_tables == original.page_tables
    for name in ("token_ids_local", "next_ids_local"):
        assert torch.equal(getattr(copy, name), getattr(original, name))
        assert getattr(copy, name).dtype == torch.int64
    for name in ("positions_local", "request_index_local", "restore_index"):
        theirs, ours = getattr(copy.meta, name), getattr(original.meta, name)
        assert torch.equal(theirs, ours) and theirs.dtype == ours.dtype and theirs.shape == ours.shape
    assert copy.meta.extend_lens == original.meta.extend_lens and copy.meta.cp_rank == 1


def test_read_only_arrays_come_back_as_writable_tensors_and_bf16_stays_a_tensor():
    array = np.arange(4)
    array.setflags(write=False)
    tensor = from_wire(array)
    tensor += 1  # a zero-copy deserializer hands out read-only arrays: copied, not shared
    assert tensor.tolist() == [1, 2, 3, 4] and array.tolist() == [0, 1, 2, 3]
    half = torch.ones(3, dtype=torch.bfloat16)
    assert to_wire(half) is half
    assert [t.tolist() for t in from_wire(to_wire((torch.tensor([1]), torch.tensor([2, 3]))))] == [[1], [2, 3]]
