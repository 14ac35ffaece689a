"""One pod's worker (kvfleet/cluster/podworker.py) against an in-memory API: real processes, no cluster.

What the worker sends (status patches, the final DELETE) is read from the fake API's record.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvfleet.cluster.podspec import NodeSettings
from kvfleet.cluster.podworker import NodeContext, PodWorker

from .fake_api import FakeApi, secret

NS = "/api/v1/namespaces/team"
SLEEPER = (
    "import os, time; print('hello', os.environ['GREETING'], os.environ['POD'], flush=True); time.sleep(60)"
)


def wait_for(what: Callable[[], object], timeout: float = 20.0) -> Any:
    deadline = time.monotonic() + timeout
    while not (value := what()):
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)
    return value


def a_pod(containers: list[dict[str, Any]], **spec: Any) -> dict[str, Any]:
    meta = {"name": "web-1", "namespace": "team", "uid": "u-1"}
    return {
        "metadata": meta,
        "spec": {"containers": containers, "terminationGracePeriodSeconds": 5, **spec},
        "status": {},
    }


@pytest.fixture
def node(tmp_path: Path) -> NodeContext:
    fake = FakeApi({f"{NS}/secrets/greeting": secret({"word": "world"}), f"{NS}/serviceaccounts/default": {}})
    settings = NodeSettings(bin_dir=str(Path(sys.executable).parent))
    return NodeContext(fake, "kvfleet-process", "127.0.0.1", tmp_path, settings)  # type: ignore[arg-type]


@pytest.fixture
def workers() -> Iterator[list[PodWorker]]:
    started: list[PodWorker] = []
    yield started
    for worker in started:
        worker.stop(cleanup=True)
        worker.thread.join(15)


def start(node: NodeContext, workers: list[PodWorker], pod: dict[str, Any]) -> tuple[PodWorker, list[str]]:
    exited: list[str] = []
    worker = PodWorker(node, pod, "127.1.0.9", exited.append)
    workers.append(worker)
    worker.start()
    return worker, exited


def last_status(node: NodeContext) -> dict[str, Any]:
    statuses = node.api.statuses()  # type: ignore[attr-defined]
    return statuses[-1] if statuses else {}


def test_a_pod_runs_its_init_container_then_its_container_with_env_and_a_kubeconfig(
    node: NodeContext, workers: list[PodWorker]
) -> None:
    env = [
        {"name": "GREETING", "valueFrom": {"secretKeyRef": {"name": "greeting", "key": "word"}}},
        {"name": "POD", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
    ]
    init = [{"name": "init", "image": "i", "command": ["python", "-c", "print('init ran')"]}]
    worker, _ = start(
        node,
        workers,
        a_pod(
            [{"name": "app", "image": "app:1", "command": ["python", "-c", SLEEPER], "env": env}],
            initContainers=init,
        ),
    )
    wait_for(lambda: last_status(node).get("phase") == "Running")
    status = last_status(node)
    assert (
        status["podIP"] == "127.1.0.9"
        and status["initContainerStatuses"][0]["state"]["terminated"]["exitCode"] == 0
    )
    assert {c["type"]: c["status"] for c in status["conditions"]}["Ready"] == "True"
    log = worker.pod_dir / "app.log"
    assert wait_for(lambda: log.exists() and "hello world 127.1.0.9" in log.read_text())
    assert "init ran" in (worker.pod_dir / "init.log").read_text()
    kubeconfig = yaml.safe_load((worker.pod_dir / "kubeconfig").read_text())
    assert (
        kubeconfig["users"][0]["user"]["token"] == "token-1"
        and kubeconfig["clusters"][0]["cluster"]["server"] == FakeApi.server
    )
    writes = len(node.api.statuses())  # type: ignore[attr-defined]
    time.sleep(1.0)
    assert len(node.api.statuses()) == writes  # type: ignore[attr-defined]  # nothing changed: nothing written


def test_a_deletion_stops_the_processes_gracefully_then_deletes_the_pod_with_a_uid_precondition(
    node: NodeContext, workers: list[PodWorker]
) -> None:
    code = "import signal, sys, time; signal.signal(signal.SIGTERM, lambda *a: (print('bye', flush=True), sys.exit(0))); print('up', flush=True); time.sleep(60)"
    pod = a_pod(
        [
            {
                "name": "app",
                "image": "app:1",
                "command": ["python", "-c", code],
                "lifecycle": {"preStop": {"exec": {"command": ["sh", "-c", "echo prestop >> $HOME/hook"]}}},
            }
        ]
    )
    worker, exited = start(node, workers, pod)
    log = worker.pod_dir / "app.log"
    wait_for(lambda: log.exists() and "up" in log.read_text())
    pid = int(last_status(node)["containerStatuses"][0]["containerID"].removeprefix("process://"))
    worker.update(
        {**pod, "metadata": {**pod["metadata"], "deletionTimestamp": "now", "deletionGracePeriodSeconds": 5}}
    )
    wait_for(lambda: exited)
    assert "bye" in log.read_text() and (worker.pod_dir / "home" / "hook").read_text() == "prestop\n"
    assert not Path(f"/proc/{pid}").exists()
    final = last_status(node)
    assert (
        final["phase"] == "Succeeded"
        and final["containerStatuses"][0]["state"]["terminated"]["exitCode"] == 0
    )
    verb, path, body = node.api.writes[-1]  # type: ignore[attr-defined]
    assert (verb, path) == ("DELETE", f"{NS}/pods/web-1") and body == {
        "apiVersion": "v1",
        "kind": "DeleteOptions",
        "gracePeriodSeconds": 0,
        "preconditions": {"uid": "u-1"},
    }


def test_a_container_that_exits_is_restarted_and_a_missing_secret_waits_as_a_config_error(
    node: NodeContext, workers: list[PodWorker]
) -> None:
    missing = [{"name": "X", "valueFrom": {"secretKeyRef": {"name": "absent", "key": "k"}}}]
    containers = [
        {"name": "flaky", "image": "f", "command": ["python", "-c", "raise SystemExit(1)"]},
        {"name": "blocked", "image": "b", "command": ["python", "-c", "pass"], "env": missing},
    ]
    start(node, workers, a_pod(containers))

    def flaky_restarted() -> bool:
        statuses = {c["name"]: c for c in last_status(node).get("containerStatuses", [])}
        return statuses.get("flaky", {}).get("restartCount", 0) >= 1

    wait_for(flaky_restarted)
    blocked = {c["name"]: c for c in last_status(node)["containerStatuses"]}["blocked"]
    assert (
        blocked["state"]["waiting"]["reason"] == "CreateContainerConfigError"
        and "absent" in blocked["state"]["waiting"]["message"]
    )
    assert last_status(node)["phase"] == "Pending"


def test_stop_kills_the_processes_and_writes_nothing_more(
    node: NodeContext, workers: list[PodWorker]
) -> None:
    worker, exited = start(node, workers, a_pod([{"name": "app", "image": "a", "command": ["sleep", "60"]}]))
    wait_for(lambda: last_status(node).get("phase") == "Running")
    pid = int(last_status(node)["containerStatuses"][0]["containerID"].removeprefix("process://"))
    writes = len(node.api.writes)  # type: ignore[attr-defined]
    worker.stop(cleanup=True)
    wait_for(lambda: exited)
    assert not Path(f"/proc/{pid}").exists() and len(node.api.writes) == writes  # type: ignore[attr-defined]
    assert not (worker.pod_dir / "kubeconfig").exists() and (worker.pod_dir / "app.log").exists()
