"""The prefill side of a disaggregated Serve app (docs/disaggregation.md): `DSAPrefill`, one CP group per replica
whose engine prefills requests and hands them off, and `PrefillHandleClient`, through which a decode group's
`DisaggregatedEngine` (cp_router/disaggregated.py) reaches it over a deployment handle.

Which prefill replica takes a request is cluster/engine_router.py's choice, as for DSAEngine: by prompt prefix, else
the least loaded. The hand-off
comes back over the same Ray stream as the first chunk (Ray's object transport: the replica pickles it, the
decode replica reads it); the decode replica's engine writes it into its rank's pages with the request's first
decode step.
"""

from __future__ import annotations

import logging
import os
from typing import AsyncIterator

from ray import serve
from ray.serve.handle import DeploymentHandle

from cluster.replica_engine import QUIET, EngineReplica, replica_text, serve_engine_spec, start_replica_engine
from cluster.serve_settings import ServeAppArgs
from cp_router.console_log import configure_console_logging
from cp_router.handoff import HandoffTicket
from cp_router.protocol import EngineChunk, EngineRequest

PREFILL_DEPLOYMENT = "DSAPrefill"
PREFILL_MAX_ONGOING = 1024  # prefill streams in flight per replica (each a request waiting for or in its prefill)


@serve.deployment(name=PREFILL_DEPLOYMENT, logging_config=QUIET)
class DSAPrefill(EngineReplica):
    """One prefill group: a CP group and the `GenerationEngine` that prefills and hands off."""

    def __init__(self, args: ServeAppArgs):
        configure_console_logging()
        spec = serve_engine_spec(args)
        self.engine = start_replica_engine(spec, PREFILL_DEPLOYMENT, args, replica_text(spec, args))
        logging.getLogger("dsa_serve.engine").info("prefill replica ready (pid %d)", os.getpid())

    async def prefill_handoff(self, request: EngineRequest) -> AsyncIterator[EngineChunk | HandoffTicket]:
        async for item in self.engine.prefill_handoff(request):
            yield item



class PrefillHandleClient:
    """`cp_router.disaggregated.PrefillClient` over the DSAPrefill deployment's handle."""

    def __init__(self, handle: DeploymentHandle):
        self.handle = handle.options(stream=True)

    async def prefill_handoff(self, request: EngineRequest) -> AsyncIterator[EngineChunk | HandoffTicket]:
        stream = self.handle.prefill_handoff.remote(request)
        try:
            async for item in stream:
                yield item
        finally:
            stream.cancel()  # a reader that stops early (a retry, a client gone) aborts it on its replica

    async def abort(self, request_id: str) -> None:
        """Nothing to do: closing the stream cancelled the call, and its replica's engine aborted the request."""
