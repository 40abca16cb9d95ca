"""The tiny default model's recipe: its config.json, the data windows, and the training losses of one batch."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from model_workers.models.dsa.model import DSAForCausalLM
from model_workers.training.train_backend import TrainingBackend


@dataclass(frozen=True)
class Recipe:
    vocab_size: int = 6144
    seq_len: int = 512
    batch_size: int = 4
    lr: float = 2e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 40
    dense_fraction: float = 0.3  # first 30% of steps: dense attention + indexer warm-up
    mtp_weight: float = 0.3
    mtp2_weight: float = 0.15  # second recursive MTP step
    balance_rate: float = 1e-3  # aux-loss-free MoE balancing: bias step per update
    draft_vocab_size: int = 1024  # the draft head's tokens: the most frequent of the training stream
    num_hidden_layers: int = 4  # target decoder layers (one MTP layer rides on top)
    seed: int = 1234


def tiny_config_json(vocab_size: int, eos_id: int, num_hidden_layers: int = 4) -> dict:
    """A deepseek_v32 config small enough to train on 2 CPU cores, with one MTP layer.

    Its costs keep DeepSeek-V3.2's proportions where they matter for serving: many attention heads over one
    shared latent and a light indexer (4 heads x 32 dims score a query-key pair in 128 multiply-adds, 0.05 of
    the 16 heads x (64 + 32 + 64) of absorbed sparse attention; V3.2: 8192 / 139264 = 0.06).
    """
    return {
        "architectures": ["DeepseekV32ForCausalLM"],
        "model_type": "deepseek_v32",
        "vocab_size": vocab_size,
        "hidden_size": 256,
        "intermediate_size": 768,
        "moe_intermediate_size": 256,
        "num_hidden_layers": num_hidden_layers,
        "num_attention_heads": 16,
        "num_key_value_heads": 16,
        "n_routed_experts": 8,
        "n_shared_experts": 1,
        "num_experts_per_tok": 2,
        "n_group": 1,
        "topk_group": 1,
        "norm_topk_prob": True,
        "routed_scaling_factor": 1.0,
        "first_k_dense_replace": 1,
        "q_lora_rank": 128,
        "kv_lora_rank": 64,
        "qk_nope_head_dim": 32,
        "qk_rope_head_dim": 32,
        "v_head_dim": 32,
        "index_n_heads": 4,
        "index_head_dim": 32,
        "index_topk": 64,
        "num_nextn_predict_layers": 1,
        "hidden_act": "silu",
        "max_position_embeddings": 32768,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": True,
        "attention_bias": False,
        "bos_token_id": eos_id,
        "eos_token_id": eos_id,
        "dtype": "bfloat16",
    }


def most_frequent_tokens(stream: torch.Tensor, vocab_size: int, count: int) -> tuple[list[int], float]:
    """The `count` most frequent ids of a token stream, most frequent first (ties: lower id first), and the
    fraction of the stream they cover."""
    counts = torch.bincount(stream, minlength=vocab_size)
    order = torch.sort(counts, descending=True, stable=True).indices[:count]
    return order.tolist(), float(counts[order].sum() / counts.sum())


def sample_windows(stream: torch.Tensor, count: int, length: int, generator: torch.Generator) -> torch.Tensor:
    """[count, length] random windows of the token stream."""
    starts = torch.randint(0, stream.numel() - length, (count,), generator=generator)
    return torch.stack([stream[s : s + length] for s in starts.tolist()])


@dataclass
class BatchLosses:
    lm: torch.Tensor
    mtp: torch.Tensor
    mtp2: torch.Tensor
    indexer_kl: torch.Tensor

    def total(self, recipe: Recipe) -> torch.Tensor:
        return self.lm + recipe.mtp_weight * self.mtp + recipe.mtp2_weight * self.mtp2 + self.indexer_kl


def window_inputs(windows: torch.Tensor, sparse: bool) -> tuple[TrainingBackend, torch.Tensor, list[torch.Tensor]]:
    """windows [B, S + 3] -> (a training backend for B x S rows, positions [B*S], tokens: t_{i+k} [B*S] for
    k = 0..3, each window's S positions after one another)."""
    b, s = windows.shape[0], windows.shape[1] - 3
    positions = torch.arange(s).repeat(b)  # [B*S]
    return TrainingBackend(b, s, sparse), positions, [windows[:, k : k + s].reshape(-1) for k in range(4)]


def batch_losses(model: DSAForCausalLM, windows: torch.Tensor, sparse: bool) -> BatchLosses:
    """windows [B, S + 3]: next-token loss, MTP loss on t_{i+2}, recursive MTP loss on t_{i+3}, indexer KL."""
    backend, positions, tokens = window_inputs(windows, sparse)  # tokens: t_i, t_{i+1}, t_{i+2}, t_{i+3}
    hidden = model(tokens[0], positions, backend)  # [B*S, hidden]
    lm = F.cross_entropy(model.logits(hidden), tokens[1])
    mtp_hidden = model.mtp_forward(tokens[1], hidden, positions, backend)
    mtp = F.cross_entropy(model.mtp_logits(mtp_hidden), tokens[2])
    mtp2_hidden = model.mtp_forward(tokens[2], mtp_hidden, positions, backend)
    mtp2 = F.cross_entropy(model.mtp_logits(mtp2_hidden), tokens[3])
    kl = torch.stack(backend.kl_losses).sum() if backend.kl_losses else torch.zeros(())
    return BatchLosses(lm, mtp, mtp2, kl)
