"""One pod on the process node (issue #43): a thread that brings its processes to the pod's spec.

Where it sits: :class:`kvfleet.cluster.kubelet.Kubelet` starts a :class:`PodWorker` for each pod
bound to its node, hands it every later version of the pod (:meth:`PodWorker.update`) and stops it
when the pod is gone (:meth:`PodWorker.stop`). The worker owns the pod's folder
``<state dir>/pods/<namespace>_<name>_<uid>/`` (``volumes/``, ``home/``, ``kubeconfig``, one
``<container>.log`` per container), its processes (:mod:`kvfleet.cluster.containers`) and its
status (:mod:`kvfleet.cluster.podstatus`); the kubelet owns its address.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from kvfleet.cluster import podspec, processes
from kvfleet.cluster.apiclient import Api, ApiError, pod_kubeconfig
from kvfleet.cluster.containers import ContainerRun
from kvfleet.cluster.podspec import ConfigError, NodeSettings, PodFolders
from kvfleet.cluster.podstatus import ConditionClock, PodView, now_rfc3339, pod_status, status_patch
from kvfleet.cluster.volumes import TokenSource, materialise, object_data

log = logging.getLogger(__name__)
Obj = dict[str, Any]
TICK_S = 0.2
RETRY_S = 2.0
DELETE_TRIES = 5
KILL_GRACE_S = 3.0  # a pod deleted outright, or the kubelet stopping: SIGTERM, then SIGKILL after this
_API_ERRORS = (ApiError, httpx.HTTPError)


@dataclass(frozen=True)
class NodeContext:
    """What every pod worker of one kubelet shares."""

    api: Api
    node_name: str
    host_ip: str
    state_dir: Path
    settings: NodeSettings


def pod_dir_name(pod: Obj) -> str:
    meta = pod["metadata"]
    return f"{meta['namespace']}_{meta['name']}_{meta['uid']}"


class PodWorker:
    """The processes, volumes and status of one pod, driven by one thread."""

    def __init__(self, node: NodeContext, pod: Obj, pod_ip: str, on_exit: Callable[[str], None]) -> None:
        meta, spec = pod["metadata"], pod.get("spec") or {}
        self.node, self.pod_ip, self.on_exit = node, pod_ip, on_exit
        self.uid: str = meta["uid"]
        self.name, self.namespace = meta["name"], meta["namespace"]
        self.pod_dir = node.state_dir / "pods" / pod_dir_name(pod)
        self._pod = pod
        self._policy = podspec.restart_policy(pod)
        grace = float(podspec.grace_seconds({"spec": spec}))
        init_policy = "Never" if self._policy == "Never" else "OnFailure"
        self.init = [
            ContainerRun(
                c,
                self._log(c),
                podspec.restart_policy(pod, c) if c.get("restartPolicy") else init_policy,
                grace,
                "PodInitializing",
            )
            for c in spec.get("initContainers") or []
        ]
        waiting = "PodInitializing" if self.init else "ContainerCreating"
        self.containers = [
            ContainerRun(c, self._log(c), self._policy, grace, waiting) for c in spec.get("containers") or []
        ]
        self.sidecars = frozenset(r.name for r in self.init if r.policy == "Always")
        self._next_init = 0
        self.folders: PodFolders | None = None
        self.tokens: TokenSource | None = None
        self._prepare_at = 0.0
        self._written: Obj | None = None
        self._retry_at = 0.0  # after a failed status write or token refresh: not again before this
        self._phase = "Pending"
        self._clock = ConditionClock((pod.get("status") or {}).get("conditions"))
        self._start_time = (pod.get("status") or {}).get("startTime") or now_rfc3339()
        self._wake, self._delete, self._stop = threading.Event(), threading.Event(), threading.Event()
        self._cleanup = False
        self.thread = threading.Thread(
            target=self._run, name=f"pod-{self.namespace}/{self.name}", daemon=True
        )

    def _log(self, container: Obj) -> str:
        return str(self.pod_dir / f"{container['name']}.log")

    # -- the kubelet's side ------------------------------------------------------------------------
    def start(self) -> None:
        self.thread.start()

    def update(self, pod: Obj) -> None:
        """A newer version of the pod; a deletion timestamp on it starts the graceful stop."""
        self._pod = pod
        if pod["metadata"].get("deletionTimestamp"):
            self._delete.set()
        self._wake.set()

    def stop(self, cleanup: bool) -> None:
        """Kill the processes now, write nothing more; ``cleanup`` removes the volumes (the pod is gone)."""
        self._cleanup = cleanup
        self._stop.set()
        self._wake.set()

    # -- the worker's thread -----------------------------------------------------------------------
    def _run(self) -> None:
        # Invariant: each tick moves the processes one step toward the pod's spec (volumes first, then
        # the init containers one at a time, each to exit 0, then every container, each restarted as
        # its restart policy says) and then writes the status only if it differs from the last one
        # written. The loop ends on deletion (preStop, SIGTERM, grace, SIGKILL, final status, DELETE)
        # or on stop (processes killed, nothing written); either way no process of the pod outlives it.
        try:
            while not self._stop.is_set() and not self._delete.is_set():
                self._tick(time.monotonic())
                self._publish()
                self._wake.wait(TICK_S)
                self._wake.clear()
            if not self._stop.is_set():
                self._terminate()
        except Exception:
            log.exception("pod %s/%s: worker failed", self.namespace, self.name)
        finally:
            procs = [r.proc for r in self.init + self.containers if r.proc is not None]
            processes.stop(procs, KILL_GRACE_S)
            if self._cleanup:
                shutil.rmtree(self.pod_dir / "volumes", ignore_errors=True)
                with contextlib.suppress(FileNotFoundError):
                    (self.pod_dir / "kubeconfig").unlink()
            self.on_exit(self.uid)

    def _tick(self, now: float) -> None:
        if self.folders is None:
            if now >= self._prepare_at:
                self._prepare(now)
            return
        if self._phase in ("Succeeded", "Failed"):  # done: stop what still runs (sidecars), start nothing
            for run in self.init + self.containers:
                run.stopping = True
                run.kill(now)
                run.poll(now)
            return
        self._refresh_tokens()
        sidecars = [r for r in self.init[: self._next_init] if r.name in self.sidecars]
        for run in sidecars:
            self._manage(run, now)
        if self._next_init < len(self.init):
            run = self.init[self._next_init]
            self._manage(run, now)
            passed = (
                run.started
                if run.name in self.sidecars
                else run.done and run.state["terminated"]["exitCode"] == 0
            )
            self._next_init += int(passed)
            return
        for run in self.containers:
            self._manage(run, now)

    def _manage(self, run: ContainerRun, now: float) -> None:
        run.poll(now)
        if run.due(now):
            self._start(run, now)
        run.probe(now)

    def _pod_with_ip(self) -> Obj:
        pod, ip, host = self._pod, self.pod_ip, self.node.host_ip
        status = {
            **(pod.get("status") or {}),
            "podIP": ip,
            "podIPs": [{"ip": ip}],
            "hostIP": host,
            "hostIPs": [{"ip": host}],
        }
        return {**pod, "status": status}

    def _lookup(self, kind: str, name: str) -> Mapping[str, str] | None:
        data = object_data(self.node.api, kind, self.namespace, name)
        return None if data is None else {k: v.decode("utf-8", "replace") for k, v in data.items()}

    def _automount(self, pod: Obj) -> bool:
        """The pod's ``automountServiceAccountToken``, else its service account's, else true."""
        spec = pod.get("spec") or {}
        if spec.get("automountServiceAccountToken") is not None:
            return bool(spec["automountServiceAccountToken"])
        account = spec.get("serviceAccountName") or "default"
        sa = self.node.api.get(f"/api/v1/namespaces/{self.namespace}/serviceaccounts/{account}") or {}
        return sa.get("automountServiceAccountToken") is not False

    def _prepare(self, now: float) -> None:
        """The pod's folder, volumes and kubeconfig; on an error each container waits with its message."""
        pod = self._pod_with_ip()
        try:
            home = self.pod_dir / "home"
            home.mkdir(parents=True, exist_ok=True)
            self.tokens = TokenSource(self.node.api, pod)
            volumes = materialise(pod, self.pod_dir, self.node.state_dir, self.node.api, self.tokens)
            kubeconfig = self._write_kubeconfig() if self._automount(pod) else None
            self.folders = PodFolders(volumes=volumes, home=str(home), kubeconfig=kubeconfig)
        except (ConfigError, OSError, *_API_ERRORS) as exc:
            log.warning("pod %s/%s: volumes not ready: %s", self.namespace, self.name, exc)
            self._prepare_at = now + RETRY_S
            for run in self.init + self.containers:
                run.state = {"waiting": {"reason": "ContainerCreating", "message": str(exc)}}

    def _write_kubeconfig(self) -> str:
        assert self.tokens is not None
        path = self.pod_dir / "kubeconfig"
        tmp = path.with_name(".kubeconfig.tmp")
        tmp.write_text(pod_kubeconfig(self.node.api, self.tokens.token(), self.namespace))
        tmp.chmod(0o600)
        os.replace(tmp, path)
        return str(path)

    def _refresh_tokens(self) -> None:
        """Rewrite the token files and the kubeconfig once their tokens are half-way to expiry."""
        if (
            self.tokens is None
            or not self.tokens.due()
            or self.folders is None
            or time.monotonic() < self._retry_at
        ):
            return
        try:
            materialise(
                self._pod_with_ip(),
                self.pod_dir,
                self.node.state_dir,
                self.node.api,
                self.tokens,
                only_tokens=True,
            )
            if self.folders.kubeconfig:
                self._write_kubeconfig()
        except (ConfigError, OSError, *_API_ERRORS) as exc:
            log.warning("pod %s/%s: token refresh failed (retried): %s", self.namespace, self.name, exc)
            self._retry_at = time.monotonic() + RETRY_S

    def _start(self, run: ContainerRun, now: float) -> None:
        assert self.folders is not None
        try:
            plan = podspec.launch_plan(
                self._pod_with_ip(), run.spec, self._lookup, self.folders, self.node.settings
            )
        except (ConfigError, *_API_ERRORS) as exc:
            run.config_error(str(exc), now)
            return
        if not os.path.isdir(plan.cwd):
            if Path(plan.cwd).is_relative_to(self.pod_dir):
                os.makedirs(plan.cwd, exist_ok=True)
            else:
                log.warning(
                    "container %s: workingDir %s is not here; using %s", run.name, plan.cwd, self.folders.home
                )
                plan = type(plan)(argv=plan.argv, env=plan.env, cwd=self.folders.home)
        run.start(plan, self.pod_ip, now)

    def _publish(self, final: bool = False) -> None:
        """Write the status if it changed since the last write (a failed write is retried, after a pause).

        A strategic merge patch carries no resourceVersion, so it never meets a 409 conflict: what
        another writer changed in between (its own conditions) is kept, not overwritten."""
        view = PodView(
            pod=self._pod,
            pod_ip=self.pod_ip,
            host_ip=self.node.host_ip,
            start_time=self._start_time,
            init=[r.view() for r in self.init],
            containers=[r.view() for r in self.containers],
            init_done=self._next_init >= len(self.init),
            final=final,
            sidecars=self.sidecars,
        )
        status = pod_status(view, self._policy, self._clock)
        self._phase = status["phase"]
        if status == self._written or (time.monotonic() < self._retry_at and not final):
            return
        try:
            self.node.api.patch(
                f"/api/v1/namespaces/{self.namespace}/pods/{self.name}/status", status_patch(status)
            )
            self._written = status
        except _API_ERRORS as exc:
            log.warning("pod %s/%s: status write failed (retried): %s", self.namespace, self.name, exc)
            self._retry_at = time.monotonic() + RETRY_S

    def _terminate(self) -> None:
        """A graceful deletion: preStop hooks, SIGTERM, the grace period, SIGKILL; then finish the deletion."""
        deadline = time.monotonic() + podspec.grace_seconds(self._pod)
        runs = [r for r in self.init + self.containers if r.running]
        for run in self.init + self.containers:
            run.stopping = True
        hooks = [threading.Thread(target=r.pre_stop, args=(deadline, self._stop), daemon=True) for r in runs]
        for hook in hooks:
            hook.start()
        for hook in hooks:
            hook.join(max(deadline - time.monotonic(), 0.0))
        for run in runs:
            run.kill(time.monotonic(), max(deadline - time.monotonic(), 0.0))
        while any(r.running for r in runs) and not self._stop.is_set():
            for run in runs:
                run.poll(time.monotonic())
            time.sleep(0.05)
        if self._stop.is_set():
            return
        self._publish(final=True)
        self._cleanup = True
        body = {
            "apiVersion": "v1",
            "kind": "DeleteOptions",
            "gracePeriodSeconds": 0,
            "preconditions": {"uid": self.uid},
        }
        log.info("pod %s/%s: stopped; finishing its deletion", self.namespace, self.name)
        for _ in range(DELETE_TRIES):
            try:
                self.node.api.delete(f"/api/v1/namespaces/{self.namespace}/pods/{self.name}", body)
                return
            except ApiError as exc:
                if exc.code in (404, 409):  # gone already, or a new pod of the same name
                    return
                log.warning("pod %s/%s: finishing the deletion failed: %s", self.namespace, self.name, exc)
            except httpx.HTTPError as exc:
                log.warning("pod %s/%s: finishing the deletion failed: %s", self.namespace, self.name, exc)
            if self._stop.wait(RETRY_S):
                return
