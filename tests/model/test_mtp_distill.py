"""MTP self-distillation trains the MTP layer alone toward the target's own predictions: every target tensor keeps
its bits, the draft's KL to the target falls, the windows are the target's own continuations, and the command
refuses what it cannot distil."""

import json
from dataclasses import asdict

import pytest
import torch

from cluster.cli import main
from model_workers.models.dsa.model import DSAForCausalLM
from model_workers.runner import ExtendItem, ModelRunner
from model_workers.training.distill_checkpoint import distill_checkpoint
from model_workers.training.model_card import render_card
from model_workers.training.mtp_distill import DistillRecipe, distill_losses, distill_mtp, write_windows
from model_workers.training.recipe import Recipe
from support.tiny_models import tiny_training_model

SMALL = DistillRecipe(steps=25, lr=1e-2, warmup_steps=2, batch_size=2, seq_len=13, prompt_len=4, num_windows=6,
                      write_batch=4, seed=7)



def state(model: DSAForCausalLM) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


def test_only_the_mtp_layer_changes_and_its_kl_to_the_target_falls():
    model = tiny_training_model(seed=3)
    stream = torch.arange(400) % 11  # a periodic stream: the target's continuations are learnable
    before = state(model)
    windows = write_windows(model.eval(), torch.stack([stream[i : i + 4] for i in range(4)]), 12, 4, seed=1)
    with torch.no_grad():
        first_before, second_before, _ = distill_losses(model, windows)
    log = distill_mtp(model, stream, SMALL)
    after = state(model)
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    assert changed and all(k.startswith("model.layers.2.") for k in changed)  # layer 2 = the MTP layer
    assert any(k.endswith("e_score_correction_bias") for k in changed)  # its gate is balanced too
    with torch.no_grad():
        first_after, second_after, _ = distill_losses(model, windows)
    assert first_after < 0.7 * first_before and second_after < 0.7 * second_before
    assert log["windows_written"] == SMALL.num_windows and log["trained_parameters"] > 0
    assert all(p.requires_grad for p in model.parameters())  # the model is handed back trainable as it came


def test_written_windows_are_the_prompt_and_the_targets_own_continuation():
    model = tiny_training_model(seed=5).eval()
    prompts = torch.tensor([[1, 2, 3], [4, 5, 6], [7, 8, 9]])
    windows = write_windows(model, prompts, 5, 2, seed=11)
    assert windows.shape == (3, 8) and torch.equal(windows[:, :3], prompts)
    assert torch.equal(windows, write_windows(model, prompts, 5, 3, seed=11))  # batching does not move a token
    runner = ModelRunner(model, num_pages=4, page_size=8)
    for row in (0, 2):  # even windows are greedy: each token is the target's argmax after the tokens before it
        (table,) = runner.standalone_tables([8])
        with torch.no_grad():
            logits = model.logits(runner.extend([ExtendItem(table, windows[row, :-1].tolist())]))  # [7, V]
        assert torch.equal(logits[2:].argmax(-1), windows[row, 3:])
    greedy = write_windows(model, prompts, 5, 3, seed=11, sampled_every=0)
    assert torch.equal(greedy[[0, 2]], windows[[0, 2]]) and not torch.equal(greedy[1], windows[1])


def test_a_model_without_an_mtp_layer_is_refused():
    model = tiny_training_model(with_mtp=False)
    with pytest.raises(ValueError, match="no MTP layer"):
        distill_mtp(model, torch.arange(100) % 5, SMALL)


def test_the_command_wants_a_train_tiny_checkpoint_and_another_folder(tmp_path):
    source = tmp_path / "plain"
    source.mkdir()
    with pytest.raises(ValueError, match="no model_card.json: distill-mtp takes a checkpoint written by train-tiny"):
        distill_checkpoint(source, tmp_path / "out", SMALL)
    (source / "model_card.json").write_text(json.dumps({"held_out": {}, "training": {}, "distillation": {"x": 1}}))
    with pytest.raises(ValueError, match="already distilled"):
        distill_checkpoint(source, tmp_path / "out", SMALL)
    (source / "model_card.json").write_text(json.dumps({"held_out": {}, "training": {}}))
    with pytest.raises(ValueError, match="another folder than the source"):
        distill_checkpoint(source, source, SMALL)


def test_cli_rejects_a_zero_step_count(tmp_path, capsys):
    assert main(["distill-mtp", "--model", str(tmp_path), "--out", str(tmp_path / "model"), "--steps", "0"]) == 2
    assert "--steps must be >= 1, got 0" in capsys.readouterr().err
    assert not (tmp_path / "model").exists()


def test_card_of_a_distilled_checkpoint_says_how_to_reproduce_it_and_what_it_was_before():
    card = {"held_out": {"loss": 4.5, "mtp_step1_acceptance": 0.73, "draft_vocab_size": 1024},
            "training": {"recipe": asdict(Recipe()), "steps": 720, "tokens_seen": 1474560, "minutes": 70.0},
            "sha256": {"config.json": "ab"}, "index_topk": 64, "num_hidden_layers": 4,
            "distillation": {"recipe": asdict(DistillRecipe()), "windows_written": 1024, "minutes": 20.0,
                             "held_out_before": {"mtp_step1_acceptance": 0.6303,
                                                 "mtp_step2_acceptance_teacher_forced": 0.6119}}}
    text = render_card(card)
    assert "`dsa-serve train-tiny --out DIR --steps 720` (seed 1234), then `dsa-serve distill-mtp --model DIR " \
           "--out DIR2 --steps 500`." in text
    assert "held-out mtp_step1_acceptance was\n  0.6303" in text
    assert "one window in 2 sampled at temperature 1, the others greedy" in text
