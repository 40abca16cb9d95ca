"""The one module that imports torch.distributed: the CP process group, and its single-process stand-in.

A comm gathers equal-sized row blocks from every CP rank (`all_gather_rows`), sums row blocks back to their
rank (`reduce_scatter_rows`, which `bench ep-exchange` measures against the all-to-all), exchanges uneven row
blocks (`all_to_all_rows`) and small integer lists (`all_gather_ints`), and keeps counters of what the
collectives cost: bytes received from other ranks and seconds spent, per tag ("kv" for the per-layer latent /
indexer-key gathers, "hidden" for the gathers before logits and MTP, "experts" for the expert-parallel
exchanges, "rows" for the lockstep row counts, "ids" for the token ids prompt logprobs are scored against).
"""

from __future__ import annotations

import contextlib
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


# A collective waits this long for its peers before failing: far above the compute between two collectives of
# a step (one layer), and the bound on how long a peer of a rank that died mid-forward can wait.
COLLECTIVE_TIMEOUT_S = 120


class CollectiveError(RuntimeError):
    """A collective failed: a peer left the group (it raised and broke the group, or its process died)."""


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

    def reduce_scatter_rows(self, x: torch.Tensor, tag: str = "other") -> torch.Tensor:
        """[cp_size * P, ...] rank-major -> [P, ...]: this rank's block summed over every rank."""
        return x

    def all_to_all_rows(self, x: torch.Tensor, send_rows: list[int], recv_rows: list[int],
                        tag: str = "other") -> torch.Tensor:
        """Rows [sum(send_rows), ...], block j to rank j -> [sum(recv_rows), ...], block j from rank j."""
        return x

    def all_gather_ints(self, values: list[int], tag: str = "rows") -> list[list[int]]:
        """Every rank's list of len(values) integers, by rank."""
        return [list(values)]

    def abort(self) -> None:
        """Breaks the group at once so peers blocked in a collective fail instead of waiting (a rank raised)."""

    def reset_stats(self) -> CommStats:
        """Returns the counters gathered so far and starts new ones."""
        stats, self.stats = self.stats, CommStats()
        return stats

    def destroy(self) -> None:
        pass


class ProcessGroupComm(LocalComm):
    """The CP group: gloo on CPU, NCCL on CUDA, rendezvous over TCP at rank 0's address.

    Every collective runs on both backends with the same calls and byte accounting: all_gather_single (CP gathers of
    KV rows, hidden states, token ids, row counts: uint8 FP8 bytes, bf16 / fp32 rows, int64 ids), all_to_all_single
    with uneven splits (the expert exchange) and reduce_scatter_tensor. On CUDA the rank's device is set before the
    group forms and bound to it (NCCL's communicators are per device), and a collective's seconds include the wait
    for its device work (a synchronize: the counters measure transfer time, not launch time)."""

    def __init__(
        self, master_addr: str, master_port: int, cp_rank: int, cp_size: int, device: torch.device,
        timeout_s: int = COLLECTIVE_TIMEOUT_S,
    ):
        super().__init__()
        self.cp_rank, self.cp_size, self.device = cp_rank, cp_size, torch.device(device)
        on_cuda = self.device.type == "cuda"
        if on_cuda:
            torch.cuda.set_device(self.device)  # the one GPU Ray made visible to this rank's actor
        dist.init_process_group(
            "nccl" if on_cuda else "gloo",
            init_method=f"tcp://{master_addr}:{master_port}",
            rank=cp_rank,
            world_size=cp_size,
            timeout=timedelta(seconds=timeout_s),
            device_id=torch.device("cuda", torch.cuda.current_device()) if on_cuda else None,
        )

    def all_gather_rows(self, x_padded: torch.Tensor, tag: str = "other") -> torch.Tensor:
        x_padded = x_padded.contiguous()
        gathered = x_padded.new_empty((self.cp_size * x_padded.shape[0], *x_padded.shape[1:]))  # [C*P, ...]
        with self._counted(tag, gathered, x_padded):
            dist.all_gather_single(gathered, x_padded)
        return gathered

    def reduce_scatter_rows(self, x: torch.Tensor, tag: str = "other") -> torch.Tensor:
        x = x.contiguous()
        mine = x.new_empty((x.shape[0] // self.cp_size, *x.shape[1:]))  # [P, ...]
        with self._counted(tag, x, mine):
            dist.reduce_scatter_tensor(mine, x)
        return mine

    def all_to_all_rows(self, x: torch.Tensor, send_rows: list[int], recv_rows: list[int],
                        tag: str = "other") -> torch.Tensor:
        x = x.contiguous()
        received = x.new_empty((sum(recv_rows), *x.shape[1:]))  # [sum(recv_rows), ...]
        own = recv_rows[self.cp_rank] * (received[0].numel() if received.shape[0] else 0)
        with self._counted(tag, received, own_elements=own):
            dist.all_to_all_single(received, x, list(recv_rows), list(send_rows))
        return received

    def all_gather_ints(self, values: list[int], tag: str = "rows") -> list[list[int]]:
        local = torch.tensor(values, dtype=torch.long, device=self.device)  # [n]
        return self.all_gather_rows(local, tag).view(self.cp_size, -1).tolist()

    def abort(self) -> None:
        """Aborts the group's connections (peers blocked in a collective fail at once), then forgets it."""
        if not dist.is_initialized():
            return
        try:
            dist.group.WORLD.abort()  # NCCL: aborts its communicators, so a peer blocked in one fails at once
        except (RuntimeError, AttributeError):  # a backend without abort: destroying the group closes them too
            pass
        dist.destroy_process_group()

    @contextlib.contextmanager
    def _counted(self, tag: str, received: torch.Tensor, own: torch.Tensor | None = None, own_elements: int = 0):
        """Times one collective and counts the bytes of `received` that came from other ranks."""
        start = time.perf_counter()
        try:
            yield
        except Exception as exc:
            first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise CollectiveError(f"{tag} collective failed: {first_line[:300]}") from exc
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.stats.seconds += time.perf_counter() - start
        self.stats.calls += 1
        own_elements = own.numel() if own is not None else own_elements
        moved = (received.numel() - own_elements) * received.element_size()
        self.stats.bytes_by_tag[tag] = self.stats.bytes_by_tag.get(tag, 0) + moved

    def destroy(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
