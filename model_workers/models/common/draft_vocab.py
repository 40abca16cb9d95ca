"""The draft head over a reduced vocabulary (FR-Spec / EAGLE-3 style): the MTP layer proposes only frequent tokens.

The draft's LM head reads `token_ids` rows of the full head instead of all `vocab_size`; its logits come back at
full width with every other token at NOT_DRAFTED, a finite value so far below any real logit that such a token
is never the draft's argmax and has probability exactly 0 when the draft samples (softmax underflows), while
temperature, penalties and blocked ids still see a finite row (no NaN when a request bans every drafted
token: the draft then proposes one of the others, and verification, always over the full vocabulary,
rejects or accepts it as usual). Outputs are unchanged; only the draft's cost and acceptance move.
"""

from __future__ import annotations

import torch
from torch import nn

from model_workers.kernels.torch.linear import linear

NOT_DRAFTED = -1.0e30


class DraftVocab(nn.Module):
    """token_ids [N] (distinct, < vocab_size) and the matching rows of the head the draft uses [N, hidden]."""

    def __init__(self, token_ids: torch.Tensor, head_weight: torch.Tensor):
        super().__init__()
        vocab_size = head_weight.shape[0]
        check_token_ids(token_ids, vocab_size)
        self.vocab_size = vocab_size
        ids = token_ids.to(device=head_weight.device, dtype=torch.long)
        self.register_buffer("token_ids", ids, persistent=False)
        self.register_buffer("weight", head_weight.detach()[ids].clone(), persistent=False)

    def linear_weights(self) -> tuple[torch.Tensor, ...]:
        """The head rows `linear` multiplies (kernels/torch/cpu_prepack.py packs them)."""
        return (self.weight,)

    @property
    def size(self) -> int:
        return int(self.token_ids.numel())

    def forward(self, normed: torch.Tensor) -> torch.Tensor:
        """normed [..., hidden] (after the draft head's norm) -> logits [..., vocab_size] float32."""
        reduced = linear(normed, self.weight).float()  # [..., N]
        out = reduced.new_full((*reduced.shape[:-1], self.vocab_size), NOT_DRAFTED)
        return out.index_copy_(-1, self.token_ids, reduced)


def check_token_ids(token_ids: torch.Tensor, vocab_size: int) -> None:
    """ValueError unless token_ids is a non-empty 1-D set of distinct ids in [0, vocab_size)."""
    if token_ids.dim() != 1 or token_ids.numel() == 0:
        raise ValueError(f"a draft vocabulary is a non-empty list of token ids, got shape {tuple(token_ids.shape)}")
    if token_ids.dtype.is_floating_point:
        raise ValueError("draft vocabulary token ids must be integers")
    low, high = int(token_ids.min()), int(token_ids.max())
    if low < 0 or high >= vocab_size:
        raise ValueError(f"draft vocabulary ids must lie in [0, {vocab_size}), got {low}..{high}")
    if torch.unique(token_ids).numel() != token_ids.numel():
        raise ValueError("draft vocabulary token ids must be distinct")
