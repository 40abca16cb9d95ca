"""`dsa-serve serve --direct-ingress`: the HTTP replica itself listens on --port (no Serve proxy hop), the flag
combinations it cannot serve are refused by name, and the server answers and stops like the default one."""

from __future__ import annotations

import re
from pathlib import Path

import httpx
import openai
import pytest

from cluster.cli import main as cli_main
from cluster.direct_ingress import check_direct_ingress, direct_ingress_env
from support.serve_process import (descendant_pids, free_port, start_server, stop_with_ctrl_c, wait_for_log,
                                   wait_until_ready)


def test_the_replica_port_range_is_the_one_port():
    env = direct_ingress_env(8123)
    assert env["RAY_SERVE_ENABLE_DIRECT_INGRESS"] == "1"
    low, high = int(env["RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT"]), int(env["RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT"])
    assert list(range(low, high)) == [8123]  # Serve hands out ports from range(min, max)
    assert env["RAY_SERVE_PORT_QUARANTINE_S"] == "0"  # a restarted replica takes the same port again


def test_flag_combinations_it_cannot_serve_are_refused(monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    check_direct_ingress(None, "separate", 4)  # more engines behind one HTTP replica: fine
    check_direct_ingress(None, "colocated", 1)
    with pytest.raises(ValueError, match=r"--replicas must be 1 \(got 2\)"):
        check_direct_ingress(None, "colocated", 2)
    with pytest.raises(ValueError, match="--ray-address / RAY_ADDRESS.*RAY_SERVE_ENABLE_DIRECT_INGRESS=1"):
        check_direct_ingress("ray://head:10001", "separate", 1)
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.1:6379")
    with pytest.raises(ValueError, match="10.0.0.1:6379"):
        check_direct_ingress(None, "separate", 1)


def test_serve_and_bench_flags_are_checked_before_anything_starts(monkeypatch, capsys):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    assert cli_main(["serve", "--direct-ingress", "--engine-placement", "colocated", "--replicas", "2"]) == 2
    assert "--replicas must be 1 (got 2)" in capsys.readouterr().err
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
    finally:
        stop_with_ctrl_c(process, log_path)
