"""Our pure-torch DSA model against the transformers reference on tiny random checkpoints."""

import json
import subprocess
import sys

import pytest
import torch

from cluster.engine_setup import run_all, start_local_engine
from cluster.engine_spec import EngineOptions
from cp_router.protocol import EngineRequest
from model_workers.checkpoint.loader import load_model
from model_workers.runner import ExtendItem, ModelRunner
from support.choices import flipped_rows, prefill_with_choices, touched_rows

KINDS = ["v32", "v32_yarn", "glm_shared"]


def prompt(length: int, seed: int = 3) -> list[int]:
    return torch.randint(2, 128, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def our_prefill_logits(runner: ModelRunner, prompts: list[list[int]]) -> list[torch.Tensor]:
    tables = runner.standalone_tables([len(p) for p in prompts])
    hidden = runner.extend([ExtendItem(t, p) for t, p in zip(tables, prompts)])
    logits = runner.model.logits(hidden)
    return list(logits.split([len(p) for p in prompts]))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("length", [5, 40])
def test_prefill_logits_match_reference(reference_checkpoint, kind, length):
    ref, folder = reference_checkpoint(kind)
    runner = ModelRunner(load_model(folder, progress=False), num_pages=32, page_size=8)
    ids = prompt(length)
    with torch.no_grad():
        expected = ref(torch.tensor([ids])).logits[0]
    (ours,) = our_prefill_logits(runner, [ids])
    assert ours.shape == expected.shape
    torch.testing.assert_close(ours, expected, atol=1e-4, rtol=0)


@pytest.mark.parametrize("kind", KINDS)
def test_batched_and_chunked_prefill_equal_single_requests(reference_checkpoint, kind):
    _, folder = reference_checkpoint(kind)
    runner = ModelRunner(load_model(folder, progress=False), num_pages=64, page_size=8)
    prompts = [prompt(37, 1), prompt(3, 2), prompt(21, 3)]
    batched = our_prefill_logits(runner, prompts)
    for p, logits in zip(prompts, batched):
        torch.testing.assert_close(logits, our_prefill_logits(runner, [p])[0], atol=1e-5, rtol=0)
    (table,) = runner.standalone_tables([len(prompts[0])])  # chunked: 16 tokens, then 21 attending to the cached 16
    first = runner.extend([ExtendItem(table, prompts[0][:16])])
    second = runner.extend([ExtendItem(table, prompts[0][16:])])
    chunked = runner.model.logits(torch.cat([first, second]))
    torch.testing.assert_close(chunked, batched[0], atol=1e-5, rtol=0)


def reference_greedy(ref, ids: list[int], count: int) -> list[int]:
    out = ref.generate(torch.tensor([ids]), max_new_tokens=count, do_sample=False, pad_token_id=0)[0, len(ids):]
    return out.tolist()


@pytest.mark.parametrize("kind", KINDS)
def test_greedy_decode_matches_reference_generate(reference_checkpoint, kind):
    ref, folder = reference_checkpoint(kind)
    engine = start_local_engine(folder, EngineOptions(num_pages=16, page_size=8))
    for seed, length in [(5, 30), (6, 9)]:
        ids = prompt(length, seed)
        expected = reference_greedy(ref, ids, 32)
        (ours,) = run_all(engine, [EngineRequest(f"r{seed}", tuple(ids), 32, temperature=0.0)])
        assert ours["token_ids"] == expected
        assert len(expected) == 32
    assert engine.free_pages == [16]


def test_cli_generate_json_matches_reference(reference_checkpoint):
    ref, folder = reference_checkpoint("v32")
    ids = prompt(30, 5)
    cmd = [sys.executable, "-m", "cluster.cli", "generate", "--model", str(folder), "--prompt-ids",
           ",".join(map(str, ids)), "--max-tokens", "32", "--temperature", "0", "--dtype", "float32", "--json"]
    result = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)
    assert result["token_ids"] == reference_greedy(ref, ids, 32)


def test_bfloat16_prefill_close_to_reference_row_by_row(reference_checkpoint):
    # bf16 keeps 8 mantissa bits (~0.4% relative per op). A row whose computation makes the same discrete
    # choices as fp32 (the indexer's top-k key set, the MoE's experts, in every layer, and no key it attends
    # to came from a row that chose differently) differs by rounding only: within 0.05 on logits of magnitude
    # ~2 after 3 layers (0.021 measured). A bf16 score can swap a key or an expert at a selection boundary — a
    # discrete change the reference would make too at its own rounding: such rows are counted and capped (6 of
    # 40 measured; RoPE rotated in bf16 instead of fp32 makes it 11), and every row stays bounded (0.995).
    ref, folder = reference_checkpoint("v32")
    ids = prompt(40)
    with torch.no_grad():
        expected = ref(torch.tensor([ids])).logits[0]
    exact = prefill_with_choices(load_model(folder, progress=False), ids)
    rounded = prefill_with_choices(load_model(folder, dtype=torch.bfloat16, progress=False), ids)
    torch.testing.assert_close(exact.logits, expected, atol=1e-4, rtol=0)  # fp32 makes the reference's choices
    row_error = (rounded.logits - expected).abs().amax(-1)  # [T]
    flipped = flipped_rows(exact, rounded)
    touched = touched_rows(exact, rounded)
    assert int(flipped.sum()) <= 8, f"{int(flipped.sum())} of 40 rows chose other keys or experts (6 measured)"
    assert row_error[~touched].max() < 0.05
    assert row_error.max() < 1.5
