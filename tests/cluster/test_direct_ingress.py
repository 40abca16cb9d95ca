"""`dsa-serve serve --direct-ingress`: the HTTP replica itself listens on --port (no Serve proxy hop), replicas of
one node share the port, and the server answers and stops like the default one."""

from __future__ import annotations

import asyncio
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import httpx
import openai
import pytest

from cluster.cli import build_parser
from cluster.cli import main as cli_main
from cluster.commands.serve import app_args
from cluster.direct_ingress import DirectIngressServer, owner_file
from cluster.http_api.ingress import build_app
from cluster.serve_app import DSAIngress, DSAServer, validate_args
from cluster.serve_settings import IngressSettings, ServeAppArgs
from support.http_fakes import FakeEngine, write_checkpoint_files
from support.serve_process import (descendant_pids, free_port, start_server, stop_with_ctrl_c, wait_for_log,
                                   wait_until_ready)

pytestmark = pytest.mark.slow  # a Ray Serve deployment driven end to end (minutes): `make test-slow`


def named(name: bytes):
    """A minimal ASGI app answering every request with `name`."""

    async def app(scope, receive, send) -> None:
        if scope["type"] != "http":
            return
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
        await send({"type": "http.response.body", "body": name})

    return app


def test_replicas_of_one_node_share_the_port():
    port = free_port()

    async def main():
        first = DirectIngressServer(named(b"first"), "127.0.0.1", port, "app A")
        second = DirectIngressServer(named(b"second"), "127.0.0.1", port, "app A")
        await first.start()
        await second.start()  # SO_REUSEPORT: a second replica (or a replacement) binds the same port
        first.check()
        second.check()
        answers = set()
        for _ in range(24):  # fresh connections: the kernel spreads them over both
            async with httpx.AsyncClient(trust_env=False) as client:
                answers.add((await client.get(f"http://127.0.0.1:{port}/")).text)
        assert answers == {"first", "second"}
        await first.stop()
        for _ in range(12):  # the one left takes every new connection
            async with httpx.AsyncClient(trust_env=False) as client:
                assert (await client.get(f"http://127.0.0.1:{port}/")).text == "second"
        await second.stop()
        with pytest.raises(RuntimeError, match=f"direct ingress server on 127.0.0.1:{port} is not running"):
            first.check()

    asyncio.run(main())


def test_an_idle_keep_alive_connection_stays_open_as_through_serves_proxy():
    """uvicorn alone closes a connection idle for 5 s; Serve's proxy keeps it 90 s, and so does direct ingress
    (a load balancer or a client pool reusing it after 6 s gets an answer, not a closed socket)."""
    port = free_port()
    request = b"GET / HTTP/1.1\r\nHost: x\r\nConnection: keep-alive\r\n\r\n"

    async def ask(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bytes:
        writer.write(request)
        await writer.drain()
        return await asyncio.wait_for(reader.readuntil(b"\r\n0\r\n\r\n"), timeout=10)  # the chunked body's end

    async def main():
        server = DirectIngressServer(named(b"alive"), "127.0.0.1", port, "app A")
        await server.start()
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            assert b"\r\nalive\r\n" in await ask(reader, writer)
            await asyncio.sleep(6)
            assert b"\r\nalive\r\n" in await ask(reader, writer)  # the same connection, idle for 6 s
            writer.close()
        finally:
            await server.stop()

    asyncio.run(main())


def test_another_app_cannot_share_the_port():
    port = free_port()

    async def main():
        first = DirectIngressServer(named(b"first"), "127.0.0.1", port, "app A")
        await first.start()
        try:
            with pytest.raises(OSError, match=rf"cannot listen on 127.0.0.1:{port}: the port is taken \(by app A, "
                                              r"not app B\)"):
                await DirectIngressServer(named(b"other"), "127.0.0.1", port, "app B").start()
            async with httpx.AsyncClient(trust_env=False) as client:  # the first one still has every connection
                assert {(await client.get(f"http://127.0.0.1:{port}/")).text for _ in range(8)} == {"first"}
        finally:
            await first.stop()

    asyncio.run(main())


def test_a_port_another_program_holds_is_named():
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    try:
        with pytest.raises(OSError, match=rf"cannot listen on 127.0.0.1:{port}: .*another program, not app A"):
            asyncio.run(DirectIngressServer(named(b"x"), "127.0.0.1", port, "app A").start())
    finally:
        taken.close()


@pytest.mark.parametrize("writer_alive", [True, False])
def test_a_port_record_names_its_app_only_while_the_process_that_wrote_it_lives(writer_alive):
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    owner_file(port).write_text(f"app B\t{os.getpid() if writer_alive else int(gone.stdout)}")
    expected = "app B" if writer_alive else "another program"  # a killed server's record names nobody now
    try:
        with pytest.raises(OSError, match=rf"cannot listen on 127.0.0.1:{port}: .*by {expected}, not app A"):
            asyncio.run(DirectIngressServer(named(b"x"), "127.0.0.1", port, "app A").start())
    finally:
        taken.close()
        owner_file(port).unlink()


def test_direct_ingress_is_on_where_one_replica_answers_http_and_bad_ports_are_refused(monkeypatch, capsys):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    parser = build_parser()
    args = parser.parse_args(["serve", "--direct-ingress", "--port", "8123", "--host", "0.0.0.0"])
    settings = app_args(args)
    assert (settings.direct_ingress_port, settings.direct_ingress_host) == (8123, "0.0.0.0")
    default = ["serve", "--port", "8123"]
    assert app_args(parser.parse_args(default)).direct_ingress_port == 8123  # one ingress replica: on by default
    assert app_args(parser.parse_args(default + ["--no-direct-ingress"])).direct_ingress_port is None
    colocated = default + ["--engine-placement", "colocated"]
    assert app_args(parser.parse_args(colocated)).direct_ingress_port == 8123
    assert app_args(parser.parse_args(colocated + ["--replicas", "2"])).direct_ingress_port is None  # the proxy
    assert app_args(parser.parse_args(colocated + ["--replicas", "2", "--direct-ingress"])).direct_ingress_port == 8123
    with pytest.raises(ValueError, match="direct_ingress_port: Input should be less than or equal to 65535"):
        validate_args({"direct_ingress_port": 70000})
    assert cli_main(["bench", "serve", "--direct-ingress", "--url", "http://127.0.0.1:8000"]) == 2
    assert "with --url, start that server with `dsa-serve serve --direct-ingress`" in capsys.readouterr().err


def listener_pid(port: int, pids: list[int]) -> int | None:
    """Which of `pids` holds the socket listening on 127.0.0.1:`port` (from /proc/net/tcp and the fds)."""
    inode = None
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        if fields[1].endswith(f":{port:04X}") and fields[3] == "0A":  # 0A = LISTEN
            inode = fields[9]
    for pid in pids:
        try:
            links = [p.readlink() for p in Path(f"/proc/{pid}/fd").iterdir()]
        except OSError:
            continue
        if any(str(link) == f"socket:[{inode}]" for link in links):
            return pid
    return None


def test_the_http_replica_answers_on_port_and_stops_on_ctrl_c(tmp_path):
    port, log_path = free_port(), tmp_path / "serve.log"
    process = start_server(["--direct-ingress"], log_path, port)
    base_url = f"http://127.0.0.1:{port}"
    try:
        wait_until_ready(process, base_url, log_path)
        replicas = descendant_pids(process.pid, b"ServeReplica")
        assert listener_pid(port, replicas) is not None  # the replica's own server, not the proxy
        assert wait_for_log(log_path, "Serve's proxy on port")  # printed once serve.run returns, maybe later
        proxy = int(re.search(r"direct ingress; Serve's proxy on port (\d+)", log_path.read_text()).group(1))
        assert proxy != port and listener_pid(proxy, descendant_pids(process.pid, b"ProxyActor")) is not None
        client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="none", max_retries=0, timeout=120)
        whole = client.completions.create(model="default_model", prompt="def main():", max_tokens=8, temperature=0)
        streamed = client.completions.create(model="default_model", prompt="def main():", max_tokens=8,
                                             temperature=0, stream=True)
        assert "".join(chunk.choices[0].text for chunk in streamed if chunk.choices) == whole.choices[0].text
        bad = httpx.post(f"{base_url}/v1/completions", json={"model": "default_model", "prompt": "x",
                                                             "max_tokens": -1})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "max_tokens"
        traced = httpx.get(f"{base_url}/v1/models", headers={"X-Request-Id": "trace-7"})
        assert traced.headers["x-request-id"] == "trace-7"  # set by the app: no Serve proxy on this path
    finally:
        stop_with_ctrl_c(process, log_path)


class SlowEngine(FakeEngine):
    """FakeEngine whose chunks come 100 ms apart: a stream outlasts uvicorn's own 1 s of graceful shutdown."""

    async def generate(self, request):
        async for chunk in super().generate(request):
            await asyncio.sleep(0.1)
            yield chunk


@pytest.mark.parametrize("deployment", [DSAServer, DSAIngress])
def test_a_replica_serve_stops_finishes_its_direct_ingress_streams_and_refuses_new_connections(tmp_path, deployment):
    port, tokens = free_port(), 20
    args = ServeAppArgs(direct_ingress_port=port, direct_ingress_host="127.0.0.1")
    # The class Serve runs: @serve.ingress's wrapper, whose own __del__ is what Serve calls and awaits on stop (it
    # awaits the class's __del__ only when that is a coroutine function). No __init__: Serve's needs a running app.
    replica = object.__new__(deployment.func_or_class)
    replica.args = args

    async def stream(http: httpx.AsyncClient, started: asyncio.Event) -> list[str]:
        body = {"prompt": "hello world", "max_tokens": tokens, "stream": True}
        async with http.stream("POST", "/v1/completions", json=body) as response:
            lines = []
            async for line in response.aiter_lines():
                started.set()
                lines.append(line)
            return [line for line in lines if line.startswith("data: ")]

    async def main():
        settings = IngressSettings(model_dir=str(write_checkpoint_files(tmp_path)))
        await replica.serve_app(build_app(SlowEngine(), settings))
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=30, trust_env=False) as http:
            started = asyncio.Event()
            running = asyncio.create_task(stream(http, started))
            await started.wait()
            stopping = asyncio.ensure_future(replica.__del__())  # Serve awaits it when it stops the replica
            await asyncio.sleep(0.05)
            with pytest.raises(httpx.ConnectError):  # the listener is closed: new connections go elsewhere
                async with httpx.AsyncClient(trust_env=False) as fresh:
                    await fresh.get(f"http://127.0.0.1:{port}/health")
            assert not stopping.done()  # it waits for the stream in flight
            events = await running
            await asyncio.wait_for(stopping, 30)
        assert events[-1] == "data: [DONE]" and len(events) == tokens + 1
        await asyncio.wait_for(replica.__del__(), 1)  # stopped once; a later call has nothing left to do
        assert replica.direct is None

    asyncio.run(main())
