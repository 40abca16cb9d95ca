"""`dsa-serve serve` as a subprocess for end-to-end tests: a free port, readiness, and the Ray processes under it."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from cluster.serve_settings import API_KEY_ENV

START_TIMEOUT_S = 240


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_server(arguments: list[str], log_path: Path, port: int) -> subprocess.Popen:
    """`python -m cluster.cli serve --port PORT *arguments`, its output in `log_path`, outside any Ray cluster of
    the caller's environment, with SIGINT ignored as some launchers leave it (Ctrl-C must still stop it)."""
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", API_KEY_ENV)}
    env["PYTHONUNBUFFERED"] = "1"  # the replicas' lines Ray forwards reach the log file as they come
    command = [sys.executable, "-m", "cluster.cli", "serve", "--port", str(port), *arguments]
    with open(log_path, "w") as log:
        return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env,
                                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))


def wait_until_ready(process: subprocess.Popen, base_url: str, log_path: Path, api_key: str | None = None) -> None:
    """Until GET /v1/models answers 200; fails the test with the server's log tail if it exits or times out."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            pytest.fail(f"dsa-serve serve exited with {process.returncode}:\n{log_path.read_text()[-4000:]}")
        try:
            if httpx.get(f"{base_url}/v1/models", headers=headers).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(1)
    process.kill()
    pytest.fail(f"dsa-serve serve not ready within {START_TIMEOUT_S}s:\n{log_path.read_text()[-4000:]}")


def stop_with_ctrl_c(process: subprocess.Popen, log_path: Path, timeout_s: float = 90.0) -> None:
    """Ctrl-C (SIGINT) the server; it must exit 0 within `timeout_s` and log that it stopped (else killed, failed)."""
    process.send_signal(signal.SIGINT)
    try:
        assert process.wait(timeout=timeout_s) == 0, log_path.read_text()[-4000:]
    except subprocess.TimeoutExpired:
        process.kill()
        pytest.fail(f"dsa-serve serve did not stop within {timeout_s:g} s of Ctrl-C")
    assert "dsa-serve: stopped" in log_path.read_text()


def wait_for_log(log_path: Path, text: str, timeout_s: float = 30.0) -> bool:
    """Whether `text` shows up in the server's log within `timeout_s` (lines travel from replicas through Ray)."""
    deadline = time.monotonic() + timeout_s
    while text not in log_path.read_text():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.5)
    return True


def descendant_pids(root_pid: int, marker: bytes) -> list[int]:
    """Processes under `root_pid` (the server's local Ray is its child) whose command line contains `marker`,
    e.g. b"ray::CPWorker" (rank workers) or b"DSAEngine" (engine replicas)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parent = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(parent, []).append(int(stat.parent.name))
    found, todo = [], [root_pid]
    while todo:
        pid = todo.pop()
        todo += children.get(pid, [])
        try:
            if marker in Path(f"/proc/{pid}/cmdline").read_bytes():
                found.append(pid)
        except OSError:
            continue
    return sorted(found)


@contextlib.contextmanager
def serve_app_in_process(settings: dict, num_cpus: int, engine_replicas: int | None = None):
    """The app of `settings` (ServeAppArgs fields) on a local Ray of this process, through Serve's proxy; yields
    its base URL. No API key (DSA_SERVE_API_KEY is set aside meanwhile); Serve and Ray are shut down after."""
    import ray
    from ray import serve

    from cluster.serve_app import APP_NAME, build_application, validate_args

    api_key, port = os.environ.pop(API_KEY_ENV, None), free_port()
    ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, log_to_driver=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(build_application(validate_args(settings), engine_replicas), name=APP_NAME, route_prefix="/")
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()
        if api_key is not None:
            os.environ[API_KEY_ENV] = api_key
