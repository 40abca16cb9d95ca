"""The engine's side of rank failures (cp_router/recovery.py): a failed step either ends its requests with the error
(the group re-formed first) or, when ranks were lost, replaces them and resumes every request where it stopped.
A mixin of `GenerationEngine` (cp_router/engine.py), which owns the state it reads."""

from __future__ import annotations

import asyncio
import time

from cp_router.protocol import EngineUnavailableError, one_line
from cp_router.recovery import RecoveryClock
from cp_router.request_state import WAITING


class EngineRecovery:
    async def _rejoin_group(self) -> None:
        """After a failed step: every rank leaves its (possibly broken) group and joins a fresh one."""
        if len(self.workers) < 2:
            return
        try:
            master_addr, master_port = await self.workers[0].rendezvous_address.remote()
            await asyncio.gather(*[w.rejoin.remote(master_addr, master_port) for w in self.workers])
            self._group_error = None
        except Exception as exc:  # noqa: BLE001 - a rank is gone: health checks report it from here on
            self._group_error = f"rank group could not be re-formed: {one_line(exc)}"

    def _fail_all(self, error: Exception) -> int:
        """Ends every request with `error`; returns how many there were."""
        request_ids = set(self.streams) | set(self.scheduler.requests)
        for request_id in list(self._reservations):  # disaggregation: waiting for room here
            self._fail_reservation(request_id, error)
        for request_id in request_ids:
            if (stream := self.streams.pop(request_id, None)) is not None:
                stream.fail(error)
            self.scheduler.finish(request_id)
        return len(request_ids)

    # recovery (cp_router/recovery.py) ---------------------------------------------------------------
    def _lock(self) -> asyncio.Lock:
        if self._group_lock is None:
            self._group_lock = asyncio.Lock()
        return self._group_lock

    async def _after_failure(self, error: Exception) -> None:
        """A step failed: replace lost ranks and resume every request; else the step's own error ends them."""
        async with self._lock():
            if lost := await self._lost_ranks():
                await self._recover(lost, one_line(error))
                return
            await self._rejoin_group()  # the group is whole again before the requests hear of the failure
            self._fail_all(RuntimeError(f"engine step failed: {error!r}"))

    async def _recover_if_lost(self, cause: str) -> None:
        """The health check found a rank that does not answer: recover now if it is still lost."""
        async with self._lock():
            if lost := await self._lost_ranks():
                await self._recover(lost, cause)

    async def _lost_ranks(self) -> list[int]:
        return [] if self.repair is None else await self.repair.lost_ranks(self.workers)

    async def _recover(self, lost: list[int], cause: str) -> None:
        """New workers for the `lost` ranks, then every request requeued (prompt + tokens sent so far)."""
        clock, self._recovering = RecoveryClock(lost, cause), True
        try:
            self.workers = await asyncio.wait_for(self.repair.replace(self.workers, lost), self.recovery_timeout_s)
        except Exception as exc:  # noqa: BLE001 - no group: every request ends, health checks report it
            self._group_error = f"rank group could not be rebuilt after losing cp_rank(s) {lost}: {one_line(exc)}"
            self.recoveries.append(clock.done(0, self._fail_all(EngineUnavailableError(self._group_error)), False))
            return
        finally:
            self._recovering, self._last_progress = False, time.monotonic()
        self._group_error = None
        resumed, failed = self._resume_all(f"lost cp_rank(s) {lost}: {cause}")
        self.recoveries.append(clock.done(resumed, failed, True))
        self._poke()

    def _resume_all(self, cause: str) -> tuple[int, int]:
        """Every request back in the queue over its prompt + output so far; one resumed too often ends."""
        failed = 0
        admitted = [rid for rid, seq in self.scheduler.requests.items() if seq.status != WAITING or seq.output_ids]
        self.scheduler.restart_all()
        for request_id in admitted:
            seq = self.scheduler.requests[request_id]
            seq.num_resumes += 1
            if seq.num_resumes > self.max_resumes:
                error = EngineUnavailableError(
                    f"request {request_id} lost its ranks {seq.num_resumes} times (last: {cause}); not resumed")
                if (stream := self.streams.pop(request_id, None)) is not None:
                    stream.fail(error)
                self._fail_reservation(request_id, error)
                self.scheduler.finish(request_id)
                failed += 1
        return len(admitted) - failed, failed
