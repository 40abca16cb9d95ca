"""DeepSeek-V4's rollback depth: every per-request tail (cache.py `RowsTail`: each layer's sliding-window K = V rows,
MTP included, and the CSA / HCA compressors' and the CSA indexer's projected rows) keeps exactly ROLLBACK_TOKENS
positions more than the next forward needs, so a forward may restart that many positions before the end of
what it wrote (speculative rollback, prefix-cache hits).

Guards: (1) a restart exactly ROLLBACK_TOKENS deep, across closing windows of both rates, gives the logits of a
run that never wrote the rolled-back tokens (target and MTP layer); (2) the tails keep exactly the positions
the keep rule of backend.py names, no fewer (a shallower rollback limit) and no more (unbounded state);
(3) one position deeper raises `StateLost` instead of computing with rows that are gone."""

import pytest
import torch

from model_workers.models.deepseek_v4.cache import ROLLBACK_TOKENS, StateLost
from model_workers.models.deepseek_v4.config import CSA, HCA, parse_v4_config
from model_workers.models.deepseek_v4.model import DeepseekV4ForCausalLM
from model_workers.runner import ExtendItem, ModelRunner
from support.v4_models import TINY_V4, randomize_v4

R = ROLLBACK_TOKENS
PAGE_SIZE, NUM_PAGES = 16, 5  # room for 80 positions: the longest run ends at 32 + 16


@pytest.fixture(scope="module")
def model():
    """The tiny V4 (window 8, CSA rate 4, HCA rate 8) with one MTP layer, every weight random."""
    ours = DeepseekV4ForCausalLM(parse_v4_config(TINY_V4), num_mtp_layers=1)
    return randomize_v4(ours, 21, TINY_V4["n_routed_experts"]).eval()


def tokens(length: int, seed: int) -> list[int]:
    return torch.randint(2, TINY_V4["vocab_size"], (length,), generator=torch.Generator().manual_seed(seed)).tolist()


class Request:
    """One request on its own runner: target forwards and MTP forwards at given start positions."""

    def __init__(self, model):
        self.model = model
        self.runner = ModelRunner(model, num_pages=NUM_PAGES, page_size=PAGE_SIZE)
        (self.table,) = self.runner.standalone_tables([NUM_PAGES * PAGE_SIZE])

    def target(self, start: int, ids: list[int]) -> torch.Tensor:
        """Target hidden [len(ids), N·D] of positions start.. (rolling back to `start` if it wrote further)."""
        self.table.num_tokens = start
        return self.runner.extend([ExtendItem(self.table, ids)])

    def mtp(self, start: int, next_ids: list[int], prev_hidden: torch.Tensor) -> torch.Tensor:
        """MTP logits of positions start.. (position i takes t_{i+1} and the target's streams at i)."""
        hidden = self.runner.extend_mtp([ExtendItem(self.table, next_ids)], prev_hidden, [start])
        with torch.no_grad():
            return self.model.mtp_logits(hidden)

    def both(self, start: int, ids: list[int], next_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """One speculative step's two forwards over positions start..: (target logits, MTP logits)."""
        hidden = self.target(start, ids)
        with torch.no_grad():
            return self.model.logits(hidden), self.mtp(start, next_ids, hidden)


def wrong(ids: list[int]) -> list[int]:
    """Tokens that differ from `ids` at every position (shifted ids)."""
    return [(t + 37) % (TINY_V4["vocab_size"] - 2) + 2 for t in ids]


def write_then_roll_back(model, ids: list[int], restart: int, steps: int) -> Request:
    """True tokens 0..restart-1, then ROLLBACK_TOKENS wrong ones at restart.. in `steps` forwards (draft-like
    steps or one chunk): the request has written positions 0..restart+R-1, of which restart.. are wrong."""
    request = Request(model)
    request.both(0, ids[:restart], ids[1 : restart + 1])
    position = restart
    for size in [R // steps + (i < R % steps) for i in range(steps)]:
        request.both(position, wrong(ids[position : position + size]), wrong(ids[position + 1 : position + size + 1]))
        position += size
    assert position == restart + R
    return request


def expected_keep(config, layer_id: int, name: str, end: int) -> int:
    """First position a tail keeps after a forward ending at `end` (backend.py's keep rule): a window tail the
    W - 1 positions before `end - R` (what a restart there reads) on; a compressor the whole windows from
    `end - R`'s own window on, CSA (compressor and indexer) one window more (its next entry pools that
    window's Ca half)."""
    if name == "window":
        return max(0, end - (config.sliding_window - 1) - R)
    rate = config.compress_rate(layer_id)
    lookback = 1 if config.layer_types[layer_id] == CSA else 0
    return max(0, ((end - R) // rate - lookback) * rate)


def expected_tails(config, num_layers: int) -> set:
    keys = {(layer, "window") for layer in range(num_layers)}
    for layer, kind in enumerate(config.layer_types):
        keys |= {(layer, "compressor")} if kind in (CSA, HCA) else set()
        keys |= {(layer, "indexer")} if kind == CSA else set()
    return keys


def assert_tails_keep_exactly(request: Request, end: int) -> None:
    """Every tail of the request (MTP layer included) keeps rows of exactly positions keep..end-1."""
    config, state = request.model.config, request.runner.cache.states[request.table.pages[0]]
    assert set(state) == expected_tails(config, config.num_hidden_layers + request.model.num_mtp_layers)
    for (layer_id, name), kept in sorted(state.items()):
        tail = kept if name == "window" else kept.rows
        keep = expected_keep(config, layer_id, name, end)
        kept_end = tail.start + tail.rows.shape[0]
        assert (tail.start, kept_end) == (keep, end), \
            f"layer {layer_id} {name} after a forward ending at {end}: keeps {tail.start}..{kept_end - 1}, " \
            f"the rule says {keep}..{end - 1}"


# restart 23: one before a boundary of both rates (a keep rule one position short loses a whole window of rows);
# restart 32: on a boundary of both; the R rolled-back positions span 4 CSA and 2 HCA window boundaries either way.
@pytest.mark.parametrize("restart", [23, 32])
@pytest.mark.parametrize("steps", [1, 4])
def test_a_rollback_exactly_rollback_tokens_deep_leaves_no_trace(model, restart, steps):
    end = restart + R
    ids = tokens(end + 1, restart)
    clean = Request(model)  # never sees a wrong token; the same chunks as the rolled-back run
    clean.both(0, ids[:restart], ids[1 : restart + 1])
    expected = clean.both(restart, ids[restart:end], ids[restart + 1 : end + 1])

    rolled = write_then_roll_back(model, ids, restart, steps)
    got = rolled.both(restart, ids[restart:end], ids[restart + 1 : end + 1])  # exactly R positions back
    torch.testing.assert_close(got[0], expected[0], atol=2e-5, rtol=0)  # target logits
    torch.testing.assert_close(got[1], expected[1], atol=2e-5, rtol=0)  # MTP logits
    assert_tails_keep_exactly(rolled, end)


@pytest.mark.parametrize("end", [5, 8, 16, 17, 23, 24, 31, 45])
def test_tails_keep_exactly_the_window_plus_the_rollback_margin(model, end):
    """In chunks of at most 7 (decode-like steps and prefill chunks), below and past every margin."""
    ids, request, position = tokens(end + 1, end), Request(model), 0
    while position < end:
        size = min(7, end - position)
        request.both(position, ids[position : position + size], ids[position + 1 : position + size + 1])
        position += size
        assert_tails_keep_exactly(request, position)


@pytest.mark.parametrize("restart", [23, 32])
def test_one_position_deeper_raises_state_lost(model, restart):
    ids = tokens(restart + R + 1, restart)
    request = write_then_roll_back(model, ids, restart, steps=1)
    too_deep = restart - 1
    with pytest.raises(StateLost, match="rollback deeper than"):
        request.target(too_deep, ids[too_deep : too_deep + 2])
    hidden = torch.zeros(2, model.hidden_width)
    with pytest.raises(StateLost, match="rollback deeper than"):
        request.mtp(too_deep, ids[too_deep + 1 : too_deep + 3], hidden)


# A forward that starts where an HCA window opens reads no earlier window (needed_from == start); the rows kept
# before that start must still stay, as the keep rule says, or a later rollback across it raises StateLost
# (a bug this test found in `RowsTail.extend`).
def test_a_forward_starting_on_an_hca_boundary_keeps_the_rollback_margin(model):
    """0..39 in one chunk, then 40..43 (40 opens an HCA window): a restart R positions back, at 28, needs the HCA
    rows of window 24..31, which the rule keeps after a forward ending at 44."""
    ids, request, clean = tokens(45, 40), Request(model), Request(model)
    request.both(0, ids[:40], ids[1:41])
    request.both(40, ids[40:44], ids[41:45])
    assert_tails_keep_exactly(request, 44)
    clean.both(0, ids[:28], ids[1:29])
    expected, got = (run.both(28, ids[28:44], ids[29:45]) for run in (clean, request))
    torch.testing.assert_close(got, expected, atol=2e-5, rtol=0)
