"""Held-out evaluation of a trained checkpoint through the inference path, and its model card.

Numbers: loss / perplexity and next-token accuracy of the target; the MTP head's greedy acceptance in a
teacher-forced pass (argmax of the MTP logits at i == the target's argmax for token i+2, what one-step
speculation accepts), and for a second recursive MTP step, both teacher-forced and chained on the draft.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch
import torch.nn.functional as F

from model_workers.checkpoint.draft_vocab import DRAFT_VOCAB_FILE, TOKEN_MAP_AUTO, resolve_token_map
from model_workers.checkpoint.loader import load_model
from model_workers.checkpoint.tokenizer import load_tokenizer
from model_workers.runner import ExtendItem, ModelRunner
from model_workers.training.corpus import HELD_OUT_EVERY, stdlib_files, token_stream
from model_workers.training.recipe import Recipe

CARD_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", DRAFT_VOCAB_FILE)


def file_hashes(model_dir: Path) -> dict[str, str]:
    return {name: hashlib.sha256((model_dir / name).read_bytes()).hexdigest() for name in CARD_FILES
            if (model_dir / name).is_file()}


@torch.inference_mode()
def window_metrics(runner: ModelRunner, window: list[int]) -> dict[str, torch.Tensor]:
    """Per-position outcomes for one window of held-out tokens (S tokens in, S-3 positions scored)."""
    model, (table,) = runner.model, runner.standalone_tables([len(window)])
    hidden = runner.extend([ExtendItem(table, window[:-1])])  # [S-1, hidden] for t_0..t_{S-2}
    logits = model.logits(hidden)
    greedy = logits.argmax(-1)  # target's choice for token i+1
    mtp_hidden = runner.extend_mtp([ExtendItem(table, window[1:])], hidden, [0])
    draft1 = model.mtp_logits(mtp_hidden).argmax(-1)  # MTP's guess for token i+2
    draft1_reduced = model.draft_logits(mtp_hidden).argmax(-1)  # the same over the draft vocabulary
    forced = runner.extend_mtp([ExtendItem(table, window[2:])], mtp_hidden[:-1], [0])
    chained = runner.extend_mtp([ExtendItem(table, draft1[:-1].tolist())], mtp_hidden[:-1], [0])
    n = len(window) - 3
    targets = torch.tensor(window[1:])
    return {
        "nll": F.cross_entropy(logits[:n], targets[:n], reduction="none"),
        "correct": greedy[:n] == targets[:n],
        "mtp1": draft1[:n] == greedy[1 : n + 1],
        "mtp1_draft_vocab": draft1_reduced[:n] == greedy[1 : n + 1],
        "mtp2_forced": model.mtp_logits(forced).argmax(-1)[:n] == greedy[2 : n + 2],
        "mtp2_chained": model.mtp_logits(chained).argmax(-1)[:n] == greedy[2 : n + 2],
    }


def evaluate_held_out(model_dir: str | Path, windows: int = 24, length: int = 512) -> dict:
    model = load_model(model_dir, progress=False)
    model.set_draft_vocab(resolve_token_map(TOKEN_MAP_AUTO, model_dir, model.config.vocab_size))
    runner = ModelRunner(model, num_pages=64, page_size=64)
    stream = token_stream(load_tokenizer(model_dir), stdlib_files().held_out).tolist()
    step = max(length, (len(stream) - length) // windows)
    parts = [window_metrics(runner, stream[s : s + length]) for s in range(0, step * windows, step)]
    joined = {k: torch.cat([p[k] for p in parts]) for k in parts[0]}
    step1 = joined["mtp1"]
    loss = float(joined["nll"].float().mean())
    return {
        "tokens_scored": int(joined["nll"].numel()),
        "loss": loss,
        "perplexity": float(torch.tensor(loss).exp()),
        "next_token_accuracy": float(joined["correct"].float().mean()),
        "mtp_step1_acceptance": float(step1.float().mean()),
        "mtp_step1_acceptance_draft_vocab": float(joined["mtp1_draft_vocab"].float().mean()),
        "draft_vocab_size": model.draft_vocab.size if model.draft_vocab is not None else model.config.vocab_size,
        "mtp_step2_acceptance_teacher_forced": float(joined["mtp2_forced"].float().mean()),
        "mtp_step2_acceptance_after_step1": float(joined["mtp2_chained"][step1].float().mean()),
    }


def evaluate_and_write_card(model_dir: str | Path, train_log: dict, distillation: dict | None = None) -> dict:
    """`distillation`: the MTP self-distillation's record (distill_checkpoint.py), None for a train-tiny run."""
    model_dir = Path(model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    card = {"held_out": evaluate_held_out(model_dir), "training": train_log, "sha256": file_hashes(model_dir),
            "index_topk": config["index_topk"], "num_hidden_layers": config["num_hidden_layers"],
            "distillation": distillation}
    (model_dir / "model_card.json").write_text(json.dumps(card, indent=2) + "\n")
    (model_dir / "MODEL_CARD.md").write_text(render_card(card))
    return card


def distillation_lines(distillation: dict | None) -> str:
    """The card's bullet on MTP self-distillation ('' without one)."""
    if distillation is None:
        return ""
    recipe, before = distillation["recipe"], distillation["held_out_before"]
    return f"""- MTP self-distillation (`distill-mtp`, target frozen): {distillation["windows_written"]} windows the target
  wrote itself ({recipe["prompt_len"]} training-stream tokens, then its own continuation: {continuations(recipe)}),
  {recipe["steps"]} steps of {recipe["batch_size"]}×{recipe["seq_len"]} positions (AdamW, learning rate {recipe["lr"]:g}), KL divergence
  from the target's next-token distribution (recursive second draft weight {recipe["recursive_weight"]}),
  {distillation["minutes"]:.1f} minutes. Before it, held-out mtp_step1_acceptance was
  {before["mtp_step1_acceptance"]:.4f} and mtp_step2_acceptance_teacher_forced {before["mtp_step2_acceptance_teacher_forced"]:.4f}.
"""


def continuations(recipe: dict) -> str:
    """How the distillation's windows were continued, from its recipe's `sampled_every`."""
    every = recipe["sampled_every"]
    if every == 0:
        return "greedy"
    if every == 1:
        return "sampled at temperature 1"
    return f"one window in {every} sampled at temperature 1, the others greedy"


def reproduce_distillation(distillation: dict | None) -> str:
    if distillation is None:
        return ""
    return f", then `dsa-serve distill-mtp --model DIR --out DIR2 --steps {distillation['recipe']['steps']}`"


def render_card(card: dict) -> str:
    held, train = card["held_out"], card["training"]
    metrics = "\n".join(f"| {k} | {v:.4f} |" if isinstance(v, float) else f"| {k} | {v} |" for k, v in held.items())
    hashes = "\n".join(f"| {k} | `{v}` |" for k, v in card["sha256"].items())
    layers = card["num_hidden_layers"]
    layers_flag = "" if layers == Recipe.num_hidden_layers else f" --layers {layers}"
    return f"""# dsa-serve tiny default model

A small DeepSeek-V3.2-format (`deepseek_v32`) model with DSA sparse attention (lightning indexer, top-k
{card['index_topk']}), {layers} decoder layers and one MTP layer, trained on this machine from the Python standard library
sources. It completes Python code; it exists so `make serve` shows CP prefill and speculative decoding on real text.

- Corpus: the running interpreter's stdlib `*.py` files (tests, idlelib, lib2to3,
  site-packages and the generated data tables of encodings/ and pydoc_data/ left out),
  sorted; every {HELD_OUT_EVERY}th file is held out.
- Tokenizer: byte-level BPE (`tokenizers`), vocabulary {train["recipe"]["vocab_size"]}.
- Training: {train["steps"]} steps of {train["recipe"]["batch_size"]}×{train["recipe"]["seq_len"]} tokens
  ({train["tokens_seen"]} tokens, {train["minutes"]:.1f} minutes on 2 CPU cores, float32): dense warm-up for the
  first {int(train["recipe"]["dense_fraction"] * 100)}% with the indexer trained by KL divergence to the
  head-summed attention, then top-k sparse attention; MTP loss weight {train["recipe"]["mtp_weight"]}
  (recursive second step {train["recipe"]["mtp2_weight"]}); auxiliary-loss-free expert balancing.
{distillation_lines(card.get("distillation"))}- Reproduce: `dsa-serve train-tiny --out DIR --steps {train["steps"]}{layers_flag}` (seed {train["recipe"]["seed"]}){
reproduce_distillation(card.get("distillation"))}.
- Draft vocabulary (`draft_vocab.json`): the {card["held_out"].get("draft_vocab_size")} most frequent training tokens;
  speculation drafts over them only (`--speculative-token-map`), verification reads the full vocabulary.
- The MTP layer sits at `model.layers.{layers}.*`; `transformers`' `DeepseekV32ForCausalLM` loads the checkpoint and
  ignores it.

## Held-out evaluation (inference path: paged cache, sparse top-k)

| metric | value |
|---|---|
{metrics}

## Files

| file | sha256 |
|---|---|
{hashes}
"""
