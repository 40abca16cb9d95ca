"""Train the tiny default model: BPE over the stdlib, dense warm-up with indexer KL, then sparse top-k training.

`train_tiny(out_dir, minutes=..., steps=...)` writes a loadable checkpoint (config.json, model.safetensors,
tokenizer files) and returns the training log. With `steps` given, runs are exactly reproducible; with
only `minutes`, the step count is calibrated to the budget on the first steps and recorded.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict
from pathlib import Path

import torch
from torch import nn
from tqdm import tqdm

from model_workers.checkpoint.draft_vocab import save_draft_vocab
from model_workers.checkpoint.saver import init_weights, save_checkpoint
from model_workers.models.registry import parse_model_config
from model_workers.models.dsa.model import DSAForCausalLM
from model_workers.models.dsa.moe import MoEGate
from model_workers.training.corpus import EOS_TOKEN, save_tokenizer, stdlib_files, token_stream, train_tokenizer
from model_workers.training.recipe import Recipe, batch_losses, most_frequent_tokens, sample_windows, tiny_config_json

CALIBRATION_STEPS = 5  # step 1 pays one-off allocation costs; steps 2..5 time the budget


def learning_rate(recipe: Recipe, step: int, total_steps: int) -> float:
    if step < recipe.warmup_steps:
        return recipe.lr * (step + 1) / recipe.warmup_steps
    progress = (step - recipe.warmup_steps) / max(1, total_steps - recipe.warmup_steps)
    cosine = 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    return recipe.lr * (recipe.min_lr_ratio + (1 - recipe.min_lr_ratio) * cosine)


class ExpertBalancer:
    """DeepSeek's auxiliary-loss-free balancing: nudge each gate's bias toward under-loaded experts."""

    def __init__(self, model: nn.Module, rate: float):
        """Balances every MoE gate inside `model` (a whole model, or one layer of it)."""
        self.rate, self.counts = rate, {}
        self.hooks = [gate.register_forward_hook(self._record) for gate in model.modules() if isinstance(gate, MoEGate)]

    def remove(self) -> None:
        """Stops recording (the gates' forward hooks go)."""
        for hook in self.hooks:
            hook.remove()
        self.hooks, self.counts = [], {}

    def _record(self, gate, _inputs, output) -> None:
        expert_ids = output[0]
        counts = torch.bincount(expert_ids.reshape(-1), minlength=gate.weight.shape[0]).float()
        self.counts[gate] = self.counts.get(gate, 0) + counts

    @torch.no_grad()
    def update(self) -> None:
        for gate, counts in self.counts.items():
            gate.e_score_correction_bias += self.rate * torch.sign(counts.mean() - counts)
        self.counts = {}


def parameter_groups(model: DSAForCausalLM, weight_decay: float = 0.1) -> list[dict]:
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


@torch.no_grad()
def held_out_loss(model: DSAForCausalLM, windows: torch.Tensor) -> dict[str, float]:
    model.eval()
    losses = [batch_losses(model, w[None], sparse=True) for w in windows]
    model.train()
    return {k: float(torch.stack([getattr(x, k) for x in losses]).mean()) for k in ("lm", "mtp", "mtp2")}


def save_frequent_draft_vocab(out_dir: Path, train_stream: torch.Tensor, held_stream: torch.Tensor, vocab_size: int,
                              count: int) -> None:
    """draft_vocab.json: the draft head's tokens, the `count` most frequent of the training stream."""
    token_ids, coverage = most_frequent_tokens(train_stream, vocab_size, count)
    held_counts = torch.bincount(held_stream, minlength=vocab_size)
    held_coverage = float(held_counts[token_ids].sum() / held_counts.sum())
    save_draft_vocab(out_dir, token_ids, {"chosen_by": f"the {count} most frequent tokens of the training stream",
                                          "train_token_coverage": coverage, "held_out_token_coverage": held_coverage})


def train_tiny(out_dir: str | Path, minutes: float = 40.0, steps: int | None = None, recipe: Recipe = Recipe()) -> dict:
    torch.manual_seed(recipe.seed)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    corpus = stdlib_files()
    tokenizer = train_tokenizer(corpus.train, recipe.vocab_size)
    save_tokenizer(tokenizer, out_dir, max_length=32768)
    train_stream, held_stream = token_stream(tokenizer, corpus.train), token_stream(tokenizer, corpus.held_out)
    save_frequent_draft_vocab(out_dir, train_stream, held_stream, tokenizer.get_vocab_size(), recipe.draft_vocab_size)
    eos_id = tokenizer.token_to_id(EOS_TOKEN)
    config_json = tiny_config_json(tokenizer.get_vocab_size(), eos_id, recipe.num_hidden_layers)
    model = DSAForCausalLM(parse_model_config(config_json), mtp_layout=[(True, False)])
    init_weights(model, seed=recipe.seed)
    model.train()
    optimizer = torch.optim.AdamW(parameter_groups(model), lr=recipe.lr, betas=(0.9, 0.95))
    balancer = ExpertBalancer(model, recipe.balance_rate)
    data_rng = torch.Generator().manual_seed(recipe.seed)
    eval_windows = sample_windows(held_stream, 8, recipe.seq_len + 3, torch.Generator().manual_seed(7))
    log = {"recipe": asdict(recipe), "train_tokens_available": train_stream.numel(), "evals": []}
    total_steps = steps or CALIBRATION_STEPS + 1
    bar = tqdm(desc="train-tiny", unit="step")
    started, step, calibration_start, sparse_start = time.monotonic(), 0, None, None
    while step < total_steps:
        sparse = sparse_start is not None or (step >= recipe.dense_fraction * total_steps and step >= CALIBRATION_STEPS)
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(recipe, step, total_steps)
        windows = sample_windows(train_stream, recipe.batch_size, recipe.seq_len + 3, data_rng)
        losses = batch_losses(model, windows, sparse)
        optimizer.zero_grad(set_to_none=True)
        losses.total(recipe).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        balancer.update()
        step += 1
        if step == 1:
            calibration_start = time.monotonic()
        if sparse and sparse_start is None:
            sparse_start = (step, time.monotonic())
        recalibrate = sparse_start is not None and step == sparse_start[0] + CALIBRATION_STEPS
        if steps is None and (step == CALIBRATION_STEPS or recalibrate):  # sparse steps cost more than dense
            first_step, first_time = sparse_start if recalibrate else (1, calibration_start)
            per_step = (time.monotonic() - first_time) / (step - first_step)
            remaining = minutes * 60 - (time.monotonic() - started)
            total_steps = max(step + 1, step + int(remaining * 0.92 / (per_step * 1.03)))  # 3%: held-out evals
            bar.total = total_steps
        bar.update(1)
        bar.set_postfix(lm=f"{losses.lm.item():.3f}", mtp=f"{losses.mtp.item():.3f}", kl=f"{losses.indexer_kl.item():.3f}",
                        mode="sparse" if sparse else "dense")
        calibrating = steps is None and step <= CALIBRATION_STEPS
        if not calibrating and (step % max(1, total_steps // 8) == 0 or step == total_steps):
            evaluation = {"step": step, "minutes": (time.monotonic() - started) / 60, **held_out_loss(model, eval_windows)}
            log["evals"].append(evaluation)
            tqdm.write(f"step {step}/{total_steps} held-out " + " ".join(f"{k}={v:.3f}" for k, v in evaluation.items()))
    bar.close()
    log.update(steps=total_steps, minutes=(time.monotonic() - started) / 60,
               tokens_seen=total_steps * recipe.batch_size * recipe.seq_len)
    model.eval()
    save_checkpoint(model, config_json, out_dir, dtype=torch.bfloat16)
    return log
