"""`dsa-serve serve`: the OpenAI-style HTTP server (cluster/serve_app.py) on Ray Serve, until Ctrl-C.

Starts a local Ray (or joins --ray-address / $RAY_ADDRESS) sized for the ingress plus --replicas CP
groups, runs the application, prints where it listens, and on SIGTERM (docker stop, a Kubernetes pod's
termination) or Ctrl-C drains: the HTTP replicas refuse new generation requests (503 + Retry-After, /health
503) while the ones in flight finish, for at most --drain-timeout-s; then it shuts Serve and the Ray it
started down and exits 0. A second Ctrl-C skips the rest of the drain. Each HTTP request logs one INFO line
(`dsa_serve.access`, from the ingress replica).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import threading
import time

from cluster.commands.aliases import resolve_speculation
from cluster.commands.args import add_server_arguments, prefix_caching_on
from cluster.engine_limits import limits_from
from cluster.serve_settings import API_KEY_ENV, ServeAppArgs
from cp_router.protocol import one_line


def add_parser(commands) -> None:
    parser = commands.add_parser("serve", help="serve the OpenAI-style HTTP API on Ray Serve")
    add_server_arguments(parser, dtype_default="auto")
    parser.add_argument("--host", default="127.0.0.1", help="bind address (0.0.0.0 exposes the server)")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--api-key", default=None, help=f"require this Bearer key on /v1 (default: env {API_KEY_ENV})")
    parser.add_argument("--replicas", type=int, default=1, help="engine replicas = CP groups")
    parser.add_argument("--allowed-origins", default=None,
                        help='CORS origins: a JSON list (vLLM\'s form, e.g. \'["*"]\') or a comma list')
    parser.add_argument("--direct-ingress", action=argparse.BooleanOptionalAction, default=None,
                        help="the HTTP replica answers at --host:--port itself, no Serve proxy hop (Serve's proxy "
                             "moves to a free port; cluster/direct_ingress.py). Default: on where one replica "
                             "answers HTTP (--engine-placement separate, or colocated with --replicas 1) on a Ray "
                             "this command starts; off on a cluster it joins (--ray-address, RAY_ADDRESS)")
    parser.add_argument("--ray-metrics-export", action=argparse.BooleanOptionalAction, default=True,
                        help="also copy the dsa_serve metrics into Ray's metrics export (ray_dsa_serve_*, what "
                             "KubeRay's PodMonitor scrapes); --no-ray-metrics-export: /metrics only, saving Ray's "
                             "CPU per histogram observation (one per generated token)")
    parser.add_argument("--prefix-aware-routing", action=argparse.BooleanOptionalAction, default=True,
                        help="with several engine replicas (--replicas, separate placement), send a prompt to the "
                             "replica that was sent its longest prefix unless that one is overloaded, else to the "
                             "least-loaded one; --no-prefix-aware-routing: Serve's power-of-two choice "
                             "(cluster/engine_router.py)")
    add_disaggregation_arguments(parser)
    drain = ServeAppArgs.model_fields["drain_timeout_s"]
    parser.add_argument("--drain-timeout-s", type=float, default=drain.default, help=drain.description)
    parser.set_defaults(run=run)


def add_disaggregation_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--pd-disaggregation", action="store_true",
                        help="prefill/decode disaggregation: DSAPrefill groups prefill, DSAEngine groups decode "
                             "(--replicas of them); docs/disaggregation.md")
    parser.add_argument("--prefill-cp-size", type=int, default=None, help="ranks of a prefill group (default: --cp-size)")
    parser.add_argument("--decode-dp-size", type=int, default=1, help="ranks of a decode group (DP-attention decode)")
    parser.add_argument("--prefill-replicas", type=int, default=1, help="prefill groups")
    parser.add_argument("--decode-replicas", type=int, default=None, help="decode groups (the same as --replicas)")
    parser.add_argument("--pd-min-prefill-tokens", type=int, default=0,
                        help="a shorter prompt is prefilled by its decode group itself (no hand-off)")


def engine_replicas(args: argparse.Namespace) -> int:
    """Replicas of the engine deployment: --decode-replicas when given, else --replicas."""
    return args.decode_replicas if getattr(args, "decode_replicas", None) is not None else args.replicas


def check_arguments(args: argparse.Namespace) -> None:
    if engine_replicas(args) < 1:
        raise ValueError(f"--replicas / --decode-replicas must be >= 1, got {engine_replicas(args)}")
    if not 1 <= args.port <= 65535:
        raise ValueError(f"--port must be in 1..65535, got {args.port}")


def direct_ingress_on(args: argparse.Namespace) -> bool:
    """--direct-ingress as given, else on where one replica answers HTTP (the separate placement's one ingress or
    a lone colocated server: the kernel spreads connections, not requests, over replicas sharing the port) on a
    Ray this command starts. On a cluster it joins (KubeRay), Serve's proxy keeps --port: probes and Services
    expect it there."""
    if args.direct_ingress is not None:
        return args.direct_ingress
    joins = args.ray_address or os.environ.get("RAY_ADDRESS")
    return not joins and (args.engine_placement == "separate" or args.replicas == 1)


def app_args(args: argparse.Namespace):
    """ServeAppArgs from the flags (SGLang / vLLM spellings resolved first)."""
    from cluster.serve_app import validate_args

    resolve_speculation(args)
    names = ("model", "chat_template", "served_model_name", "reasoning_parser", "tool_call_parser",
             "enable_auto_tool_choice", "cp_size", "cp_strategy", "cp_impl", "ep_size", "speculative_num_steps",
             "speculative_token_map",
             "dtype", "kv_cache_dtype", "device", "engine_placement", "enable_deterministic_inference",
             "attention_backend", "disable_cuda_graph")
    fields = {name: getattr(args, name) for name in names}
    fields["enable_prefix_caching"] = prefix_caching_on(args)
    if getattr(args, "drain_timeout_s", None) is not None:  # `serve` has the flag, `bench serve` not
        fields["drain_timeout_s"] = args.drain_timeout_s
    fields["prefix_aware_routing"] = getattr(args, "prefix_aware_routing", True)  # `bench serve`: the default
    if getattr(args, "pd_disaggregation", False):
        fields.update(pd_disaggregation=True, prefill_cp_size=args.prefill_cp_size, decode_dp_size=args.decode_dp_size,
                      prefill_replicas=args.prefill_replicas, pd_min_prefill_tokens=args.pd_min_prefill_tokens)
    ingress = {"api_key": args.api_key, "allowed_origins": origins(getattr(args, "allowed_origins", None)),
               "ray_metrics_export": getattr(args, "ray_metrics_export", True)}  # `bench serve`: on, as the default
    if getattr(args, "port", None) is not None and direct_ingress_on(args):  # `serve`; `bench serve` picks a port
        fields.update(direct_ingress_port=args.port, direct_ingress_host=args.host)
    fields.update(limits_from(args), ingress=ingress)
    return validate_args(fields)


def origins(text: str | None) -> list[str]:
    """--allowed-origins as a list: JSON (`["https://a", "https://b"]`) or comma-separated."""
    if not text:
        return []
    if text.lstrip().startswith("["):
        values = json.loads(text)
        if not isinstance(values, list) or not all(isinstance(v, str) for v in values):
            raise ValueError(f"--allowed-origins must be a JSON list of strings or a comma list, got {text!r}")
        return values
    return [part.strip() for part in text.split(",") if part.strip()]


def wait_for_stop() -> str:
    """Blocks until SIGTERM or Ctrl-C; returns which one. Later SIGTERMs are ignored (the drain is under way);
    a later Ctrl-C raises KeyboardInterrupt, which cuts the drain short."""
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        while not stop.wait(1.0):
            pass
    except KeyboardInterrupt:
        return "Ctrl-C"
    return "SIGTERM"


def drain(serve, settings, why: str) -> None:
    """Broadcasts `drain` to every HTTP replica (cluster/serve_app.py) and waits for their requests in flight,
    at most `settings.drain_timeout_s` (serve.shutdown() would cut them: it stops the HTTP proxies at once)."""
    from cluster.serve_app import APP_NAME, http_deployment

    timeout_s, start = settings.drain_timeout_s, time.monotonic()
    print(f"dsa-serve: {why}: draining (new requests get 503; at most {timeout_s:g} s for those in flight)",
          flush=True)
    handle = serve.get_deployment_handle(http_deployment(settings), APP_NAME)
    try:
        left = handle.broadcast("drain", timeout_s).results(timeout_s=timeout_s + DRAIN_CALL_SLACK_S,
                                                             return_exceptions=True)
    except TimeoutError:
        print(f"dsa-serve: the HTTP replicas did not answer the drain within {timeout_s + DRAIN_CALL_SLACK_S:g} s",
              flush=True)
        return
    failed = [result for result in left if isinstance(result, BaseException)]
    running = sum(result for result in left if isinstance(result, int))
    outcome = f"{running} requests still running, cut" if running else "no request in flight"
    print(f"dsa-serve: drained {len(left) - len(failed)} HTTP replicas in {time.monotonic() - start:.1f} s; "
          f"{outcome}" + "".join(f"; a replica failed to drain: {one_line(exc)}" for exc in failed), flush=True)


DRAIN_CALL_SLACK_S = 10.0  # beyond drain_timeout_s, for the broadcast itself to reach and answer


def run(args: argparse.Namespace) -> int:
    check_arguments(args)
    from ray import serve

    from cluster.launch import start_ray
    from cluster.replica_engine import serve_engine_spec
    from cluster.serve_app import APP_NAME, build_application
    from model_workers.checkpoint.tokenizer import read_chat_template
    from model_workers.comm import free_port

    # Ctrl-C must stop the server even when this process inherited SIGINT as ignored (a parent that
    # ignores it, e.g. some launchers and test runners): Python then installs no KeyboardInterrupt handler.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    settings = app_args(args)
    model = serve_engine_spec(settings).model  # the flags checked against the model before Ray starts
    read_chat_template(model.path, settings.chat_template, model.config.model_type)  # a bad --chat-template too
    started = start_ray(app_cpus(settings, engine_replicas(args)), args.ray_address, log_to_driver=True)
    try:
        direct = settings.direct_ingress_port is not None
        serve_port = free_port() if direct else args.port  # with direct ingress Serve's proxy is unused by clients
        serve.start(http_options={"host": args.host, "port": serve_port})
        serve.run(build_application(settings, engine_replicas(args)), name=APP_NAME, route_prefix="/")
        via = f" (direct ingress; Serve's proxy on port {serve_port})" if direct else " (through Serve's proxy)"
        print(f"dsa-serve: serving {model.name} ({layout(settings, engine_replicas(args))}) on "
              f"http://{args.host}:{args.port}/v1{via}; Ctrl-C stops", flush=True)
        drain(serve, settings, wait_for_stop())
    except KeyboardInterrupt:
        pass
    finally:
        stop_serve(serve, wait_s=SERVE_SHUTDOWN_WAIT_S if started else None)
        if started:
            import ray

            ray.shutdown()  # stops every process of the local cluster, whatever Serve left running
    print("dsa-serve: stopped", flush=True)
    return 0


SERVE_SHUTDOWN_WAIT_S = 30.0


def app_cpus(settings: ServeAppArgs, replicas: int) -> int:
    """Logical CPUs of the app: the ingress, and 1 + ranks per engine group (prefill groups too)."""
    from cluster.launch import engine_cpus

    if not settings.pd_disaggregation:
        return 1 + replicas * engine_cpus(settings.cp_size)
    prefill = settings.group_args("prefill").cp_size
    return 1 + replicas * engine_cpus(settings.decode_dp_size) + settings.prefill_replicas * engine_cpus(prefill)


def layout(settings: ServeAppArgs, replicas: int) -> str:
    if not settings.pd_disaggregation:
        return f"cp_size={settings.cp_size}, replicas={replicas}"
    return (f"disaggregated: {settings.prefill_replicas} prefill group(s) of cp_size="
            f"{settings.group_args('prefill').cp_size}, {replicas} decode group(s) of {settings.decode_dp_size} rank(s)")


def stop_serve(serve, wait_s: float | None) -> None:
    """serve.shutdown() (replicas drain their requests); on a cluster this command started, waits at most
    `wait_s` seconds for it, since ray.shutdown() afterwards stops whatever is still running."""
    if wait_s is None:
        serve.shutdown()
        return
    done = threading.Thread(target=serve.shutdown, daemon=True)
    done.start()
    done.join(wait_s)
    if done.is_alive():
        print(f"dsa-serve: Serve did not shut down within {wait_s:g}s; stopping the local Ray cluster", flush=True)
