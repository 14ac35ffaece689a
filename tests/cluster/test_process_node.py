"""The process node against a real control plane (issue #43): etcd, kube-apiserver, kube-controller-manager
and kube-scheduler built from their Go modules (kvfleet/cluster/controlplane.py), our kubelet
(kvfleet/cluster/kubelet.py) in a subprocess. The real scheduler binds the pods, the real ReplicaSet
controller and garbage collector create and delete them; the kubelet runs them as local processes.

Skipped only when the binaries are not built (``bash kvfleet/cluster/build.sh``: minutes, once).
"""

from __future__ import annotations

import ipaddress
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvfleet.cluster import binaries, controlplane
from kvfleet.cluster.apiclient import Api, ApiError

pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]
NODE = "kvfleet-process"
NS = "/api/v1/namespaces/default"
APPS = "/apis/apps/v1/namespaces/default"
WAIT_S = 60.0
SERVER = "env > env.txt && exec python -m http.server 8000 --bind 0.0.0.0"


@dataclass
class ProcessNode:
    api: Api
    state: Path
    kubelet: subprocess.Popen[bytes]
    log: Path

    def stop(self) -> None:
        if self.kubelet.poll() is None:
            self.kubelet.send_signal(signal.SIGTERM)
            try:
                self.kubelet.wait(30)
            except subprocess.TimeoutExpired:
                self.kubelet.kill()
                self.kubelet.wait(10)


def wait_for(what: Callable[[], Any], message: str, timeout: float = WAIT_S) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        try:
            value = what()
        except (ApiError, httpx.HTTPError):
            value = None
        if value:
            return value
        assert time.monotonic() < deadline, f"not within {timeout:.0f} s: {message}"
        time.sleep(0.5)


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ProcessNode]:
    if shutil.which("go") is None and binaries.built() is None:
        pytest.skip("Go (>= 1.26) is needed to build the control plane's binaries: docs/cluster.md")
    cp = controlplane.start(tmp_path_factory.mktemp("controlplane"))
    state = tmp_path_factory.mktemp("node")
    log = state / "kubelet.log"
    argv = [sys.executable, "-m", "kvfleet.cluster.kubelet", "--kubeconfig", str(cp.kubeconfig)]
    argv += ["--node-name", NODE, "--state-dir", str(state), "--bin-dir", str(Path(sys.executable).parent)]
    process_node: ProcessNode | None = None
    try:
        with log.open("ab") as out:
            kubelet = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        process_node = ProcessNode(Api(str(cp.kubeconfig)), state, kubelet, log)
        yield process_node
    finally:
        if process_node is not None:
            process_node.stop()
            process_node.api.close()
        cp.stop()


def pods(api: Api, selector: str) -> list[dict[str, Any]]:
    return list(api.request("GET", f"{NS}/pods", labelSelector=selector)["items"])


def ready(pod: dict[str, Any]) -> bool:
    return any(c["type"] == "Ready" and c["status"] == "True" for c in pod["status"].get("conditions") or [])


def pid_of(status: dict[str, Any]) -> int:
    return int(status["containerID"].removeprefix("process://"))


def process_gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return True
    return state == "Z"


def test_the_node_registers_ready_untainted_with_its_labels_and_renews_its_lease(node: ProcessNode) -> None:
    def ready_node() -> dict[str, Any] | None:
        obj = node.api.get(f"/api/v1/nodes/{NODE}")
        ok = obj and any(
            c["type"] == "Ready" and c["status"] == "True" for c in obj["status"].get("conditions") or []
        )
        return obj if ok and not obj["spec"].get("taints") else None

    obj = wait_for(ready_node, "the node Ready without taints")
    assert (
        obj["metadata"]["labels"]["kvfleet.dev/process-node"] == "true"
        and obj["metadata"]["labels"]["type"] == "process"
    )
    lease_path = f"/apis/coordination.k8s.io/v1/namespaces/kube-node-lease/leases/{NODE}"
    first = wait_for(lambda: node.api.get(lease_path), "the node's lease")["spec"]["renewTime"]
    wait_for(lambda: node.api.get(lease_path)["spec"]["renewTime"] != first, "a lease renewal", timeout=30)


def test_a_deployment_of_two_replicas_runs_ready_on_two_loopback_addresses_with_its_env(
    node: ProcessNode,
) -> None:
    api = node.api
    api.create(f"{NS}/secrets", {"metadata": {"name": "words"}, "stringData": {"word": "sekrit"}})
    api.create(f"{NS}/configmaps", {"metadata": {"name": "colors"}, "data": {"color": "blue"}})
    env = [
        {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {"name": "WORD", "valueFrom": {"secretKeyRef": {"name": "words", "key": "word"}}},
        {"name": "COLOR", "valueFrom": {"configMapKeyRef": {"name": "colors", "key": "color"}}},
    ]
    container = {
        "name": "web",
        "image": "python:3.11",
        "command": ["sh", "-c", SERVER],
        "ports": [{"name": "http", "containerPort": 8000}],
        "env": env,
        "readinessProbe": {"httpGet": {"path": "/", "port": "http"}, "periodSeconds": 1},
    }
    template = {
        "metadata": {"labels": {"app": "web"}},
        "spec": {"containers": [container], "terminationGracePeriodSeconds": 5},
    }
    spec = {"replicas": 2, "selector": {"matchLabels": {"app": "web"}}, "template": template}
    api.create(
        f"{APPS}/deployments",
        {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "web"}, "spec": spec},
    )

    def both_ready() -> list[dict[str, Any]] | None:
        items = pods(api, "app=web")
        return items if len(items) == 2 and all(ready(p) for p in items) else None

    running = wait_for(both_ready, "both replicas Running and Ready")
    ips = {p["status"]["podIP"] for p in running}
    assert len(ips) == 2 and all(
        ipaddress.IPv4Address(ip) in ipaddress.IPv4Network("127.1.0.0/16") for ip in ips
    )
    for pod in running:
        assert pod["spec"]["nodeName"] == NODE and pod["status"]["phase"] == "Running"
        ip = pod["status"]["podIP"]
        env_txt = httpx.get(f"http://{ip}:8000/env.txt", trust_env=False, timeout=5).text
        assert f"POD_NAME={pod['metadata']['name']}\n" in env_txt and f"KVFLEET_POD_IP={ip}\n" in env_txt
        assert "WORD=sekrit\n" in env_txt and "COLOR=blue\n" in env_txt
        kubeconfig = next(
            line.split("=", 1)[1] for line in env_txt.splitlines() if line.startswith("KUBECONFIG=")
        )
        review = Api(kubeconfig).create(
            "/apis/authentication.k8s.io/v1/selfsubjectreviews",
            {"apiVersion": "authentication.k8s.io/v1", "kind": "SelfSubjectReview"},
        )
        assert review["status"]["userInfo"]["username"] == "system:serviceaccount:default:default"
    with pytest.raises(httpx.ConnectError):
        httpx.get("http://127.0.0.1:8000/", trust_env=False, timeout=5)


def test_a_container_that_exits_is_restarted_and_counted(node: ProcessNode) -> None:
    command = "if [ -e ran ]; then exec sleep 3600; fi; touch ran; exit 3"
    pod = {
        "metadata": {"name": "flaky", "labels": {"app": "flaky"}},
        "spec": {"containers": [{"name": "c", "image": "busybox", "command": ["sh", "-c", command]}]},
    }
    node.api.create(f"{NS}/pods", pod)

    def restarted() -> dict[str, Any] | None:
        status = (node.api.get(f"{NS}/pods/flaky") or {}).get("status", {}).get("containerStatuses") or [{}]
        return (
            status[0]
            if status[0].get("restartCount") == 1 and "running" in status[0].get("state", {})
            else None
        )

    status = wait_for(restarted, "the container restarted once and running")
    assert status["lastState"]["terminated"]["exitCode"] == 3 and status["ready"]


def test_deleting_the_deployment_leaves_no_process_behind(node: ProcessNode) -> None:
    api = node.api
    pids = [pid_of(s) for p in pods(api, "app=web") for s in p["status"]["containerStatuses"]]
    assert len(pids) == 2 and not any(process_gone(pid) for pid in pids)
    api.delete(
        f"{APPS}/deployments/web",
        {"apiVersion": "v1", "kind": "DeleteOptions", "propagationPolicy": "Background"},
    )
    wait_for(
        lambda: not pods(api, "app=web") and not api.request("GET", f"{APPS}/replicasets")["items"],
        "the ReplicaSet and pods deleted",
    )
    wait_for(lambda: all(process_gone(pid) for pid in pids), "the pods' processes gone", timeout=10)


def test_stopping_the_kubelet_stops_every_process_it_started(node: ProcessNode) -> None:
    status = node.api.get(f"{NS}/pods/flaky")["status"]["containerStatuses"][0]  # type: ignore[index]
    pid = pid_of(status)
    assert not process_gone(pid)
    node.stop()
    assert node.kubelet.returncode == 0, node.log.read_text()[-3000:]
    wait_for(lambda: process_gone(pid), "the pod's process gone with the kubelet", timeout=10)
