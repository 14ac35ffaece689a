"""The process node's kubelet (kvfleet/cluster/kubelet.py) without a cluster: addresses, the node's
status, and how listed and watched pods become, stay or stop being pod workers (an in-memory API)."""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvfleet.cluster.kubelet import AddressPool, Kubelet, _path_map, node_object, node_status
from kvfleet.cluster.podspec import NodeSettings
from kvfleet.cluster.podworker import NodeContext

from .fake_api import FakeWatchApi


def test_each_pod_gets_the_lowest_free_loopback_address_and_a_freed_one_is_reused() -> None:
    pool = AddressPool()
    assert [pool.take() for _ in range(3)] == ["127.1.0.2", "127.1.0.3", "127.1.0.4"]
    pool.give("127.1.0.3")
    assert pool.take() == "127.1.0.3" and pool.take() == "127.1.0.5"
    assert [AddressPool().take() for _ in range(1)] == ["127.1.0.2"]
    many = AddressPool()
    assert [many.take() for _ in range(300)][-1] == "127.1.1.45"  # past .255 into the next octet


def test_the_node_is_labelled_for_the_process_node_and_reports_ready_with_generous_capacity() -> None:
    labels = node_object("kvfleet-process")["metadata"]["labels"]
    assert (
        labels["kvfleet.dev/process-node"] == "true"
        and labels["type"] == "process"
        and labels["kubernetes.io/hostname"] == "kvfleet-process"
    )
    status = node_status("kvfleet-process", "127.0.0.1", "t0", "v1.37.2")["status"]
    assert (
        status["capacity"]["cpu"] == str((os.cpu_count() or 1) * 8) and status["allocatable"]["pods"] == "110"
    )
    ready = {c["type"]: c for c in status["conditions"]}["Ready"]
    assert ready["status"] == "True" and ready["lastTransitionTime"] == "t0" and ready["lastHeartbeatTime"]
    assert (
        status["addresses"][0] == {"type": "InternalIP", "address": "127.0.0.1"}
        and status["nodeInfo"]["kubeletVersion"] == "v1.37.2"
    )


def test_a_path_map_entry_is_a_container_path_equals_a_local_one() -> None:
    assert _path_map(["/opt/kvfleet/models/=relative"]) == {
        "/opt/kvfleet/models": str(Path("relative").resolve())
    }
    with pytest.raises(SystemExit):
        _path_map(["models=/x"])


def a_pod(uid: str, phase: str = "Pending", **meta: Any) -> dict[str, Any]:
    container = {"name": "c", "image": "i", "command": ["sleep", "60"]}
    metadata = {"name": f"pod-{uid}", "namespace": "default", "uid": uid, "resourceVersion": "1", **meta}
    return {
        "metadata": metadata,
        "spec": {"containers": [container], "automountServiceAccountToken": False},
        "status": {"phase": phase},
    }


@pytest.fixture
def kubelet(tmp_path: Path) -> Iterator[Kubelet]:
    api = FakeWatchApi()
    node = Kubelet(
        "unused", "kvfleet-process", tmp_path, python_bin_dir=str(Path(sys.executable).parent), api=api
    )  # type: ignore[arg-type]
    node.context = NodeContext(
        api, "kvfleet-process", "127.0.0.1", tmp_path, NodeSettings(bin_dir=str(Path(sys.executable).parent))
    )  # type: ignore[arg-type]
    yield node
    node._shutdown()


def wait_for(what: Any, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while not what():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_a_list_starts_live_pods_only_and_finishes_the_deletion_of_a_terminating_one_it_never_ran(
    kubelet: Kubelet,
) -> None:
    api: FakeWatchApi = kubelet.api  # type: ignore[assignment]
    kubelet._sync_all([a_pod("a"), a_pod("done", "Succeeded"), a_pod("t", deletionTimestamp="now")])
    assert list(kubelet._workers) == ["a"] and kubelet._workers["a"].pod_ip == "127.1.0.2"
    verb, path, body = next(w for w in api.writes if w[0] == "DELETE")
    assert (verb, path) == ("DELETE", "/api/v1/namespaces/default/pods/pod-t") and body is not None
    assert body["gracePeriodSeconds"] == 0 and body["preconditions"] == {"uid": "t"}


def test_a_pod_missing_from_a_relist_is_stopped_and_its_address_freed(kubelet: Kubelet) -> None:
    kubelet._sync_all([a_pod("a"), a_pod("b")])
    worker = kubelet._workers["a"]
    wait_for(lambda: worker.containers[0].running)
    pid = worker.containers[0].proc.pid  # type: ignore[union-attr]
    kubelet._sync_all([a_pod("b")])  # "a" was deleted while the watch was down
    wait_for(lambda: "a" not in kubelet._workers)
    assert not Path(f"/proc/{pid}").exists() and kubelet.pool.take() == "127.1.0.2"


def test_a_watch_applies_events_in_order_and_an_error_event_asks_for_a_relist(kubelet: Kubelet) -> None:
    api: FakeWatchApi = kubelet.api  # type: ignore[assignment]
    added = a_pod("a")
    added["metadata"]["resourceVersion"] = "11"
    api.events = [
        {"type": "ADDED", "object": added},
        {"type": "BOOKMARK", "object": {"metadata": {"resourceVersion": "12"}}},
    ]
    assert kubelet._watch_from("spec.nodeName=kvfleet-process", "10") == "12" and "a" in kubelet._workers
    api.events = [
        {"type": "DELETED", "object": added},
        {"type": "ERROR", "object": {"code": 410, "message": "too old resource version"}},
    ]
    assert kubelet._watch_from("spec.nodeName=kvfleet-process", "12") is None
    wait_for(lambda: "a" not in kubelet._workers)
