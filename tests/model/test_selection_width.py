"""Top-k selections narrower than index_topk come in few widths: a short context's keys are padded with -1 to a
multiple of KEY_WIDTH_STEP, so decode does not meet a new product shape (a new oneDNN kernel on CPU) every step,
and the attention over the padded selection is the attention over the real keys."""

import torch

from model_workers.kernels.registry import kernel_set
from model_workers.models.dsa.backend import KEY_WIDTH_STEP, DSABackend, all_causal_keys, selection_width
from model_workers.models.dsa.batch import ForwardBatch
from model_workers.checkpoint.saver import init_weights
from model_workers.models.registry import parse_model_config
from model_workers.models.dsa.model import DSAForCausalLM
from model_workers.kernels.torch.sparse_mla import sparse_mla_attention
from model_workers.runner import ExtendItem, ModelRunner
from support.tiny_models import BASE

WIDE_TOPK = 4 * KEY_WIDTH_STEP
CONFIG = {**BASE, "model_type": "deepseek_v32", "tie_word_embeddings": True, "index_topk": WIDE_TOPK}


class WidthRecorder(DSABackend):
    def __init__(self, cache):
        super().__init__(cache, kernel_set())
        self.widths: list[int] = []

    def select_topk(self, layer_id, index_q, index_weights, topk):
        picked = super().select_topk(layer_id, index_q, index_weights, topk)
        self.widths.append(picked.shape[1])
        return picked


def test_selection_width_rounds_up_to_the_step_and_stops_at_topk():
    assert selection_width(0, 2048) == 0
    assert selection_width(1, 2048) == KEY_WIDTH_STEP
    assert selection_width(KEY_WIDTH_STEP, 2048) == KEY_WIDTH_STEP
    assert selection_width(KEY_WIDTH_STEP + 1, 2048) == 2 * KEY_WIDTH_STEP
    assert selection_width(5, 8) == 8
    assert selection_width(10_000, 2048) == 2048


def test_decode_steps_over_a_growing_context_meet_few_widths_and_pad_with_minus_one():
    model = DSAForCausalLM(parse_model_config(CONFIG), mtp_layout=[(True, False)]).eval()
    init_weights(model, std=0.3, seed=5)
    runner = ModelRunner(model, num_pages=64, page_size=4)
    runner.backend = recorder = WidthRecorder(runner.cache)
    (table,) = runner.standalone_tables([100])
    with torch.no_grad():
        hidden = runner.extend([ExtendItem(table, [3, 1, 4])])
        token = int(model.logits(hidden[-1:]).argmax())
        for _ in range(90):  # 4 .. 93 keys: one width per KEY_WIDTH_STEP keys, not one per step
            token = int(model.logits(runner.extend([ExtendItem(table, [token])], is_extend=False)).argmax())
    assert sorted(set(recorder.widths)) == [KEY_WIDTH_STEP, 2 * KEY_WIDTH_STEP]
    backend = runner.bound_backend([ExtendItem(table, [token])])
    picked = backend.select_topk(0, None, None, WIDE_TOPK)  # [1, 128]: 94 causal keys, then -1
    keys = table.num_tokens + 1
    assert picked.shape == (1, 2 * KEY_WIDTH_STEP)
    assert torch.equal(picked[0, :keys], backend.batch.key_slots[0]) and bool((picked[0, keys:] == -1).all())


def test_attention_over_a_padded_selection_is_attention_over_its_keys():
    generator = torch.Generator().manual_seed(0)
    q_latent, q_pe = torch.randn(3, 4, 32, generator=generator), torch.randn(3, 4, 16, generator=generator)
    keys = torch.randn(40, 48, generator=generator)
    ids = torch.randint(0, 40, (3, 10), generator=generator)
    padded = torch.cat([ids, torch.full((3, KEY_WIDTH_STEP - 10), -1)], dim=1)
    want = sparse_mla_attention(q_latent, q_pe, keys, ids, 0.2)
    torch.testing.assert_close(sparse_mla_attention(q_latent, q_pe, keys, padded, 0.2), want, rtol=1e-6, atol=1e-6)


def test_all_causal_keys_of_one_request_and_of_several_agree_with_the_causal_rule():
    slots = [torch.tensor([9, 4, 7, 1, 8, 2, 6, 3]), torch.tensor([5, 0, 11])]
    one = ForwardBatch(positions=torch.tensor([5, 6, 7]), request_rows=(torch.arange(3),), key_slots=(slots[0],),
                       write_slots=torch.tensor([2, 6, 3]))
    two = ForwardBatch(positions=torch.tensor([5, 6, 7, 2]), request_rows=(torch.arange(3), torch.tensor([3])),
                       key_slots=tuple(slots), write_slots=torch.tensor([2, 6, 3, 11]))
    for batch in (one, two):
        got = all_causal_keys(batch, KEY_WIDTH_STEP)  # [T, 64]
        for rows, keys in zip(batch.request_rows, batch.key_slots):
            for row in rows.tolist():
                position = int(batch.positions[row])
                want = keys[: position + 1].tolist() + [-1] * (KEY_WIDTH_STEP - position - 1)
                assert got[row].tolist() == want
