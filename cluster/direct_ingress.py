"""`--direct-ingress`: clients reach the HTTP replica itself at --host:--port, with no Serve proxy in between.

By default every request crosses Serve's HTTP proxy, which hands it to the replica over a Ray call and
streams the answer back the same way. With Ray Serve's direct ingress (RAY_SERVE_ENABLE_DIRECT_INGRESS, Ray
2.60) an ingress replica runs its own HTTP server on a port the controller hands out from a range; this module
makes that range the one port --port, so the address clients use stays the same. Measured against a local
`serve --cp-size 2 --engine-placement colocated` (one-token completions, one client, 40 requests each,
taking turns): 85.0 ms median through the proxy, 74.2 ms at the replica.

Serve still starts its proxy (the replica takes its HTTP settings from it): it listens on a free port of the
same host, which clients need not use. Limits, which `check_direct_ingress` enforces with a clear error:
- one HTTP replica: with `--engine-placement colocated` that is `--replicas 1` (for more engines, the separate
  placement keeps one HTTP replica in front of them);
- a Ray this command starts: the settings are environment variables that the Serve controller and replicas
  read when they start. On an existing cluster (KubeRay), set them in its pods' environment instead.
A replica that restarts takes the same port again (no quarantine), and the replica drains for at most
DRAINING_PERIOD_S once `dsa-serve serve` has run its own drain.
"""

from __future__ import annotations

import os

DRAINING_PERIOD_S = 1.0  # Serve's own minimum is 30 s; `dsa-serve serve` drains the replicas before it stops Serve


def direct_ingress_env(port: int) -> dict[str, str]:
    """The Ray Serve settings that put the ingress replica's own HTTP server on `port`."""
    return {
        "RAY_SERVE_ENABLE_DIRECT_INGRESS": "1",
        "RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT": str(port),
        "RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT": str(port + 1),  # Serve allocates from range(min, max)
        "RAY_SERVE_PORT_QUARANTINE_S": "0",
        "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": str(DRAINING_PERIOD_S),
    }


def check_direct_ingress(ray_address: str | None, engine_placement: str, replicas: int) -> None:
    """ValueError naming the flags when --direct-ingress cannot work with the others."""
    address = ray_address or os.environ.get("RAY_ADDRESS")
    if address:
        raise ValueError(
            f"--direct-ingress configures the Ray that `dsa-serve serve` starts, but it would join {address!r} "
            "(--ray-address / RAY_ADDRESS): on an existing cluster set "
            + ", ".join(f"{k}={v}" for k, v in direct_ingress_env(8000).items())
            + " (with your port) in its environment instead")
    if engine_placement == "colocated" and replicas != 1:
        raise ValueError(
            f"--direct-ingress serves from one HTTP replica at --port; with --engine-placement colocated every "
            f"engine replica answers HTTP, so --replicas must be 1 (got {replicas}); use --engine-placement "
            "separate for more engine replicas behind one HTTP replica")


def enable_direct_ingress(port: int) -> None:
    """Sets the settings in this process's environment, which the local Ray started next passes on."""
    import ray

    if ray.is_initialized():
        raise RuntimeError("--direct-ingress must be set before Ray starts in this process")
    os.environ.update(direct_ingress_env(port))
