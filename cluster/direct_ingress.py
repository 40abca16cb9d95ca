"""Direct ingress: every HTTP replica (DSAServer, DSAIngress) also answers HTTP itself, with no Serve proxy hop.

By default a request crosses Serve's HTTP proxy, which hands it to a replica over a Ray call and streams the
answer back the same way; inside the replica Serve passes each ASGI message between its own event loop and
the one the app runs on. With `ServeAppArgs.direct_ingress_port` set (`dsa-serve serve --direct-ingress`),
the replica runs a uvicorn server of its own on that port, on the event loop the app and the engine already
run on, so a token chunk goes from the engine's queue to the socket with no thread or process in between.
Serve's proxy keeps answering too (the same app behind it), on its own port.

Measured on the 2-core bench VM (`bench serve --engine-placement colocated --concurrency 1,32`, HTTP / in-process):
Ray Serve's own direct ingress (RAY_SERVE_ENABLE_DIRECT_INGRESS, which this replaced) reached 0.83x of the
in-process tokens/s at 32 streams and 1.26x its one-stream TTFT; this server, with the engine changes of the same
day, 0.86-0.92x and 0.98-1.10x; through Serve's proxy 0.66-0.70x and 1.54-1.73x (docs/bench_notes/serving_ingress.md).

Every replica binds with SO_REUSEPORT, so several replicas on one node share the port and a replacement
replica can bind while the old one drains; a port someone else listens on (another program, another app or Ray
cluster: `owner_file` names the app holding it) is refused, as a second server must not take half the first
one's connections. The kernel spreads connections, not requests, over them: a client
that keeps one connection alive stays with one replica, hence `dsa-serve serve` turns direct ingress on by
itself only where one replica answers HTTP. Requests that arrive this way are not counted by Serve (its
autoscaling and its graceful shutdown see only those through the proxy), so the replica drains them itself
when Serve stops it (`DrainableHTTP.__del__`: stop accepting, wait for the requests in flight, stop the server);
`dsa-serve serve`'s own drain on SIGTERM keeps accepting and answers new generation requests 503 + Retry-After,
as through the proxy. The app's own limit (max_ongoing_requests: 429) holds on both paths.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import socket
import tempfile
from pathlib import Path
from typing import Iterator

import uvicorn
from ray.serve.config import HTTPOptions
from starlette.types import ASGIApp

STARTUP_TIMEOUT_S = 30.0


class _ReplicaServer(uvicorn.Server):
    """uvicorn without its signal handlers: the replica's process and its signals belong to Ray."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def _bound_socket(host: str, port: int, share: bool) -> socket.socket:
    """A TCP socket bound to host:port (with SO_REUSEPORT when `share`); OSError naming the address."""
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                         flags=socket.AI_PASSIVE)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if share:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind(address)
    except OSError as exc:
        sock.close()
        raise OSError(exc.errno, f"direct ingress cannot listen on {host}:{port}: {exc.strerror}") from None
    return sock


def owner_file(port: int) -> Path:
    """Names the app whose replicas listen on `port` of this node (the one a new replica may share it with), and
    the process that wrote it: `app<TAB>pid`."""
    return Path(tempfile.gettempdir()) / f"dsa-serve-direct-ingress-{port}.owner"


def recorded_owner(port: int, own_app: str) -> str | None:
    """The app `owner_file(port)` names; None when there is none, or when it names another app and the process
    that wrote it is gone (a file a killed server left behind: whoever holds the port now is someone else). A
    record of `own_app` is kept whatever its process: another replica of the app may still share the port."""
    try:
        app, _, pid = owner_file(port).read_text().partition("\t")
    except OSError:
        return None
    if app == own_app or (pid.isdigit() and process_alive(int(pid))):
        return app
    return None


def process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        pass
    return True


def listening_socket(host: str, port: int, owner: str) -> socket.socket:
    """A socket bound to host:port with SO_REUSEPORT, so the replicas of one app on a node share the port; OSError
    naming the address when another program, or another app (`owner`: which app this replica belongs to), holds it:
    SO_REUSEPORT alone would let a second server on the port take half of the first one's connections."""
    try:
        _bound_socket(host, port, share=False).close()  # free: nobody listens there
    except OSError:
        holder = recorded_owner(port, owner)
        if holder != owner:
            raise OSError(errno.EADDRINUSE, f"direct ingress cannot listen on {host}:{port}: the port is taken "
                                            f"(by {holder or 'another program'}, not {owner})") from None
    sock = _bound_socket(host, port, share=True)
    with contextlib.suppress(OSError):  # unwritable: the app's next replica on this node cannot share, and says so
        owner_file(port).write_text(f"{owner}\t{os.getpid()}")
    sock.set_inheritable(True)
    return sock


# Idle keep-alive connections stay open as long as through Serve's proxy (HTTPOptions.keep_alive_timeout_s, 90 s),
# not uvicorn's 5 s: longer than clients' pools keep idle connections (aiohttp 15 s) and load balancers' idle
# timeouts (60 s on AWS ALB), so the server is not the side that closes a connection a client may be reusing. A
# `bench serve` run met that race: its HTTP round began 4.99 s after the previous one ended, on aiohttp's pooled
# connections, and one request got ServerDisconnectedError from a connection uvicorn was closing.
KEEP_ALIVE_TIMEOUT_S = HTTPOptions().keep_alive_timeout_s


class DirectIngressServer:
    """`app` served by uvicorn on host:port, on the event loop that calls `start`."""

    def __init__(self, app: ASGIApp, host: str, port: int, owner: str):
        """`owner`: the app the replica belongs to; only its replicas share the port (listening_socket)."""
        self.host, self.port, self.owner = host, port, owner
        config = uvicorn.Config(app, lifespan="off", log_level="warning", access_log=False, loop="none",
                                timeout_graceful_shutdown=1,  # http "auto": httptools where installed, else h11
                                timeout_keep_alive=KEEP_ALIVE_TIMEOUT_S)
        self._server = _ReplicaServer(config)
        self._task: asyncio.Task | None = None

    async def start(self) -> None:
        """Binds and serves in a task of the running loop; returns once it accepts connections."""
        sock = listening_socket(self.host, self.port, self.owner)
        self._task = asyncio.get_running_loop().create_task(self._server.serve(sockets=[sock]))
        deadline = asyncio.get_running_loop().time() + STARTUP_TIMEOUT_S
        while not self._server.started:
            if self._task.done():
                self._task.result()  # raises what stopped it
                raise RuntimeError(f"direct ingress on {self.host}:{self.port} stopped while starting")
            if asyncio.get_running_loop().time() > deadline:
                raise RuntimeError(f"direct ingress on {self.host}:{self.port} did not start in {STARTUP_TIMEOUT_S} s")
            await asyncio.sleep(0.01)

    def check(self) -> None:
        """RuntimeError when the server is not running (for the replica's health check)."""
        if self._task is None or self._task.done():
            cause = "" if self._task is None or self._task.cancelled() or self._task.exception() is None \
                else f": {self._task.exception()!r}"
            raise RuntimeError(f"the direct ingress server on {self.host}:{self.port} is not running{cause}")

    def stop_accepting(self) -> None:
        """Closes the listening socket: new connections go to the node's other replicas (or are refused); the
        open ones stay."""
        for server in getattr(self._server, "servers", []):
            server.close()

    async def stop(self) -> None:
        """Stops the server (uvicorn closes idle connections and waits briefly for the busy ones)."""
        self._server.should_exit = True
        if self._task is not None:
            await asyncio.gather(self._task, return_exceptions=True)

