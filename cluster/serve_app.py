"""The Ray Serve application `cluster.serve_app:app`, in one of two placements (`engine_placement`):

* separate: `DSAIngress` (HTTP) replicas in front of `DSAEngine` replicas (a CP group and the
  `GenerationEngine` driving it) over a deployment handle; ingress and engines scale independently; every
  token chunk crosses one more Ray stream.
* colocated: one `DSAServer` deployment whose replica is the HTTP app and the engine at once (a CP group
  per replica); one Ray stream less per token chunk, but HTTP handling and the engine loop share one process.

Placement: an engine replica (DSAEngine or DSAServer) runs in a placement group of 1 + C bundles
(`engine_bundles`): bundle 0 holds the replica itself (the engine's asyncio step loop and scheduler), bundles
1..C the CPWorker rank actors the replica starts there (`cluster.launch.start_workers`). The strategy is
`placement_strategy` (STRICT_PACK by default). More replicas = more CP groups: Serve's `num_replicas` /
`autoscaling_config` of the deployment apply as they are. The rank actors are owned by the replica and die
with it. Health: Serve calls the replica's `check_health` every `health_check_period_s`; it raises when a
rank actor is dead (its ping fails) or the step loop stopped or made no progress while it had work, and
Serve replaces the replica. Aborts and metrics (separate placement): see cluster/serve_client.py; which engine
replica takes a call: cluster/engine_router.py.

Direct ingress (`direct_ingress_port`; `dsa-serve serve`'s default with one HTTP replica): each HTTP replica also
serves its app on that port itself, from its own event loop (cluster/direct_ingress.py), and drains those requests
itself when Serve stops it (`DrainableHTTP.__del__`), since Serve counts only the ones its proxy forwarded.

Drain: a replica Serve stops (a redeploy's rolling update, a scale-down, serve.shutdown) gets no new requests
and keeps running its ongoing ones, HTTP streams and engine streams alike, for `graceful_shutdown_timeout_s`
= `drain_timeout_s` (Serve polls every graceful_shutdown_wait_loop_s, then calls __del__ or kills it). On SIGTERM
`dsa-serve serve` first broadcasts `drain` to the HTTP replicas (503 + Retry-After for new requests, /health 503)
and waits for their streams, since serve.shutdown() stops the proxies too.
"""

from __future__ import annotations

import logging
import os
import warnings
from pathlib import Path
from typing import Any, AsyncIterator

import ray
from pydantic import ValidationError
from ray import serve
from ray.serve import Application
from ray.serve.config import RequestRouterConfig
from ray.serve.exceptions import RayServeException
from ray.serve.handle import DeploymentHandle

from cluster.direct_ingress import DirectIngressServer
from cluster.engine_channel import ChannelHost
from cluster.engine_router import EngineRouter
from cluster.http_api.ingress import build_app
from cluster.http_api.utility_routes import RequestIdMiddleware
from cluster.pd_app import PREFILL_MAX_ONGOING, DSAPrefill, PrefillHandleClient
from cluster.replica_engine import (
    QUIET, EngineReplica, engine_bundles, replica_text, serve_engine_spec, start_replica_engine,
)
from cluster.serve_client import ServeEngineClient
from cluster.serve_settings import IngressSettings, ServeAppArgs
from cp_router.console_log import configure_console_logging
from cp_router.disaggregated import DisaggregatedEngine
from cp_router.protocol import EngineRequest, ModelInfo
from model_workers.checkpoint.model_dir import resolve_model_dir

APP_NAME = "dsa-serve"
ENGINE_DEPLOYMENT, INGRESS_DEPLOYMENT, SERVER_DEPLOYMENT = "DSAEngine", "DSAIngress", "DSAServer"


# HTTP replicas run their app (colocated: and the step loop) on their main event loop, not a thread of Serve's
# own, and the ingress's engine handle routes on that loop too. 2-core bench VM, HTTP / in-process: colocated 32
# streams 0.79x -> 0.89x; the ingress's router there: TTFT at one stream 1.22x against 1.34x (mean of A/B runs,
# docs/bench_notes/serving_ingress.md). The engine replica keeps Serve's thread. A config's own ray_actor_options
# replace these.
HTTP_REPLICA_ACTOR_OPTIONS = {"runtime_env": {"env_vars": {"RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0",
                                                             "RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP": "0"}}}


ENGINE_MAX_ONGOING = 4096  # engine streams in flight per replica: each HTTP request holds one per choice


@serve.deployment(name=ENGINE_DEPLOYMENT, logging_config=QUIET)
class DSAEngine(EngineReplica):
    """One CP group and the `GenerationEngine` driving it; disaggregated (`prefill` given), a decode group whose
    requests are prefilled by DSAPrefill replicas (cp_router/disaggregated.py)."""

    def __init__(self, args: ServeAppArgs, prefill: DeploymentHandle | None = None):
        configure_console_logging()  # the engine's lines (recoveries, progress) reach the server's output
        spec = serve_engine_spec(args)  # config.json read once in this process
        self.engine = start_replica_engine(spec, ENGINE_DEPLOYMENT, args, replica_text(spec, args))
        if prefill is not None:
            self.engine = DisaggregatedEngine(self.engine, PrefillHandleClient(prefill), args.pd_min_prefill_tokens)
        self.channels = ChannelHost(serve.get_replica_context().replica_id.unique_id)
        logging.getLogger("dsa_serve.engine").info("engine replica %s ready (pid %d)", self.channels.replica_id,
                                                   os.getpid())

    async def generate(self, request: EngineRequest, ingress_id: str | None = None) -> AsyncIterator[object]:
        """`ChannelRoute`, then the request's chunks here or on `ingress_id`'s channel (cluster/engine_channel.py)."""
        async for item in self.channels.generate(self.engine.generate(request), request.request_id, ingress_id):
            yield item

    async def channel(self, ingress_id: str, target_replica: str) -> AsyncIterator[object]:
        async for item in self.channels.channel(ingress_id, target_replica):
            yield item

    def model_info(self) -> ModelInfo:
        return self.engine.model_info()


INHERITED_CHAT_SETTINGS = ("chat_template", "reasoning_parser", "served_model_name", "tool_call_parser",
                           "enable_auto_tool_choice")


def ingress_settings(args: ServeAppArgs, model_dir: Path) -> IngressSettings:
    """The ingress's settings: the tokenizer and chat template come from the served checkpoint (and the args'
    chat_template file) unless the ingress names its own."""
    settings = args.ingress.model_copy(update={"request_id_header": False})  # Serve's proxy sets X-Request-Id
    if settings.model_dir is None:
        settings = settings.model_copy(update={"model_dir": str(model_dir)})
    inherited = {name: getattr(args, name) for name in INHERITED_CHAT_SETTINGS
                 if getattr(settings, name) in (None, False) and getattr(args, name) not in (None, False)}
    return settings.model_copy(update=inherited) if inherited else settings


def replica_app_owner() -> str:
    """The Serve app and Ray cluster of this replica (its replicas may share a direct ingress port); outside Serve,
    this process."""
    try:
        app_name = serve.get_replica_context().app_name
    except RayServeException:
        return f"process {os.getpid()}"
    return f"Serve app {app_name!r} of the Ray cluster at {ray.get_runtime_context().gcs_address}"


# The coroutine Python's collector makes of DrainableHTTP.__del__ and drops (see there) is no mistake to report.
warnings.filterwarnings("ignore", "coroutine 'DrainableHTTP.__del__' was never awaited", RuntimeWarning)


class DrainableHTTP:
    """What the HTTP replicas (DSAIngress, DSAServer) share: their app, its direct ingress server when configured,
    and the drain that `dsa-serve serve` broadcasts on SIGTERM."""

    http_app: Any  # the FastAPI app of build_app, set by __serve_build_asgi_app__
    args: ServeAppArgs
    direct: DirectIngressServer | None = None

    async def serve_app(self, app: Any) -> Any:
        """Keeps `app` (Serve's proxy reaches it) and, with args.direct_ingress_port, serves it on that port too,
        from this event loop (Serve runs __serve_build_asgi_app__ on the loop the app's requests run on)."""
        self.http_app, args = app, self.args
        if args.direct_ingress_port is not None:
            # Serve's proxy sets X-Request-Id on what it forwards; on the direct path the app's middleware does.
            direct_app = RequestIdMiddleware(app, add_header=True)
            self.direct = DirectIngressServer(direct_app, args.direct_ingress_host, args.direct_ingress_port,
                                              replica_app_owner())
            await self.direct.start()
        return app

    def check_direct_ingress(self) -> None:
        if self.direct is not None:
            self.direct.check()

    async def drain(self, timeout_s: float) -> int:
        """Refuses new generation requests (503 + Retry-After; /health 503) and waits up to `timeout_s` for the
        ones in flight; returns how many are still running."""
        return await self.http_app.state.admission.drain(timeout_s)

    async def __del__(self) -> None:
        """Serve stops this replica (redeploy, scale-down, shutdown) and awaits this; it waits only for requests its
        proxy forwarded, so direct ingress ones are drained here, within drain_timeout_s. `async def`: Serve's
        @serve.ingress wrapper awaits a class's `__del__` only then (it drops what a plain one returns). Python calls
        it again when it collects the object; that coroutine is dropped unrun (its warning is filtered above)."""
        direct, self.direct = self.direct, None
        if direct is not None:
            direct.stop_accepting()  # a replacement replica on this node takes the new connections
            await self.drain(self.args.drain_timeout_s)
            await direct.stop()


@serve.deployment(name=INGRESS_DEPLOYMENT, logging_config=QUIET)
@serve.ingress()
class DSAIngress(DrainableHTTP):
    """The FastAPI app of cluster/http_api/ingress.py over a `ServeEngineClient`."""

    def __init__(self, engine: DeploymentHandle, args: ServeAppArgs, prefill: DeploymentHandle | None = None):
        self.engine, self.args, self.prefill = engine, args, prefill  # prefill: DSAPrefill, disaggregated
        self.settings = ingress_settings(args, resolve_model_dir(args.model))
        configure_console_logging()  # the access log: one INFO line per HTTP request, forwarded by Ray

    async def __serve_build_asgi_app__(self):
        return await self.serve_app(build_app(await ServeEngineClient.connect(self.engine, self.prefill),
                                                self.settings))

    def check_health(self) -> None:
        self.check_direct_ingress()


@serve.deployment(name=SERVER_DEPLOYMENT, logging_config=QUIET)
@serve.ingress()
class DSAServer(DrainableHTTP):
    """engine_placement="colocated": the HTTP app over an engine in the same process (no engine handle)."""

    def __init__(self, args: ServeAppArgs):
        spec = serve_engine_spec(args)  # config.json read once in this process
        model_dir = spec.model.path
        text = replica_text(spec, args)  # read once for the engine and the HTTP app
        self.engine = start_replica_engine(spec, SERVER_DEPLOYMENT, args, text)
        self.settings = ingress_settings(args, model_dir)
        same = Path(self.settings.model_dir).resolve() == model_dir.resolve()
        self.text = text if same and self.settings.chat_template == args.chat_template else None
        self.args = args
        configure_console_logging()

    async def __serve_build_asgi_app__(self):
        return await self.serve_app(build_app(self.engine, self.settings, self.text))

    async def check_health(self) -> None:
        self.check_direct_ingress()
        await self.engine.check_health()


def validation_line(error: dict) -> str:
    """One pydantic error as `field: message` (a check of several fields has no field of its own)."""
    message = error["msg"].removeprefix("Value error, ")
    return f"{'.'.join(map(str, error['loc']))}: {message}" if error["loc"] else message


def validate_args(args: dict[str, Any] | ServeAppArgs) -> ServeAppArgs:
    """ServeAppArgs, or one ValueError line naming each bad field."""
    try:
        return ServeAppArgs.model_validate(args)
    except ValidationError as err:
        fields = "; ".join(validation_line(e) for e in err.errors())
        raise ValueError(f"invalid {APP_NAME} args: {fields}") from None


def http_deployment(args: ServeAppArgs) -> str:
    """The deployment whose replicas answer HTTP (and drain): DSAServer when colocated, else DSAIngress."""
    return SERVER_DEPLOYMENT if args.engine_placement == "colocated" else INGRESS_DEPLOYMENT


def engine_router_config(args: ServeAppArgs) -> RequestRouterConfig:
    """DSAEngine's router (cluster/engine_router.py): token channels to their replica; prompts by prefix, in blocks
    of the KV page size, when both prefix-aware routing and the engines' prefix caches are on."""
    kwargs = {"prefix_aware": args.prefix_aware_routing and args.prefix_caching_enabled, "block_tokens": args.page_size}
    return RequestRouterConfig(request_router_class=EngineRouter, request_router_kwargs=kwargs)


def build_application(args: ServeAppArgs, engine_replicas: int | None = None) -> Application:
    """The app of `args.engine_placement`; `engine_replicas` overrides the engine deployment's num_replicas
    (None: Serve's default, or the config file's num_replicas / autoscaling_config)."""
    replicas = {} if engine_replicas is None else {"num_replicas": engine_replicas}
    # A replica Serve stops (redeploy, scale-down, shutdown) gets no new requests and waits this long for its
    # ongoing ones (HTTP streams on the ingress, engine streams on the engine) before it is killed.
    drain = {"graceful_shutdown_timeout_s": args.drain_timeout_s}
    # Above the app's own cap, so overload is answered by the app's 429 body rather than queued by Serve
    # (Serve's default of 5 in flight per replica would serialize a 32-stream load).
    ingress_cap = 2 * args.ingress.max_ongoing_requests
    if args.engine_placement == "colocated":
        return DSAServer.options(placement_group_bundles=engine_bundles(args),
                                 placement_group_strategy=args.placement_strategy,
                                 ray_actor_options=HTTP_REPLICA_ACTOR_OPTIONS,
                                 max_ongoing_requests=ingress_cap, **replicas, **drain).bind(args)
    engine_args, prefill = args, ()
    if args.pd_disaggregation:  # DSAEngine replicas are decode groups, DSAPrefill replicas prefill for them
        engine_args, prefill_args = args.group_args("decode"), args.group_args("prefill")
        prefill = (DSAPrefill.options(placement_group_bundles=engine_bundles(prefill_args),
                                      placement_group_strategy=args.placement_strategy,
                                      request_router_config=engine_router_config(args),
                                      num_replicas=args.prefill_replicas, max_ongoing_requests=PREFILL_MAX_ONGOING,
                                      **drain).bind(prefill_args),)
    engine = DSAEngine.options(placement_group_bundles=engine_bundles(engine_args),
                               placement_group_strategy=args.placement_strategy,
                               request_router_config=engine_router_config(args),
                               max_ongoing_requests=ENGINE_MAX_ONGOING, **replicas, **drain).bind(engine_args, *prefill)
    return DSAIngress.options(ray_actor_options=HTTP_REPLICA_ACTOR_OPTIONS, max_ongoing_requests=ingress_cap,
                              **drain).bind(engine, args, *prefill)


def app(args: dict[str, Any]) -> Application:
    """The Serve app builder of `import_path: cluster.serve_app:app` (`args:` is ServeAppArgs)."""
    return build_application(validate_args(args))
