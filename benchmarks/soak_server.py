"""The server `python -m benchmarks soak` runs against: a real `dsa-serve serve` child process on a free loopback port.

The child starts its own local Ray (RAY_ADDRESS is dropped from its environment); the soak then joins that Ray
as a driver (its GCS address read from the child's raylet) to reach the Serve actors. Ray enables token
authentication for a new local cluster unless RAY_AUTH_MODE says otherwise, and a driver joining it must be in
the same mode: the soak sets RAY_AUTH_MODE=token for itself and the child when it is unset (the token is
Ray's default file, which the child creates if missing). `stop` sends SIGTERM (the server's Ctrl-C path), waits,
and kills what is left of the tree it started.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from benchmarks.soak_probe import children_of, gcs_address, start_time
from model_workers.comm import free_port

READY_TIMEOUT_S = 300
STOP_TIMEOUT_S = 120
ORPHAN_WAIT_S = 15
OWN_FLAGS = ("--port", "--host", "--ray-address")  # the soak sets these itself


@dataclass
class Server:
    process: subprocess.Popen
    url: str
    log_path: Path
    command: list[str]

    @property
    def pid(self) -> int:
        return self.process.pid


def check_serve_args(words: list[str]) -> None:
    for word in words:
        if word.split("=", 1)[0] in OWN_FLAGS:
            raise ValueError(f"--serve-args must not set {word.split('=', 1)[0]}: the soak serves on a free "
                             f"loopback port of a Ray it starts (allowed: every other `dsa-serve serve` flag)")


def ray_environment() -> dict[str, str]:
    """The child's environment: no RAY_ADDRESS (its own local Ray); RAY_AUTH_MODE as this process uses it."""
    os.environ.setdefault("RAY_AUTH_MODE", "token")  # Ray's default for a new local cluster, set for both sides
    return {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}


def start(serve_args: list[str], log_path: Path) -> Server:
    """`dsa-serve serve --port P <serve_args>` with stdout and stderr in `log_path`; returns once it answers."""
    check_serve_args(serve_args)
    port = free_port()
    command = [sys.executable, "-m", "cluster.cli", "serve", "--host", "127.0.0.1", "--port", str(port), *serve_args]
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "wb") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=ray_environment(),
                                   start_new_session=True)  # Ctrl-C of the soak reaches it through `stop` only
    server = Server(process, f"http://127.0.0.1:{port}", log_path, command)
    try:
        wait_ready(server)
    except BaseException:
        stop(server)
        raise
    return server


def wait_ready(server: Server) -> None:
    """Until GET /health and /v1/models answer 200; RuntimeError with the log's tail if the child exits first."""
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            raise RuntimeError(f"dsa-serve serve exited with {server.process.returncode} before it was ready:\n"
                               f"{log_tail(server.log_path)}")
        try:
            if all(httpx.get(server.url + path, timeout=5, trust_env=False).status_code == 200
                   for path in ("/health", "/v1/models")):
                return
        except httpx.TransportError:
            pass
        time.sleep(1)
    raise RuntimeError(f"dsa-serve serve not ready within {READY_TIMEOUT_S}s:\n{log_tail(server.log_path)}")


def log_tail(path: Path, lines: int = 30) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


def connect_ray(server: Server) -> None:
    """Joins the child's Ray as a driver (no log forwarding: the child's log has it)."""
    import ray

    ray.init(address=gcs_address(server.pid), log_to_driver=False)


def stop(server: Server) -> dict:
    """SIGTERM, wait; SIGKILL for any process of its tree still alive. Exit status, seconds, processes killed."""
    tree = {pid: start_time(pid) for pid in children_of(server.pid)}
    start_s = time.monotonic()
    if server.process.poll() is None:
        server.process.send_signal(signal.SIGTERM)
    try:
        server.process.wait(STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        server.process.kill()
        server.process.wait()
    seconds = time.monotonic() - start_s

    def alive() -> list[int]:
        return [pid for pid, started in tree.items() if started is not None and start_time(pid) == started]

    deadline = time.monotonic() + ORPHAN_WAIT_S
    while alive() and time.monotonic() < deadline:  # Ray's processes finish their own shutdown
        time.sleep(0.5)
    killed = []
    for pid in alive():  # still that process (same start time), not a reused pid: what the server left behind
        try:
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)
        except ProcessLookupError:
            pass
    return {"returncode": server.process.returncode, "stop_s": round(seconds, 1), "left_running_killed": len(killed)}
