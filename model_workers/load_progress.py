"""Weight-loading progress of one rank (logger `dsa_serve.worker`, INFO), so that every rank's load shows on the
server's console: a line when it starts (the checkpoint's size), one every `interval_s` while it reads (bytes
read so far), one when it ends (bytes read, seconds, GiB/s). Under expert parallelism a rank reads only its own
experts, less than the whole checkpoint.

    cp_rank 1: loading weights from /models/dsa (40.12 GiB of checkpoint files)
    cp_rank 1: 12.30 / 40.12 GiB of weights read (31%), 30.0 s
    cp_rank 1: weights loaded: 40.11 GiB read of a 40.12 GiB checkpoint in 95.2 s (0.42 GiB/s)
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Callable

LOAD_PROGRESS_INTERVAL_S = 30.0
GIB = 1024**3
logger = logging.getLogger("dsa_serve.worker")


def checkpoint_bytes(model_dir: str | Path) -> int:
    """Bytes of the checkpoint's safetensors files."""
    return sum(file.stat().st_size for file in Path(model_dir).glob("*.safetensors"))


class LoadProgress:
    """`read(nbytes)` after each tensor read; `done(total_read)` at the end. Logs as the module docstring shows."""

    def __init__(self, cp_rank: int, model_dir: str | Path, interval_s: float = LOAD_PROGRESS_INTERVAL_S,
                 clock: Callable[[], float] = time.monotonic, log: logging.Logger = logger):
        self.cp_rank, self.interval_s, self.clock, self.log = cp_rank, interval_s, clock, log
        self.total, self.bytes_read = checkpoint_bytes(model_dir), 0
        self.started = self.last_line = clock()
        self.log.info("cp_rank %d: loading weights from %s (%.2f GiB of checkpoint files)", cp_rank, model_dir,
                      self.total / GIB)

    def read(self, nbytes: int) -> None:
        self.bytes_read += nbytes
        now = self.clock()
        if now - self.last_line >= self.interval_s:
            self.last_line = now
            share = f" ({100 * self.bytes_read / self.total:.0f}%)" if self.total else ""
            self.log.info("cp_rank %d: %.2f / %.2f GiB of weights read%s, %.1f s", self.cp_rank,
                          self.bytes_read / GIB, self.total / GIB, share, now - self.started)

    def done(self, total_read: int) -> None:
        seconds = max(self.clock() - self.started, 1e-9)
        self.log.info("cp_rank %d: weights loaded: %.2f GiB read of a %.2f GiB checkpoint in %.1f s (%.2f GiB/s)",
                      self.cp_rank, total_read / GIB, self.total / GIB, seconds, total_read / GIB / seconds)
