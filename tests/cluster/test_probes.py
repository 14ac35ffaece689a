"""Probes of the process node (kvfleet/cluster/probes.py): thresholds, and each action against a real peer."""

from __future__ import annotations

import http.server
import os
import socketserver
import threading
from collections.abc import Iterator

import pytest

from kvfleet.cluster.probes import Probe, Target, check


def test_a_probe_waits_its_initial_delay_then_runs_every_period() -> None:
    probe = Probe.from_spec({"initialDelaySeconds": 5, "periodSeconds": 2}, started_at=100.0)
    assert (probe.due(104.9), probe.due(105.0)) == (False, True)
    probe.record(True, 105.0)
    assert (probe.due(106.9), probe.due(107.0)) == (False, True)
    assert (probe.timeout, probe.failure_threshold, probe.success_threshold) == (1.0, 3, 1)


def test_a_result_flips_only_after_its_threshold_of_consecutive_results() -> None:
    probe = Probe.from_spec({"failureThreshold": 2, "successThreshold": 2}, started_at=0.0)
    assert probe.result is None
    probe.record(True, 0)
    assert probe.result is None
    probe.record(True, 0)
    assert probe.result is True
    probe.record(False, 0)
    assert probe.result is True  # one failure is not enough
    probe.record(True, 0)
    probe.record(False, 0)
    assert probe.result is True  # the success in between reset the run
    probe.record(False, 0)
    assert probe.result is False


class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        code = {
            "/ok": 200,
            "/moved": 302,
            "/header": 200 if self.headers.get("X-Probe") == "yes" else 401,
        }.get(self.path, 500)
        self.send_response(code)
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture(scope="module")
def server() -> Iterator[int]:
    httpd = socketserver.ThreadingTCPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield int(httpd.server_address[1])
    httpd.shutdown()
    httpd.server_close()


def target(port: int) -> Target:
    container = {"name": "c", "ports": [{"name": "http", "containerPort": port}]}
    return Target(
        pod_ip="127.0.0.1", container=container, env={"PATH": os.environ["PATH"], "WANT": "7"}, cwd="/"
    )


def test_http_get_succeeds_on_2xx_and_3xx_and_finds_a_named_port(server: int) -> None:
    t = target(server)
    assert check({"httpGet": {"path": "/ok", "port": "http"}}, t, 1.0)
    assert check({"httpGet": {"path": "/moved", "port": server}}, t, 1.0)
    assert not check({"httpGet": {"path": "/broken", "port": server}}, t, 1.0)
    assert not check({"httpGet": {"path": "/header", "port": server}}, t, 1.0)
    assert check(
        {
            "httpGet": {
                "path": "/header",
                "port": server,
                "httpHeaders": [{"name": "X-Probe", "value": "yes"}],
            }
        },
        t,
        1.0,
    )
    assert not check({"httpGet": {"path": "/ok", "port": "metrics"}}, t, 1.0)  # no such port: a failure


def test_tcp_socket_succeeds_on_a_listener_and_fails_on_a_refusal(server: int) -> None:
    assert check({"tcpSocket": {"port": server}}, target(server), 1.0)
    assert not check({"tcpSocket": {"port": 1}}, target(server), 1.0)


def test_exec_runs_in_the_container_environment_and_a_timeout_is_a_failure(server: int) -> None:
    t = target(server)
    assert check({"exec": {"command": ["sh", "-c", 'test "$WANT" = 7']}}, t, 5.0)
    assert not check({"exec": {"command": ["sh", "-c", "exit 1"]}}, t, 5.0)
    assert not check({"exec": {"command": ["sleep", "5"]}}, t, 0.2)
    assert not check({"exec": {"command": ["/no/such/program"]}}, t, 1.0)
