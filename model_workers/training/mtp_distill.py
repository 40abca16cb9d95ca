"""Self-distillation of the MTP layer: the target model frozen, the MTP layer taught the target's own predictions.

Speculation keeps a draft token when the target would have produced it, so the draft layer should imitate the
target rather than the corpus. This phase trains only the MTP layer's own weights (`model.layers.{L}.*`: its
norms, eh_proj, decoder layer and gate bias; the embedding and LM head it shares stay as they are), so the
target's outputs keep every bit. Its text is what the target wrote itself: windows that start with
`prompt_len` training-stream tokens and go on with the target's continuation, greedy for even windows and
sampled at temperature 1 for odd ones (the serving sampler, seeded per window). The losses, on every position of
a window: KL(target's next-token distribution at i+1 || MTP's at i) for the first draft, and the same one step
further for the recursive second draft (the MTP layer fed its own output, as the draft chain runs it).
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn
from tqdm import tqdm

from cp_router.pages import pages_for
from cp_router.sampling import SamplingParams
from model_workers.models.dsa.model import DSAForCausalLM
from model_workers.runner import ExtendItem, ModelRunner
from model_workers.sampler import sample
from model_workers.training.recipe import sample_windows, window_inputs
from model_workers.training.trainer import ExpertBalancer, learning_rate


WRITE_PAGE_SIZE = 64  # the KV pages of the target while it writes the windows


@dataclass(frozen=True)
class DistillRecipe:
    steps: int = 500
    lr: float = 3e-4  # 1e-3 gave higher held-out acceptance (0.739 against 0.713) but less in speculation (E 2.569 / 2.622)
    min_lr_ratio: float = 0.1
    warmup_steps: int = 20
    batch_size: int = 4  # windows per step
    seq_len: int = 512  # scored positions per window (a window holds seq_len + 3 tokens)
    prompt_len: int = 64  # training-stream tokens that start each window; the target writes the rest
    num_windows: int = 1024  # windows written before training, drawn from at random
    write_batch: int = 64  # windows written together
    sampled_every: int = 2  # every sampled_every-th window is sampled at temperature 1, the others greedy (0: none)
    recursive_weight: float = 0.5  # the second (recursive) draft's loss
    balance_rate: float = 1e-3  # aux-loss-free balancing of the MTP layer's gate
    seed: int = 4321


def mtp_layer(model: DSAForCausalLM) -> nn.Module:
    """The (first) MTP layer; a checkpoint without one cannot be distilled."""
    if model.num_mtp_layers < 1:
        raise ValueError("the checkpoint has no MTP layer (num_nextn_predict_layers = 0): nothing to distil")
    return model.model.layers[model.config.num_hidden_layers]


@torch.no_grad()
def write_windows(model: DSAForCausalLM, prompts: torch.Tensor, new_tokens: int, write_batch: int,
                  seed: int, sampled_every: int = 2) -> torch.Tensor:
    """prompts [N, P] -> [N, P + new_tokens]: each prompt and the target's continuation (window n sampled at
    temperature 1 with seed + n when sampled_every divides n + 1, else greedy)."""
    params = [SamplingParams(temperature=float(sampled_every > 0 and (n + 1) % sampled_every == 0), seed=seed + n,
                             max_tokens=new_tokens) for n in range(len(prompts))]
    total = prompts.shape[1] + new_tokens
    pages = min(write_batch, len(prompts)) * pages_for(total, WRITE_PAGE_SIZE)
    runner = ModelRunner(model, num_pages=pages, page_size=WRITE_PAGE_SIZE)
    written = []
    for start in tqdm(range(0, len(prompts), write_batch), desc="distill-mtp: writing", unit="batch"):
        batch = prompts[start : start + write_batch]  # [b, P]
        tables = runner.standalone_tables([total] * len(batch))
        hidden = runner.extend([ExtendItem(t, p.tolist()) for t, p in zip(tables, batch)])  # [b*P, D]
        last = hidden.view(len(batch), prompts.shape[1], -1)[:, -1]  # [b, D]
        tokens = []
        for index in range(new_tokens):
            logits = model.logits(last).float()  # [b, V]
            step = [sample(logits[b], params[start + b], (), index) for b in range(len(batch))]
            tokens.append(step)
            if index + 1 < new_tokens:
                last = runner.extend([ExtendItem(t, [tok]) for t, tok in zip(tables, step)], is_extend=False)
        written.append(torch.cat([batch, torch.tensor(tokens, dtype=batch.dtype).T], dim=1))
    return torch.cat(written)


def distill_losses(model: DSAForCausalLM, windows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """windows [B, S + 3] -> (first-draft KL, recursive-draft KL, the MTP indexer's KL), means over positions."""
    b, s = windows.shape[0], windows.shape[1] - 3
    backend, positions, tokens = window_inputs(windows, sparse=True)  # tokens: t_i, t_{i+1}, t_{i+2} (, t_{i+3})
    with torch.no_grad():
        hidden = model(tokens[0], positions, backend)  # [B*S, D]
        target = F.log_softmax(model.logits(hidden).float().view(b, s, -1), dim=-1)  # row i: t_{i+1}
    frozen_kl = len(backend.kl_losses)
    draft_hidden = model.mtp_forward(tokens[1], hidden, positions, backend)  # row i: t_{i+2}
    first = kl_to_target(model.mtp_logits(draft_hidden).view(b, s, -1)[:, :-1], target[:, 1:])
    chained = model.mtp_forward(tokens[2], draft_hidden, positions, backend)  # row i: t_{i+3}
    second = kl_to_target(model.mtp_logits(chained).view(b, s, -1)[:, :-2], target[:, 2:])
    indexer = sum(backend.kl_losses[frozen_kl:], torch.zeros(()))
    return first, second, indexer


def kl_to_target(draft_logits: torch.Tensor, target_log_probs: torch.Tensor) -> torch.Tensor:
    """KL(target || draft) per position [B, n, V] -> mean over positions."""
    draft_log_probs = F.log_softmax(draft_logits.float(), dim=-1)
    return F.kl_div(draft_log_probs, target_log_probs, log_target=True, reduction="none").sum(-1).mean()


def train_mtp_layer(model: DSAForCausalLM, trained: list[nn.Parameter], windows: torch.Tensor,
                    balancer: ExpertBalancer, recipe: DistillRecipe, generator: torch.Generator) -> list[tuple]:
    """recipe.steps optimizer steps on random batches of `windows`; returns each step's (first, second) KL."""
    optimizer = torch.optim.AdamW(trained, lr=recipe.lr, betas=(0.9, 0.95), weight_decay=0.0)
    losses = []
    for step in tqdm(range(recipe.steps), desc="distill-mtp: training", unit="step"):
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(recipe, step, recipe.steps)
        batch = windows[torch.randint(0, len(windows), (recipe.batch_size,), generator=generator)]  # [B, S + 3]
        first, second, indexer = distill_losses(model, batch)
        optimizer.zero_grad(set_to_none=True)
        (first + recipe.recursive_weight * second + indexer).backward()
        torch.nn.utils.clip_grad_norm_(trained, 1.0)
        optimizer.step()
        balancer.update()
        losses.append((float(first.detach()), float(second.detach())))
    return losses


def distill_mtp(model: DSAForCausalLM, train_stream: torch.Tensor, recipe: DistillRecipe = DistillRecipe()) -> dict:
    """Trains the MTP layer of a float32 `model` in place on windows the target writes; returns the log."""
    started = time.monotonic()
    torch.manual_seed(recipe.seed)
    layer = mtp_layer(model)
    generator = torch.Generator().manual_seed(recipe.seed)
    model.eval()
    prompts = sample_windows(train_stream, recipe.num_windows, recipe.prompt_len, generator)
    windows = write_windows(model, prompts, recipe.seq_len + 3 - recipe.prompt_len, recipe.write_batch, recipe.seed,
                            recipe.sampled_every)
    written_minutes = (time.monotonic() - started) / 60
    trainable = {parameter: parameter.requires_grad for parameter in model.parameters()}
    trained = list(layer.parameters())  # in module order: the gradient-norm clip sums them in this order
    for parameter in trainable:
        parameter.requires_grad_(False)
    for parameter in trained:
        parameter.requires_grad_(True)
    balancer = ExpertBalancer(layer, recipe.balance_rate)
    try:
        model.train()
        losses = train_mtp_layer(model, trained, windows, balancer, recipe, generator)
    finally:
        model.eval()
        balancer.remove()
        for parameter, flag in trainable.items():
            parameter.requires_grad_(flag)
    tail = losses[-max(1, len(losses) // 10) :]
    return {"recipe": asdict(recipe), "windows_written": len(windows), "writing_minutes": written_minutes,
            "minutes": (time.monotonic() - started) / 60, "trained_parameters": sum(p.numel() for p in trained),
            "final_kl": [sum(x[0] for x in tail) / len(tail), sum(x[1] for x in tail) / len(tail)]}
