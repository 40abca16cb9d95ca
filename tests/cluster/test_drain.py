"""Drain end to end, on a Ray head started the way KubeRay starts one (`ray start --head --block`) with
`dsa-serve serve --ray-address` on it (CPU, C = 2, the default model; one cluster and one server for the module):

* KubeRay's probe commands (v1.7.0's RayService CRD) pass against the head and its Serve proxy;
* a Serve redeploy while streams run: Serve's rolling update stops the old replicas only once their streams end;
* SIGTERM to `dsa-serve serve` while streams run: they finish, new requests get 503 + Retry-After, exit 0.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import pytest

from support.serve_process import free_port, start_server, wait_until_ready

pytestmark = pytest.mark.slow  # a Ray Serve deployment driven end to end (minutes): `make test-slow`

# Streams long enough to outlast the new replica's start: with 100 tokens they once ended before the old replica
# began to stop (2026-12-05, after speculation got faster), and the test saw no stopping replica to check.
REDEPLOY_STREAM_TOKENS = 400
DRAIN_TIMEOUT_S = 120  # --drain-timeout-s of the server: far above what the streams below need on a busy box
HEAD_START_TIMEOUT_S = 120
# KubeRay v1.7.0 ray-operator/controllers/ray/utils/constant.go: BaseWgetHealthCommand, filled in by
# common/pod.go initLivenessAndReadinessProbe (args: timeout, port, path); KubeRay's ports are 52365 (dashboard
# agent), 8265 (dashboard) and 8000 (Serve); here the same commands run with this head's free ports substituted.
KUBERAY_WGET = "wget --tries 1 -T {timeout} -q -O- http://localhost:{port}/{path} | grep success"
REDEPLOY = """
import sys
import ray
from ray import serve
from cluster.serve_app import APP_NAME, build_application, validate_args
ray.init(address=sys.argv[1], log_to_driver=False)
print("connected", flush=True)
sys.stdin.readline()
args = validate_args({"drain_timeout_s": float(sys.argv[2]), "ingress": {"retry_after_s": int(sys.argv[3])}})
serve.run(build_application(args, 1), name=APP_NAME, route_prefix="/")
print("redeployed", flush=True)
"""
REDEPLOYED_RETRY_AFTER_S = 3  # the redeploy changes the ingress's Retry-After: the later drain must show it
state = {"retry_after": "1"}  # what the app answers now (IngressSettings' default until the redeploy)


@pytest.fixture(scope="module")
def head():
    """A `ray start --head --block` in its own session (ended through its process group), with free ports."""
    ports = dict(zip(["port", "dashboard-port", "dashboard-agent-listen-port", "dashboard-agent-grpc-port",
                      "metrics-export-port", "node-manager-port", "object-manager-port", "runtime-env-agent-port",
                      "ray-client-server-port"], [free_port() for _ in range(9)]))
    temp_dir = tempfile.mkdtemp(prefix="rdrain", dir="/tmp")  # short: Ray's unix socket paths live under it
    command = [str(Path(sys.executable).parent / "ray"), "start", "--head", "--block", "--num-cpus", "8",
               "--include-dashboard", "true", "--dashboard-host", "127.0.0.1", "--temp-dir", temp_dir,
               "--disable-usage-stats", *[f"--{name}={port}" for name, port in ports.items()]]
    # ~/.ray/auth_token turns token auth on for `ray start` unless RAY_AUTH_MODE says otherwise; KubeRay pods
    # have no such file, and the clients here send no token.
    env = {**{k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}, "RAY_AUTH_MODE": "disabled"}
    log = open(Path(temp_dir) / "head.log", "w")
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        wait_for_gcs(process, ports["dashboard-port"], Path(temp_dir) / "head.log")
        yield {"address": f"127.0.0.1:{ports['port']}", "temp_dir": Path(temp_dir), **ports}
    finally:
        # The session of the `ray start` this fixture started. SIGINT: `ray start --block` stops its processes in
        # about 2 s (SIGTERM took 34 s, measured).
        os.killpg(process.pid, signal.SIGINT)
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
        log.close()
        shutil.rmtree(temp_dir, ignore_errors=True)


def wait_for_gcs(process: subprocess.Popen, dashboard_port: int, log_path: Path) -> None:
    deadline = time.monotonic() + HEAD_START_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            pytest.fail(f"ray start exited with {process.returncode}:\n{log_path.read_text()[-3000:]}")
        try:
            if "success" in httpx.get(f"http://127.0.0.1:{dashboard_port}/api/gcs_healthz", timeout=2).text:
                return
        except httpx.TransportError:
            pass
        time.sleep(1)
    pytest.fail(f"the Ray head was not up within {HEAD_START_TIMEOUT_S} s:\n{log_path.read_text()[-3000:]}")


@pytest.fixture(scope="module")
def server(head, tmp_path_factory):
    port, log_path = free_port(), tmp_path_factory.mktemp("drain") / "serve.log"
    process = start_server(["--ray-address", head["address"], "--drain-timeout-s", str(DRAIN_TIMEOUT_S)],
                           log_path, port)
    base_url = f"http://127.0.0.1:{port}"
    wait_until_ready(process, base_url, log_path)
    yield {"url": base_url, "port": port, "process": process, "log": log_path}
    if process.poll() is None:  # the SIGTERM test did not run
        process.send_signal(signal.SIGINT)
        process.wait(timeout=120)


def probe(command: str) -> subprocess.CompletedProcess:
    """A probe exactly as the kubelet runs an exec probe KubeRay wrote: `bash -c <command>`."""
    assert shutil.which("wget"), "the probe commands need wget (the image installs it)"
    return subprocess.run(["bash", "-c", command], capture_output=True, text=True, timeout=30)


def test_kuberay_probe_commands_pass_on_the_head_and_its_serve_proxy(head, server):
    agent, dashboard = head["dashboard-agent-listen-port"], head["dashboard-port"]
    raylet = KUBERAY_WGET.format(timeout=2, port=agent, path="api/local_raylet_healthz")
    gcs = KUBERAY_WGET.format(timeout=10, port=dashboard, path="api/gcs_healthz")
    serve_proxy = KUBERAY_WGET.format(timeout=10, port=server["port"], path="-/healthz")
    commands = {
        "head liveness/readiness, Ray < 2.53 (exec)": f"{raylet} && {gcs}",
        "RayService worker readiness (exec, every Ray version)": f"{raylet} && {serve_proxy}",
        # Ray >= 2.53 (ours: 2.60.0): an httpGet probe of /api/healthz on the agent port, here through wget.
        "head and worker liveness, Ray >= 2.53 (httpGet)": f"wget --tries 1 -T 5 -q -O- "
                                                           f"http://localhost:{agent}/api/healthz",
    }
    for what, command in commands.items():
        result = probe(command)
        print(f"{what}: `{command}` -> rc {result.returncode}, {result.stdout.strip()!r}")
        assert result.returncode == 0 and "success" in result.stdout, (what, result)
    assert probe(KUBERAY_WGET.format(timeout=2, port=free_port(), path="api/local_raylet_healthz")).returncode != 0


async def stream_completion(http: httpx.AsyncClient, index: int, max_tokens: int, started: asyncio.Event) -> dict:
    """One greedy streamed completion of exactly `max_tokens` tokens (ignore_eos); `started` once it streams."""
    body = {"prompt": f"Once upon a time {index}", "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    finish, usage, done = None, None, False
    async with http.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: "):
                event = json.loads(line[6:])
                assert "error" not in event, event
                usage = event.get("usage") or usage
                finish = next((c["finish_reason"] for c in event["choices"] if c["finish_reason"]), finish)
                started.set()
    return {"finish": finish, "tokens": usage and usage["completion_tokens"], "done": done}


async def streams_with(base_url: str, count: int, max_tokens: int, action):
    """`count` streams; once every one has streamed its first chunk, `await action(http)`; (results, its result)."""
    async with httpx.AsyncClient(base_url=base_url, timeout=DRAIN_TIMEOUT_S + 60) as http:
        started = [asyncio.Event() for _ in range(count)]
        tasks = [asyncio.create_task(stream_completion(http, i, max_tokens, started[i])) for i in range(count)]
        await asyncio.wait_for(asyncio.gather(*(event.wait() for event in started)), timeout=120)
        outcome = await action(http, tasks)
        return await asyncio.gather(*tasks), outcome


def engine_replica_logs(head) -> list[Path]:
    return sorted((head["temp_dir"] / "session_latest" / "logs" / "serve").glob("replica_dsa-serve_DSAEngine_*.log"))


def test_streams_survive_a_serve_redeploy_of_every_replica(head, server):
    """serve.run of changed args replaces every replica (a code version per run): Serve stops routing to the old
    ones and keeps them running until their streams end (graceful_shutdown_timeout_s = drain_timeout_s)."""
    before = engine_replica_logs(head)
    redeploy = subprocess.Popen([sys.executable, "-c", REDEPLOY, head["address"], str(DRAIN_TIMEOUT_S),
                                 str(REDEPLOYED_RETRY_AFTER_S)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                text=True, env={k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"})
    assert redeploy.stdout.readline().strip() == "connected"  # imports and ray.init done before the streams start

    async def redeploy_now(http, tasks):
        redeploy.stdin.write("go\n")
        redeploy.stdin.flush()

    results, _ = asyncio.run(streams_with(server["url"], 3, REDEPLOY_STREAM_TOKENS, redeploy_now))
    assert redeploy.wait(timeout=300) == 0 and redeploy.stdout.read().strip() == "redeployed"
    assert results == [{"finish": "length", "tokens": REDEPLOY_STREAM_TOKENS, "done": True}] * 3
    state["retry_after"] = str(REDEPLOYED_RETRY_AFTER_S)
    (old,) = before
    assert len(engine_replica_logs(head)) == 2  # a new engine replica (a new CP group) took over
    waits = re.findall(r"Waiting for an additional [\d.]+s to shut down: (\d+) ongoing requests", old.read_text())
    assert waits and int(waits[0]) > 0  # the old replica was stopping while the streams ran on it
    print(f"old engine replica stopping with {waits[0]} ongoing streams, {len(waits)} wait loops until they ended")
    after = httpx.post(f"{server['url']}/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=120)
    assert after.status_code == 200 and after.json()["choices"][0]["finish_reason"] == "length"


def test_sigterm_drains_the_streams_refuses_new_requests_and_exits_0(server):
    process, times = server["process"], {}

    async def sigterm_and_probe(http, tasks):
        times["sigterm"] = time.monotonic()
        process.send_signal(signal.SIGTERM)
        while not all(task.done() for task in tasks):
            refused = await http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
            if refused.status_code == 503:
                times["first_503"] = time.monotonic()
                return refused, await http.get("/health")
            assert refused.status_code == 200, refused.text  # admitted before the drain reached the ingress
            await asyncio.sleep(0.05)
        pytest.fail("no request was refused while the streams ran")

    results, (refused, health) = asyncio.run(streams_with(server["url"], 4, 200, sigterm_and_probe))
    times["streams_done"] = time.monotonic()
    assert results == [{"finish": "length", "tokens": 200, "done": True}] * 4
    for response in (refused, health):
        assert response.status_code == 503 and response.headers["Retry-After"] == state["retry_after"]
        assert response.json()["error"]["code"] == "server_draining"
    assert process.wait(timeout=DRAIN_TIMEOUT_S + 60) == 0
    times["exit"] = time.monotonic()
    log = server["log"].read_text()
    assert "no request in flight" in log and "dsa-serve: stopped" in log, log[-3000:]
    start = times.pop("sigterm")
    print("after SIGTERM: " + ", ".join(f"{name} {at - start:.1f} s" for name, at in times.items()))
