"""The default model's recipe and card: the depth flag reaches the config, and the card says how to reproduce it."""

from dataclasses import asdict

import pytest

from cluster.cli import main
from model_workers.training.model_card import render_card
from model_workers.training.recipe import Recipe, tiny_config_json


def card_for(layers: int) -> dict:
    recipe = Recipe(num_hidden_layers=layers)
    training = {"recipe": asdict(recipe), "steps": 720, "tokens_seen": 1474560, "minutes": 70.0}
    return {"held_out": {"loss": 4.5, "draft_vocab_size": 1024}, "training": training, "sha256": {"config.json": "ab"},
            "index_topk": 64, "num_hidden_layers": layers}


def test_recipe_depth_sets_the_config_layer_count():
    assert tiny_config_json(6144, 0)["num_hidden_layers"] == Recipe().num_hidden_layers == 4
    assert tiny_config_json(6144, 0, num_hidden_layers=8)["num_hidden_layers"] == 8


@pytest.mark.parametrize("layers, command", [(4, "--steps 720` (seed"), (8, "--steps 720 --layers 8` (seed")])
def test_card_names_the_depth_and_the_command_that_reproduces_it(layers, command):
    text = render_card(card_for(layers))
    assert f"{layers} decoder layers and one MTP layer" in text
    assert f"`dsa-serve train-tiny --out DIR {command}" in text
    assert f"`model.layers.{layers}.*`" in text


def test_train_tiny_rejects_a_zero_depth_before_training(tmp_path, capsys):
    assert main(["train-tiny", "--out", str(tmp_path / "model"), "--layers", "0"]) == 2
    assert "dsa-serve train-tiny: error: --layers must be >= 1, got 0" in capsys.readouterr().err
    assert not (tmp_path / "model").exists()
