"""A train-tiny checkpoint with its MTP layer self-distilled (mtp_distill.py): copied, retrained, re-evaluated.

The copy keeps every file of the source and its card's training record; the weights file is rewritten with the
same target weights (float32 -> the stored dtype and back is exact) and the new MTP layer, and the card gains
the distillation record and the held-out numbers before it.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from model_workers.checkpoint.loader import load_model
from model_workers.checkpoint.saver import save_checkpoint
from model_workers.checkpoint.tokenizer import load_tokenizer
from model_workers.training.corpus import stdlib_files, token_stream
from model_workers.training.model_card import evaluate_and_write_card
from model_workers.training.mtp_distill import DistillRecipe, distill_mtp

CARD_JSON = "model_card.json"


def distill_checkpoint(source: str | Path, out: str | Path, recipe: DistillRecipe = DistillRecipe()) -> dict:
    """Writes the distilled checkpoint to `out` (a folder other than `source`); returns its new card."""
    source, out = Path(source), Path(out)
    source_card = read_source_card(source)
    if out.exists() and out.resolve() == source.resolve():
        raise ValueError(f"--out must be another folder than the source checkpoint {source}")
    tokenizer = load_tokenizer(source)
    if tokenizer is None:
        raise ValueError(f"{source} has no tokenizer.json: distill-mtp prompts the target with tokenized text")
    config = json.loads((source / "config.json").read_text())
    model = load_model(source, torch.float32, progress=False)
    log = distill_mtp(model, token_stream(tokenizer, stdlib_files().train), recipe)
    shutil.copytree(source, out, dirs_exist_ok=True)
    save_checkpoint(model, config, out, dtype=getattr(torch, config.get("dtype", "float32")))
    history = {"held_out_before": source_card["held_out"], **log}
    return evaluate_and_write_card(out, source_card["training"], distillation=history)


def read_source_card(source: Path) -> dict:
    """The source's model_card.json (train-tiny writes it; the new card keeps its training record)."""
    path = source / CARD_JSON
    if not path.is_file():
        raise ValueError(f"{source} has no {CARD_JSON}: distill-mtp takes a checkpoint written by train-tiny "
                         "(the card records the training the distilled checkpoint keeps)")
    card = json.loads(path.read_text())
    if card.get("distillation") is not None:
        raise ValueError(f"{source} is already distilled ({CARD_JSON} has a distillation record): distil the "
                         "train-tiny checkpoint it came from instead")
    return card
