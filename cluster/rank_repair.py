"""The Ray side of surviving a lost rank (cp_router/recovery.py): find the ranks that died, start their
replacements in the same bundles of the group's placement group, and re-form the process group.

A rank is lost when its ping fails (Ray reports the actor dead: its process was killed, or its node went away)
or does not answer within `ping_timeout_s` (the engine asks only between steps, so a live rank is idle). A lost
rank's actor is killed for good, a new one is started in its bundle (a dead node's bundles are re-placed by Ray
on a node with room, which the start waits for), every survivor leaves its old group and drops its request
state, and all ranks join a new group at a fresh rendezvous; the new ranks then load the checkpoint. The worker
list is updated in place, so the `CPGroup` that owns it shuts down the replacements too.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

import ray

from cluster.launch import RankLaunch

logger = logging.getLogger("dsa_serve.engine")

PING_TIMEOUT_S = 10.0


class RayRankRepair:
    """`GroupRepair` over Ray actors started as `launch` describes."""

    def __init__(self, launch: RankLaunch, ping_timeout_s: float = PING_TIMEOUT_S):
        self.launch, self.ping_timeout_s = launch, ping_timeout_s

    async def lost_ranks(self, workers: list) -> list[int]:
        answers = await asyncio.gather(*[self._answers(w) for w in workers])
        return [cp_rank for cp_rank, ok in enumerate(answers) if not ok]

    async def _answers(self, worker) -> bool:
        try:
            await asyncio.wait_for(worker.ping.remote(), self.ping_timeout_s)
            return True
        except Exception:  # noqa: BLE001 - dead, unreachable or hung: lost either way
            return False

    async def replace(self, workers: list, lost: list[int]) -> list:
        for cp_rank in lost:
            with contextlib.suppress(Exception):  # already dead: nothing to kill
                ray.kill(workers[cp_rank], no_restart=True)
            workers[cp_rank] = self.launch.create(cp_rank)
        master_addr, master_port = await self.launch.rendezvous()
        joins = [(w.init_comm if r in lost else w.rejoin).remote(master_addr, master_port)
                 for r, w in enumerate(workers)]
        await asyncio.gather(*joins)
        loaded = await asyncio.gather(*[self.launch.load(workers[r]) for r in lost])
        for report in loaded:
            logger.info("replacement cp_rank %s loaded on %s (%d weight bytes read)", report["cp_rank"],
                        report["device"], report["weight_bytes_read"])
        return workers
