"""The one module that imports torch.distributed: the CP process group, and its single-process stand-in.

A comm gathers equal-sized row blocks from every CP rank (`all_gather_rows`) and keeps counters of what
the collectives cost: bytes received from other ranks and seconds spent, per tag ("kv" for the per-layer
latent / indexer-key gathers, "hidden" for the gathers before logits and MTP).
"""

from __future__ import annotations

import socket
import time
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist


def free_port() -> int:
    """A TCP port free on this host right now (rank 0 picks the rendezvous port with it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("", 0))
        return int(sock.getsockname()[1])


@dataclass
class CommStats:
    seconds: float = 0.0
    calls: int = 0
    bytes_by_tag: dict[str, int] = field(default_factory=dict)

    @property
    def total_bytes(self) -> int:
        return sum(self.bytes_by_tag.values())


class LocalComm:
    """cp_size = 1: the gather of one block is the block itself; nothing moves, nothing is counted."""

    cp_rank = 0
    cp_size = 1

    def __init__(self):
        self.stats = CommStats()

    def all_gather_rows(self, x_padded: torch.Tensor, tag: str = "other") -> torch.Tensor:
        """[P, ...] (P equal on every rank) -> [cp_size * P, ...] rank-major."""
        return x_padded

    def reset_stats(self) -> CommStats:
        """Returns the counters gathered so far and starts new ones."""
        stats, self.stats = self.stats, CommStats()
        return stats

    def destroy(self) -> None:
        pass


class ProcessGroupComm(LocalComm):
    """The CP group: gloo on CPU, NCCL on CUDA, rendezvous over TCP at rank 0's address."""

    def __init__(
        self, master_addr: str, master_port: int, cp_rank: int, cp_size: int, device: torch.device, timeout_s: int = 300
    ):
        super().__init__()
        self.cp_rank, self.cp_size, self.device = cp_rank, cp_size, torch.device(device)
        backend = "nccl" if self.device.type == "cuda" else "gloo"
        dist.init_process_group(
            backend,
            init_method=f"tcp://{master_addr}:{master_port}",
            rank=cp_rank,
            world_size=cp_size,
            timeout=timedelta(seconds=timeout_s),
        )

    def all_gather_rows(self, x_padded: torch.Tensor, tag: str = "other") -> torch.Tensor:
        x_padded = x_padded.contiguous()
        gathered = x_padded.new_empty((self.cp_size * x_padded.shape[0], *x_padded.shape[1:]))  # [C*P, ...]
        start = time.perf_counter()
        dist.all_gather_single(gathered, x_padded)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.stats.seconds += time.perf_counter() - start
        self.stats.calls += 1
        received = (self.cp_size - 1) * x_padded.numel() * x_padded.element_size()
        self.stats.bytes_by_tag[tag] = self.stats.bytes_by_tag.get(tag, 0) + received
        return gathered

    def destroy(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
