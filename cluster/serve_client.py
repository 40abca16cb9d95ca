"""`EngineClient` over the `DSAEngine` deployment handle: what the ingress replica talks to.

* `generate` opens a streaming call (`handle.options(stream=True)`); Serve routes it to one engine replica
  and the client keeps that call's response object under the request id.
* `abort(request_id)` cancels that response: Serve delivers the cancellation to the replica that owns the
  request, whose engine stream then aborts the request and frees its KV pages. So aborts need no routing of
  their own and cannot reach the wrong CP group.
* `metrics_text` and `check_health` are broadcast to every engine replica (each labels its metrics with its
  own replica id); the texts are merged with `merge_metrics_text`.
"""

from __future__ import annotations

from typing import AsyncIterator

from ray.serve.exceptions import RequestCancelledError
from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator

from cp_router.metrics import merge_metrics_text
from cp_router.protocol import EngineChunk, EngineOverloadedError, EngineRequest, ModelInfo, one_line

BROADCAST_TIMEOUT_S = 30.0


class ServeEngineClient:
    def __init__(self, handle: DeploymentHandle, info: ModelInfo):
        self.handle, self.info = handle, info
        self.streams: dict[str, DeploymentResponseGenerator] = {}

    @classmethod
    async def connect(cls, handle: DeploymentHandle) -> ServeEngineClient:
        return cls(handle, await handle.model_info.remote())

    async def generate(self, request: EngineRequest) -> AsyncIterator[EngineChunk]:
        response = self.handle.options(stream=True).generate.remote(request)
        self.streams[request.request_id] = response
        last: EngineChunk | None = None
        try:
            async for last in response:
                yield last
        except RequestCancelledError:  # aborted: the stream ends like the engine's own abort does
            yield EngineChunk((), "", "abort", len(request.prompt_token_ids), last.completion_tokens if last else 0)
        except EngineOverloadedError as exc:  # re-raised without Ray's remote traceback in its message
            cause = getattr(exc, "cause", exc)
            raise EngineOverloadedError(str(cause), cause.retry_after_s) from None
        finally:
            if self.streams.pop(request.request_id, None) is not None and (last is None or not last.finish_reason):
                response.cancel()  # the consumer stopped early: free the request on its replica

    async def abort(self, request_id: str) -> None:
        response = self.streams.pop(request_id, None)
        if response is not None:
            response.cancel()

    def model_info(self) -> ModelInfo:
        return self.info

    async def metrics_text(self) -> str:
        texts = await self.handle.broadcast("metrics_text").results_async(timeout_s=BROADCAST_TIMEOUT_S)
        return merge_metrics_text(texts)

    async def check_health(self) -> None:
        """Raises one line per failing replica (the replica's own error, without Ray's remote traceback)."""
        try:
            results = await self.handle.broadcast("check_health").results_async(timeout_s=BROADCAST_TIMEOUT_S,
                                                                                 return_exceptions=True)
        except Exception as exc:  # noqa: BLE001 - no replica could be asked (none running, or the call failed)
            raise RuntimeError(f"engine replicas unreachable: {one_line(exc)}") from None
        failures = [one_line(result) for result in results if isinstance(result, BaseException)]
        if not results or failures:
            raise RuntimeError("; ".join(failures) or "no engine replica is running")
