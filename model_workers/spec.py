"""The frozen records the edge resolves once and passes down (docs/architecture.md, 'The engine spec').

`ModelSpec` is a checkpoint folder read once: its parsed config (its family's record), config.json as read. `RankSpec`
is what every rank of a group loads and runs with. cluster/engine_spec.py builds both from the CLI flags or the
Serve YAML; nothing below that edge reads config.json again or re-derives these settings, and a rank process
receives them (pickled) instead of reading anything but the weights.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from model_workers.kernels.registry import DEFAULT_ATTENTION_BACKEND
from model_workers.models.family import ModelFamily
from model_workers.models.registry import family_of


@dataclass(frozen=True, eq=False)
class ModelSpec:
    path: Path  # the checkpoint folder
    config: Any  # its family's frozen config (generation_config.json's EOS ids merged)
    raw: dict  # config.json as read (the capacity plan and the CP rules read a few raw fields)

    @property
    def family(self) -> ModelFamily:
        return family_of(self.config)

    @property
    def name(self) -> str:
        """The folder's name: the served model's default name."""
        return self.path.name

    @property
    def checkpoint_dtype(self) -> str:
        return stored_dtype(self.raw)


@dataclass(frozen=True, eq=False)
class RankSpec:
    """What each rank of a group loads: the model, its storage dtype (never `auto`), the cache and the kernels."""

    model: ModelSpec
    dtype: str  # float32 | bfloat16: weights and (kv_cache_dtype auto) keys as stored
    num_pages: int  # KV pages per rank
    page_size: int
    ep_size: int = 1  # 1, or the group size: each rank holds its block of every MoE layer's routed experts
    kv_cache_dtype: str = "auto"  # model_workers/kv_format.py
    deterministic: bool = False  # --enable-deterministic-inference: batch-invariant steps
    speculative_token_map: str = "auto"  # the draft head's vocabulary (checkpoint/draft_vocab.py)
    attention_backend: str = DEFAULT_ATTENTION_BACKEND  # the kernel set (model_workers/kernels/registry.py)
    # (largest batch, longest request) of plain decode steps captured in CUDA graphs on a CUDA rank where the
    # forward allows it (model_workers/decode_graphs.py); None: --disable-cuda-graph
    graph_shape: tuple[int, int] | None = None


def stored_dtype(raw: dict) -> str:
    """config.json's `torch_dtype` (or `dtype`): what `--dtype auto` resolves from; float32 when it names none."""
    return raw.get("torch_dtype") or raw.get("dtype") or "float32"
