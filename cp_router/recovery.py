"""Surviving a lost rank: what the engine asks of whoever launched its rank workers, and what it records.

When a step fails, the engine asks its `GroupRepair` which ranks no longer answer (`lost_ranks`). None lost: the
failure was the step's own (a rank raised), the ranks re-form their group and the step's requests end with the
error, as before. Some lost: `replace` starts a new worker for each lost rank (in the same bundle of the group's
placement group), every rank joins a fresh process group and holds no request state, and the engine requeues
every request it has for a prefill over its prompt plus the tokens it already streamed (`Scheduler.restart_all`),
so each stream goes on where it stopped: no token lost, none sent twice. A request resumed `max_resumes` times
already, or every request when the group cannot be rebuilt, ends with an `EngineUnavailableError` naming why.

The engine runs in cp_router and never imports Ray: the Ray implementation is cluster/rank_repair.py.
`raise_step_failure` turns a failed step's per-rank errors into one `StepFailedError` naming the rank that failed first.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from cp_router.protocol import one_line

logger = logging.getLogger("dsa_serve.engine")

MAX_RESUMES = 3  # resumes of one request before it ends with an error (a request that keeps killing ranks)
RECOVERY_TIMEOUT_S = 600.0  # replacing ranks: an actor start plus a checkpoint load of the real models
MAX_CAUSE_CHARS = 200  # of the failure named in the recovery's log lines


@runtime_checkable
class GroupRepair(Protocol):
    async def lost_ranks(self, workers: list) -> list[int]:
        """The cp_ranks whose worker does not answer (its process died, or its node is gone)."""
        ...

    async def replace(self, workers: list, lost: list[int]) -> list:
        """The group whole again: a new loaded worker for each lost rank, every rank in a new process group and
        holding no request state; returns the workers by cp_rank."""
        ...


@dataclass(frozen=True)
class RecoveryRecord:
    """One recovery: the ranks lost, how long the group took to be whole again, and what happened to requests."""

    lost_ranks: tuple[int, ...]
    cause: str
    seconds: float
    resumed: int
    failed: int
    ok: bool

    def log_line(self) -> str:
        if not self.ok:
            return (f"recovery failed after {self.seconds:.1f}s: lost cp_rank(s) {list(self.lost_ranks)} "
                    f"({self.cause}); {self.failed} request(s) ended with an error")
        return (f"recovered from losing cp_rank(s) {list(self.lost_ranks)} in {self.seconds:.1f}s "
                f"({self.cause}): {self.resumed} request(s) resumed, {self.failed} ended with an error")


class RecoveryClock:
    """Times one recovery and builds its record (logged at once)."""

    def __init__(self, lost: list[int], cause: str):
        cause = cause if len(cause) <= MAX_CAUSE_CHARS else cause[: MAX_CAUSE_CHARS - 3] + "..."
        self.lost, self.cause, self.start = tuple(lost), cause, time.monotonic()
        logger.warning("lost cp_rank(s) %s (%s): rebuilding the rank group", list(lost), cause)

    def done(self, resumed: int, failed: int, ok: bool) -> RecoveryRecord:
        record = RecoveryRecord(self.lost, self.cause, time.monotonic() - self.start, resumed, failed, ok)
        (logger.info if ok else logger.error)("%s", record.log_line())
        return record


class StepFailedError(RuntimeError):
    """A step failed on one or more ranks (every rank of a lockstep step stops with it)."""


def raise_step_failure(ranks: list[int], results: list) -> None:
    """One clear error for a failed step: the rank that failed first (not one that only lost its peer)."""
    failures = [(r, res) for r, res in zip(ranks, results) if isinstance(res, BaseException)]
    if not failures:
        return
    causes = [f for f in failures if "left the step" not in str(f[1])] or failures
    cp_rank, error = causes[0]
    others = sorted(r for r, _ in failures if r != cp_rank)
    also = f"; ranks {others} stopped with it" if others else ""
    raise StepFailedError(f"step failed on cp_rank {cp_rank}: {one_line(error)}{also}") from None
