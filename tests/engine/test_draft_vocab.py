"""The draft head over a reduced vocabulary: its logits, the token map files and settings, and that speculation
with it stays lossless (greedy: the same tokens as plain decoding, whatever the map leaves out)."""

import json

import pytest
import torch
from pydantic import ValidationError

from cluster.engine_setup import run_all
from cluster.engine_spec import EngineOptions
from cluster.serve_settings import ServeAppArgs
from model_workers.checkpoint.draft_vocab import read_token_map, resolve_token_map
from model_workers.models.common.draft_vocab import NOT_DRAFTED, DraftVocab
from model_workers.training.recipe import most_frequent_tokens
from support.engines import local_engine, make_requests

VOCAB = 120  # the tiny reference models' vocabulary


def test_draft_logits_are_the_full_heads_on_the_map_and_never_win_elsewhere():
    torch.manual_seed(0)
    head = torch.randn(50, 8)
    ids = torch.tensor([7, 3, 41, 12])
    normed = torch.randn(5, 8)
    logits = DraftVocab(ids, head)(normed)  # [5, 50]
    full = normed @ head.t()
    torch.testing.assert_close(logits[:, ids], full[:, ids])
    outside = torch.ones(50, dtype=torch.bool)
    outside[ids] = False
    assert (logits[:, outside] == NOT_DRAFTED).all()
    assert set(logits.argmax(-1).tolist()) <= set(ids.tolist())
    assert torch.isfinite((logits / 0.01).softmax(-1)).all()  # temperature keeps every row finite


@pytest.mark.parametrize("bad, message", [([], "non-empty"), ([3, 3], "distinct"), ([0, 50], r"\[0, 50\)"),
                                          ([-1], r"\[0, 50\)")])
def test_bad_token_ids_are_refused_with_the_reason(bad, message):
    with pytest.raises(ValueError, match=message):
        DraftVocab(torch.tensor(bad, dtype=torch.long), torch.zeros(50, 4))


def test_token_map_files_json_list_json_object_and_sglang_pt(tmp_path):
    (tmp_path / "list.json").write_text(json.dumps([5, 1, 9]))
    (tmp_path / "object.json").write_text(json.dumps({"token_ids": [5, 1, 9], "note": "x"}))
    torch.save(torch.tensor([5, 1, 9]), tmp_path / "hot.pt")
    for name in ("list.json", "object.json", "hot.pt"):
        assert read_token_map(tmp_path / name, VOCAB).tolist() == [5, 1, 9]
    assert resolve_token_map("none", tmp_path, VOCAB) is None
    assert resolve_token_map("auto", tmp_path, VOCAB) is None  # the folder ships no draft_vocab.json
    (tmp_path / "draft_vocab.json").write_text(json.dumps({"token_ids": [2, 4]}))
    assert resolve_token_map("auto", tmp_path, VOCAB).tolist() == [2, 4]


def test_bad_token_map_files_name_the_setting_and_the_file(tmp_path):
    (tmp_path / "far.json").write_text(json.dumps([1, 500]))
    (tmp_path / "junk.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"speculative_token_map: .*far.json.*\[0, 120\)"):
        read_token_map(tmp_path / "far.json", VOCAB)
    with pytest.raises(ValueError, match=r"speculative_token_map: .*junk.json is not a token map"):
        read_token_map(tmp_path / "junk.json", VOCAB)
    with pytest.raises(ValidationError, match="speculative_token_map must be 'auto', 'none' or a token map file"):
        ServeAppArgs(speculative_token_map=str(tmp_path / "missing.json"))
    with pytest.raises(ValueError, match="speculative_token_map"):
        EngineOptions(speculative_token_map=str(tmp_path / "missing.json"))


def test_most_frequent_tokens_in_order_with_coverage():
    stream = torch.tensor([4, 4, 4, 2, 2, 7, 1, 1, 1, 1])
    assert most_frequent_tokens(stream, 10, 3) == ([1, 4, 2], pytest.approx(0.9))
    assert most_frequent_tokens(torch.tensor([3, 5]), 10, 1)[0] == [3]  # a tie goes to the lower id


def test_greedy_speculation_over_a_partial_map_equals_plain_decoding(reference_checkpoint, tmp_path):
    folder = reference_checkpoint("v32", mtp=True)[1]
    requests = make_requests([3, 17, 45], 14, VOCAB, prompt_seed=1, temperature=0.0, ignore_eos=True)
    plain = run_all(local_engine(folder, EngineOptions(num_pages=64, page_size=8)), requests)
    token_map = tmp_path / "even.json"
    token_map.write_text(json.dumps(list(range(0, VOCAB, 2))))  # half the vocabulary: many targets are never drafted
    engine = local_engine(folder, EngineOptions(num_speculative_steps=2, num_pages=64, page_size=8,
                                                speculative_token_map=str(token_map)))
    assert run_all(engine, requests) == plain
    assert 0 < engine.stats.drafted and engine.stats.accepted < engine.stats.drafted
