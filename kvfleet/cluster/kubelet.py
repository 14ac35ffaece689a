"""The process node (issue #43): a kubelet whose pods run as local processes on loopback addresses.

Where it sits: the local control plane (:mod:`kvfleet.cluster.controlplane`: etcd, kube-apiserver,
kube-controller-manager, kube-scheduler) has no node of its own; this registers one, so the real
scheduler binds pods to it and the real controllers (ReplicaSets, the garbage collector,
EndpointSlices) see them run. Each pod gets its own address (127.1.0.2, 127.1.0.3, ...; a server
binding 0.0.0.0 binds that one through the LD_PRELOAD shim ``bindshim.c``) and a
:class:`kvfleet.cluster.podworker.PodWorker` thread that runs its containers. The node's Lease in
``kube-node-lease`` is renewed every 10 s and its Ready condition every 30 s, so the node-lifecycle
controller never taints it. Stopping the kubelet (SIGTERM, SIGINT) stops every process it started.

    python -m kvfleet.cluster.kubelet --kubeconfig PATH --state-dir DIR \\
        [--node-name kvfleet-process] [--path-map /opt/kvfleet/models=/local/dir ...] [--bin-dir .venv/bin]
"""

from __future__ import annotations

import argparse
import ipaddress
import logging
import os
import platform
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from kvfleet.cluster.apiclient import Api, ApiError
from kvfleet.cluster.podspec import NodeSettings
from kvfleet.cluster.podstatus import now_micro, now_rfc3339
from kvfleet.cluster.podworker import KILL_GRACE_S, NodeContext, PodWorker
from kvfleet.cluster.processes import build_shim

log = logging.getLogger("kvfleet.cluster.kubelet")
Obj = dict[str, Any]
DEFAULT_NODE = "kvfleet-process"
LEASE_NAMESPACE = "kube-node-lease"
LEASE_RENEW_S = 10.0
LEASE_DURATION_S = 40
STATUS_EVERY_S = 30.0
_API_ERRORS = (ApiError, httpx.HTTPError, KeyError, ValueError)


class AddressPool:
    """Loopback addresses for pods, 127.1.0.2 upwards: the lowest free one, reused once given back."""

    def __init__(self, first: str = "127.1.0.2", size: int = 65_000) -> None:
        self._first = int(ipaddress.IPv4Address(first))
        self._size = size
        self._used: set[int] = set()

    def take(self) -> str:
        for offset in range(self._size):
            if offset not in self._used:
                self._used.add(offset)
                return str(ipaddress.IPv4Address(self._first + offset))
        raise RuntimeError("no free pod address left")

    def give(self, address: str) -> None:
        self._used.discard(int(ipaddress.IPv4Address(address)) - self._first)


def _arch() -> str:
    machine = platform.machine().lower()
    return {"x86_64": "amd64", "aarch64": "arm64"}.get(machine, machine)


def node_object(name: str) -> Obj:
    labels = {
        "kubernetes.io/hostname": name,
        "kubernetes.io/os": "linux",
        "kubernetes.io/arch": _arch(),
        "kvfleet.dev/process-node": "true",
        "type": "process",
    }
    return {"apiVersion": "v1", "kind": "Node", "metadata": {"name": name, "labels": labels}, "spec": {}}


def node_status(name: str, host_ip: str, since: str, version: str) -> Obj:
    """The node's status: generous capacity (processes share the machine), Ready, heartbeats now."""
    memory_ki = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 1024
    capacity = {
        "cpu": str((os.cpu_count() or 1) * 8),
        "memory": f"{max(memory_ki * 8, 256 * 1024 * 1024)}Ki",
        "ephemeral-storage": "1Ti",
        "pods": "110",
    }
    now = now_rfc3339()

    def condition(kind: str, status: str, reason: str, message: str) -> Obj:
        return {
            "type": kind,
            "status": status,
            "reason": reason,
            "message": message,
            "lastHeartbeatTime": now,
            "lastTransitionTime": since,
        }

    conditions = [
        condition("MemoryPressure", "False", "KubeletHasSufficientMemory", "processes share the machine"),
        condition("DiskPressure", "False", "KubeletHasNoDiskPressure", "processes share the machine"),
        condition("PIDPressure", "False", "KubeletHasSufficientPID", "processes share the machine"),
        condition("Ready", "True", "KubeletReady", "kvfleet process node is posting ready status"),
    ]
    node_info = {
        "machineID": "",
        "systemUUID": "",
        "bootID": "",
        "kernelVersion": platform.release(),
        "osImage": "kvfleet process node",
        "containerRuntimeVersion": "process://0.1.0",
        "kubeletVersion": version,
        "kubeProxyVersion": "",
        "operatingSystem": "linux",
        "architecture": _arch(),
    }
    status = {
        "capacity": capacity,
        "allocatable": capacity,
        "conditions": conditions,
        "addresses": [{"type": "InternalIP", "address": host_ip}, {"type": "Hostname", "address": name}],
        "daemonEndpoints": {"kubeletEndpoint": {"Port": 0}},
        "nodeInfo": node_info,
    }
    return {"status": status}


class Kubelet:
    """One process node: its Node and Lease, a watch of its pods, a worker per pod."""

    def __init__(
        self,
        kubeconfig: str,
        node_name: str = DEFAULT_NODE,
        state_dir: str | os.PathLike[str] = "kvfleet-process-node",
        path_map: dict[str, str] | None = None,
        python_bin_dir: str | None = None,
        host_ip: str = "127.0.0.1",
        api: Api | None = None,  # tests pass an in-memory one
    ) -> None:
        self.api = api or Api(kubeconfig)
        self.node_name, self.host_ip = node_name, host_ip
        self.state_dir = Path(state_dir).resolve()
        self.path_map = dict(path_map or {})
        self.bin_dir = python_bin_dir or os.path.dirname(sys.executable)
        self.pool = AddressPool()
        self._workers: dict[str, PodWorker] = {}
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._since = now_rfc3339()
        self._version = "v0.0.0"
        self._node_uid = ""
        self.context: NodeContext | None = None

    def stop(self) -> None:
        self._stopping.set()

    def run(self) -> None:
        """Register the node, serve its pods until :meth:`stop`, then stop every process it started."""
        self.state_dir.mkdir(parents=True, exist_ok=True)
        settings = NodeSettings(
            bin_dir=self.bin_dir,
            system_path=os.environ.get("PATH", "/usr/local/bin:/usr/bin:/bin"),
            path_map=self.path_map,
            shim=build_shim(self.state_dir),
            kubelet_pid=os.getpid(),
        )
        self.context = NodeContext(self.api, self.node_name, self.host_ip, self.state_dir, settings)
        while not self._stopping.is_set() and not self._register():
            self._stopping.wait(2.0)
        threads = [
            threading.Thread(target=f, name=f.__name__, daemon=True)
            for f in (self._heartbeat, self._watch_pods)
        ]
        for thread in threads:
            thread.start()
        self._stopping.wait()
        self._shutdown()

    # -- the node --------------------------------------------------------------------------------
    def _register(self) -> bool:
        try:
            self._version = str((self.api.get("/version") or {}).get("gitVersion") or self._version)
            try:
                node = self.api.create("/api/v1/nodes", node_object(self.node_name))
            except ApiError as exc:
                if exc.code != 409:
                    raise
                labels = node_object(self.node_name)["metadata"]["labels"]
                node = self.api.patch(f"/api/v1/nodes/{self.node_name}", {"metadata": {"labels": labels}})
            self._node_uid = node["metadata"]["uid"]
            self._post_status()
            log.info("node %s registered (%s)", self.node_name, self._version)
            return True
        except _API_ERRORS as exc:
            log.warning("registering node %s failed (retrying): %s", self.node_name, exc)
            return False

    def _post_status(self) -> None:
        body = node_status(self.node_name, self.host_ip, self._since, self._version)
        self.api.patch(f"/api/v1/nodes/{self.node_name}/status", body)

    def _renew_lease(self) -> None:
        path = f"/apis/coordination.k8s.io/v1/namespaces/{LEASE_NAMESPACE}/leases"
        try:
            self.api.patch(
                f"{path}/{self.node_name}",
                {"spec": {"renewTime": now_micro()}},
                "application/merge-patch+json",
            )
        except ApiError as exc:
            if exc.code != 404:
                raise
            owner = {"apiVersion": "v1", "kind": "Node", "name": self.node_name, "uid": self._node_uid}
            meta = {"name": self.node_name, "namespace": LEASE_NAMESPACE, "ownerReferences": [owner]}
            spec = {
                "holderIdentity": self.node_name,
                "leaseDurationSeconds": LEASE_DURATION_S,
                "renewTime": now_micro(),
            }
            self.api.create(
                path,
                {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease", "metadata": meta, "spec": spec},
            )

    def _heartbeat(self) -> None:
        last_status = time.monotonic()
        while not self._stopping.is_set():
            try:
                self._renew_lease()
                if time.monotonic() - last_status >= STATUS_EVERY_S:
                    self._post_status()
                    last_status = time.monotonic()
            except ApiError as exc:
                log.warning("node heartbeat failed: %s", exc)
                if exc.code == 404:  # the Node was deleted: register it again
                    self._register()
            except _API_ERRORS as exc:
                log.warning("node heartbeat failed: %s", exc)
            except Exception:  # as for the watch: the heartbeat must go on
                log.exception("node heartbeat failed")
            self._stopping.wait(LEASE_RENEW_S)

    # -- the pods --------------------------------------------------------------------------------
    def _watch_pods(self) -> None:
        # Invariant: after each list the workers are exactly this node's listed, not yet finished pods;
        # every later watch event is applied in order; a watch the server ends resumes from the last
        # resourceVersion seen, and one that fails (410 Gone, an error, a broken stream) is followed by
        # a fresh list, so a pod deleted in a gap is still noticed.
        selector = f"spec.nodeName={self.node_name}"
        while not self._stopping.is_set():
            try:
                listing = self.api.request("GET", "/api/v1/pods", fieldSelector=selector)
                self._sync_all(listing.get("items") or [])
                version: str | None = listing["metadata"]["resourceVersion"]
                while version is not None and not self._stopping.is_set():
                    version = self._watch_from(selector, version)
            except _API_ERRORS as exc:
                log.warning("pod watch failed (re-listing): %s", exc)
            except Exception:  # a bug must not end the watch: the node would silently stop serving
                log.exception("pod watch failed (re-listing)")
            self._stopping.wait(1.0)

    def _watch_from(self, selector: str, version: str) -> str | None:
        """Apply the events of one watch; the last resourceVersion seen, or None when a re-list is due."""
        for event in self.api.watch("/api/v1/pods", fieldSelector=selector, resourceVersion=version):
            kind, obj = event.get("type"), event.get("object") or {}
            if kind == "ERROR":
                log.info("pod watch: %s (re-listing)", obj.get("message") or obj)
                return None
            version = obj["metadata"].get("resourceVersion") or version
            if kind == "DELETED":
                self._gone(obj["metadata"]["uid"])
            elif kind in ("ADDED", "MODIFIED"):
                self._sync(obj)
            if self._stopping.is_set():
                return None
        return version

    def _sync_all(self, pods: list[Obj]) -> None:
        listed = {p["metadata"]["uid"] for p in pods}
        with self._lock:
            missing = [uid for uid in self._workers if uid not in listed]
        for uid in missing:
            self._gone(uid)
        for pod in pods:
            self._sync(pod)

    def _sync(self, pod: Obj) -> None:
        meta = pod["metadata"]
        with self._lock:
            worker = self._workers.get(meta["uid"])
            if worker is None and not meta.get("deletionTimestamp"):
                if (pod.get("status") or {}).get("phase") in ("Succeeded", "Failed"):
                    return  # finished before this kubelet started: nothing to run
                assert self.context is not None
                worker = PodWorker(self.context, pod, self.pool.take(), self._exited)
                self._workers[meta["uid"]] = worker
                log.info("pod %s/%s: starting on %s", meta["namespace"], meta["name"], worker.pod_ip)
                worker.start()
                return
        if worker is not None:
            worker.update(pod)
        else:  # terminating and no process of it here: finish its deletion
            self._finish_deletion(pod)

    def _finish_deletion(self, pod: Obj) -> None:
        meta = pod["metadata"]
        body = {
            "apiVersion": "v1",
            "kind": "DeleteOptions",
            "gracePeriodSeconds": 0,
            "preconditions": {"uid": meta["uid"]},
        }
        try:
            self.api.delete(f"/api/v1/namespaces/{meta['namespace']}/pods/{meta['name']}", body)
        except ApiError as exc:
            if exc.code not in (404, 409):
                log.warning(
                    "pod %s/%s: finishing the deletion failed: %s", meta["namespace"], meta["name"], exc
                )

    def _gone(self, uid: str) -> None:
        with self._lock:
            worker = self._workers.get(uid)
        if worker is not None:
            worker.stop(cleanup=True)

    def _exited(self, uid: str) -> None:
        with self._lock:
            worker = self._workers.pop(uid, None)
            if worker is not None:
                self.pool.give(worker.pod_ip)

    def _shutdown(self) -> None:
        with self._lock:
            workers = list(self._workers.values())
        for worker in workers:
            worker.stop(cleanup=False)
        for worker in workers:
            worker.thread.join(KILL_GRACE_S + 5.0)
        self.api.close()
        log.info("kubelet %s stopped (%d pods' processes stopped)", self.node_name, len(workers))


def _path_map(entries: list[str]) -> dict[str, str]:
    out: dict[str, str] = {}
    for entry in entries:
        container, sep, local = entry.partition("=")
        if not sep or not container.startswith("/"):
            raise SystemExit(f"--path-map wants CONTAINER_PATH=LOCAL_PATH, got {entry!r}")
        out[container.rstrip("/")] = str(Path(local).resolve())
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m kvfleet.cluster.kubelet", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--kubeconfig", required=True, help="the kubelet's own credentials")
    parser.add_argument("--node-name", default=DEFAULT_NODE)
    parser.add_argument("--state-dir", required=True, help="pods' folders, logs and the bind shim")
    parser.add_argument("--path-map", action="append", default=[], metavar="CONTAINER_PATH=LOCAL_PATH")
    parser.add_argument("--bin-dir", default=os.path.dirname(sys.executable), help="first on the pods' PATH")
    parser.add_argument("--log-level", default="INFO")
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request otherwise
    kubelet = Kubelet(args.kubeconfig, args.node_name, args.state_dir, _path_map(args.path_map), args.bin_dir)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: kubelet.stop())
    kubelet.run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
