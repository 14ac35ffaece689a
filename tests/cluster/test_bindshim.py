"""The bind shim (kvfleet/cluster/bindshim.c): a server binding 0.0.0.0 listens on its pod's address only.

Compiled with the system C compiler as the kubelet compiles it; each "pod" here is a plain process
with ``LD_PRELOAD`` and ``KVFLEET_POD_IP`` set, as the process node starts containers.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvfleet.cluster.processes import build_shim
from kvfleet.oslib import free_port

pytestmark = pytest.mark.skipif(
    shutil.which("cc") is None and shutil.which("gcc") is None, reason="no C compiler"
)

SERVER = """
import os, socket, sys
family = socket.AF_INET6 if sys.argv[2] == "6" else socket.AF_INET
s = socket.socket(family)
if family == socket.AF_INET6:
    s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
s.bind(("::" if family == socket.AF_INET6 else "0.0.0.0", int(sys.argv[1])))
s.listen()
while True:
    c, _ = s.accept()
    c.sendall(os.environ["KVFLEET_POD_IP"].encode())
    c.close()
"""


@pytest.fixture(scope="module")
def shim(tmp_path_factory: pytest.TempPathFactory) -> str:
    return build_shim(tmp_path_factory.mktemp("node"))


def ask(host: str, port: int, timeout: float = 10.0) -> str:
    """What the server at host:port says, retried (bounded) while it starts."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            with socket.create_connection((host, port), timeout=1.0) as conn:
                return conn.recv(100).decode()
        except ConnectionRefusedError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


@pytest.fixture
def pods(shim: str) -> Iterator[list[subprocess.Popen[bytes]]]:
    started: list[subprocess.Popen[bytes]] = []
    yield started
    for proc in started:
        proc.kill()
        proc.wait(10)


def start_pod(
    pods: list[subprocess.Popen[bytes]], shim: str, ip: str, port: int, family: str = "4"
) -> subprocess.Popen[bytes]:
    env = {**os.environ, "LD_PRELOAD": shim, "KVFLEET_POD_IP": ip}
    proc = subprocess.Popen(
        [sys.executable, "-c", SERVER, str(port), family], env=env, stderr=subprocess.PIPE
    )
    pods.append(proc)
    return proc


def test_two_pods_binding_all_addresses_on_one_port_both_start_each_on_its_own_address(
    shim: str, pods: list[subprocess.Popen[bytes]]
) -> None:
    port = free_port()
    start_pod(pods, shim, "127.1.0.2", port)
    start_pod(pods, shim, "127.1.0.3", port)
    assert ask("127.1.0.2", port) == "127.1.0.2"
    assert ask("127.1.0.3", port) == "127.1.0.3"
    assert all(p.poll() is None for p in pods)  # neither died of EADDRINUSE
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", port), timeout=1.0).close()


def test_a_dual_stack_listener_on_all_addresses_takes_ipv4_on_its_pod_address_only(
    shim: str, pods: list[subprocess.Popen[bytes]]
) -> None:
    try:
        socket.socket(socket.AF_INET6).close()
    except OSError:
        pytest.skip("no IPv6 on this machine")
    port = free_port()
    start_pod(pods, shim, "127.1.0.4", port, family="6")
    start_pod(pods, shim, "127.1.0.5", port, family="6")
    assert (ask("127.1.0.4", port), ask("127.1.0.5", port)) == ("127.1.0.4", "127.1.0.5")
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", port), timeout=1.0).close()


def test_python_http_server_bound_to_all_addresses_serves_on_the_pod_address(
    shim: str, pods: list[subprocess.Popen[bytes]], tmp_path: Path
) -> None:
    port = free_port()
    env = {**os.environ, "LD_PRELOAD": shim, "KVFLEET_POD_IP": "127.1.0.6"}
    argv = [sys.executable, "-m", "http.server", str(port), "--bind", "0.0.0.0"]
    pods.append(
        subprocess.Popen(argv, env=env, cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    )
    deadline = time.monotonic() + 10
    while True:
        try:
            with socket.create_connection(("127.1.0.6", port), timeout=1.0) as conn:
                conn.sendall(b"GET / HTTP/1.0\r\n\r\n")
                assert conn.recv(12).startswith(b"HTTP/1.0 200")
                break
        except ConnectionRefusedError:
            assert time.monotonic() < deadline
            time.sleep(0.05)


def test_the_shim_is_built_once_per_source(tmp_path: Path) -> None:
    first = build_shim(tmp_path)
    mtime = Path(first).stat().st_mtime_ns
    assert build_shim(tmp_path) == first and Path(first).stat().st_mtime_ns == mtime
    (tmp_path / "bindshim.so.sha256").write_text("other source\n")
    build_shim(tmp_path)
    assert (tmp_path / "bindshim.so.sha256").read_text().strip() != "other source"
