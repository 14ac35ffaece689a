"""Probes and lifecycle hooks of the process node's containers (issue #43).

Where it sits: :class:`kvfleet.cluster.containers.ContainerRun` keeps one :class:`Probe` per
``startupProbe`` / ``readinessProbe`` / ``livenessProbe`` of its container and asks it, each tick,
whether it is due; :func:`check` then runs the probe's action against the pod's address
(``httpGet``, ``tcpSocket``, ``exec`` in the container's environment; ``grpc`` is not implemented
and counts as a success, logged once). The thresholds are Kubernetes': a result flips to success
after ``successThreshold`` consecutive successes and to failure after ``failureThreshold``
consecutive failures; until the first flip it is unknown (``None``).
"""

from __future__ import annotations

import logging
import socket
import subprocess
from dataclasses import dataclass
from typing import Any

import httpx

from kvfleet.cluster.podspec import ConfigError, container_port

log = logging.getLogger(__name__)
Obj = dict[str, Any]
_warned: set[str] = set()


@dataclass
class Probe:
    """One probe of one container run: its timing, thresholds and consecutive results."""

    action: Obj
    initial_delay: float
    period: float
    timeout: float
    failure_threshold: int
    success_threshold: int
    next_at: float
    result: bool | None = None
    successes: int = 0
    failures: int = 0

    @classmethod
    def from_spec(cls, spec: Obj, started_at: float) -> Probe:
        """``spec`` (a container's probe) for a process started at monotonic time ``started_at``."""
        delay = float(spec.get("initialDelaySeconds") or 0)
        return cls(
            action=spec,
            initial_delay=delay,
            period=float(spec.get("periodSeconds") or 10),
            timeout=float(spec.get("timeoutSeconds") or 1),
            failure_threshold=int(spec.get("failureThreshold") or 3),
            success_threshold=int(spec.get("successThreshold") or 1),
            next_at=started_at + delay,
        )

    def due(self, now: float) -> bool:
        return now >= self.next_at

    def record(self, ok: bool, now: float) -> None:
        """One result: the run it extends, the flip it may cause, and the next time the probe is due."""
        if ok:
            self.successes, self.failures = self.successes + 1, 0
            if self.successes >= self.success_threshold:
                self.result = True
        else:
            self.successes, self.failures = 0, self.failures + 1
            if self.failures >= self.failure_threshold:
                self.result = False
        self.next_at = now + self.period


@dataclass(frozen=True)
class Target:
    """Where a probe or hook acts: the pod's address, the container's spec (its named ports), its env."""

    pod_ip: str
    container: Obj
    env: dict[str, str]
    cwd: str


def _http_get(action: Obj, target: Target, timeout: float) -> bool:
    port = container_port(target.container, action.get("port", 80))
    host = action.get("host") or target.pod_ip
    scheme = str(action.get("scheme") or "HTTP").lower()
    path = action.get("path") or "/"
    headers = {h["name"]: h.get("value", "") for h in action.get("httpHeaders") or [] if "name" in h}
    url = f"{scheme}://{host}:{port}{path if path.startswith('/') else '/' + path}"
    response = httpx.get(
        url, headers=headers, timeout=timeout, verify=False, follow_redirects=False, trust_env=False
    )
    return 200 <= response.status_code < 400


def _tcp(action: Obj, target: Target, timeout: float) -> bool:
    port = container_port(target.container, action.get("port", 0))
    with socket.create_connection((action.get("host") or target.pod_ip, port), timeout=timeout):
        return True


def run_exec(command: list[str], target: Target, timeout: float | None) -> bool:
    """``command`` as the container would run it (its env, its working directory); True on exit 0."""
    done = subprocess.run(
        command,
        env=target.env,
        cwd=target.cwd,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        timeout=timeout,
        check=False,
    )
    return done.returncode == 0


def check(action: Obj, target: Target, timeout: float) -> bool:
    """Run one probe (or hook) action; any error (refused, timed out, bad status) is a failure."""
    try:
        if "httpGet" in action:
            return _http_get(action["httpGet"], target, timeout)
        if "tcpSocket" in action:
            return _tcp(action["tcpSocket"], target, timeout)
        if "exec" in action:
            return run_exec(list(action["exec"].get("command") or []), target, timeout)
    except (OSError, httpx.HTTPError, subprocess.TimeoutExpired, ConfigError, ValueError):
        return False
    kind = ",".join(sorted(k for k in action if not k.endswith(("Seconds", "Threshold")))) or "empty"
    if kind not in _warned:
        _warned.add(kind)
        log.warning("probe action %s is not implemented by the process node; counted as a success", kind)
    return True
