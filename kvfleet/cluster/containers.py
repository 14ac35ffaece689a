"""One container of a pod on the process node (issue #43): its process, restarts, probes, status line.

Where it sits: :class:`kvfleet.cluster.podworker.PodWorker` holds one :class:`ContainerRun` per
init container and container. On each tick it calls :meth:`ContainerRun.poll` (reap an exit and
apply the restart policy: a restart waits 1 s, 2 s, 4 s ... up to 30 s, reset after a run of two
minutes), :meth:`ContainerRun.due` / :meth:`ContainerRun.start` and :meth:`ContainerRun.probe`
(a failed startup or liveness probe kills the process: SIGTERM to its group, SIGKILL once the grace
has passed, then the restart policy decides). :meth:`ContainerRun.view` is its line in the status.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import subprocess
import threading
import time
from typing import Any

from kvfleet.cluster import processes
from kvfleet.cluster.podspec import LaunchPlan
from kvfleet.cluster.podstatus import ContainerView, now_rfc3339
from kvfleet.cluster.probes import Probe, Target, check, run_exec

log = logging.getLogger(__name__)
Obj = dict[str, Any]
BACKOFF_START_S = 1.0
BACKOFF_MAX_S = 30.0
BACKOFF_RESET_S = 120.0  # a run at least this long starts the back-off over
PROBE_KINDS = ("startup", "readiness", "liveness")


class ContainerRun:
    """A container's successive processes: at most one alive at a time."""

    def __init__(
        self, spec: Obj, log_path: str, policy: str, grace: float, waiting: str = "ContainerCreating"
    ) -> None:
        self.spec = spec
        self.name: str = spec["name"]
        self.log_path = log_path
        self.policy = policy  # Always | OnFailure | Never, as it applies to this container
        self.grace = grace
        self.proc: subprocess.Popen[bytes] | None = None
        self.target: Target | None = None  # the current run's env and cwd: exec probes and hooks use them
        self.state: Obj = {"waiting": {"reason": waiting}}
        self.last_state: Obj = {}
        self.restart_count = 0
        self.container_id: str | None = None
        self.done = False  # stopped for good: no restart will follow
        self.stopping = False  # the pod is being deleted: an exit now is final
        self._streak = 0  # restarts since the last long run: the back-off's exponent
        self._next_start = 0.0
        self._started_at = 0.0
        self._started = False  # the startup probe passed (or there is none)
        self._probes: dict[str, Probe] = {}
        self._kill_deadline: float | None = None

    def due(self, now: float) -> bool:
        """Whether a process should be started now (never started, or restarting past its back-off)."""
        return self.proc is None and not self.done and not self.stopping and now >= self._next_start

    def start(self, plan: LaunchPlan, pod_ip: str, now: float) -> None:
        if self.container_id is not None:
            self.restart_count += 1
        try:
            self.proc = processes.start(plan.argv, plan.env, plan.cwd, self.log_path)
        except OSError as exc:
            log.warning("container %s did not start: %s", self.name, exc)
            self.container_id = "process://none"
            self._started_at = now
            self._exited(128, now, reason="StartError", message=str(exc))
            return
        self.container_id = f"process://{self.proc.pid}"
        self._started_at = now
        self.state = {"running": {"startedAt": now_rfc3339()}}
        self.target = Target(pod_ip, self.spec, plan.env, plan.cwd)
        specs = {kind: self.spec.get(f"{kind}Probe") for kind in PROBE_KINDS}
        self._probes = {kind: Probe.from_spec(spec, now) for kind, spec in specs.items() if spec}
        self._started = "startup" not in self._probes
        self._kill_deadline = None

    def config_error(self, message: str, now: float, retry_s: float = 2.0) -> None:
        """The env or a volume cannot be made yet (a missing Secret...): wait and try again."""
        self.state = {"waiting": {"reason": "CreateContainerConfigError", "message": message}}
        self._next_start = now + retry_s

    def poll(self, now: float) -> bool:
        """Reap the process if it exited (True then); SIGKILL a kill whose grace has passed."""
        if self.proc is None:
            return False
        code = self.proc.poll()
        if code is None:
            if self._kill_deadline is not None and now >= self._kill_deadline:
                processes.signal_group(self.proc, signal.SIGKILL)
            return False
        processes.signal_group(self.proc, signal.SIGKILL)  # whatever it left behind in its group
        self.proc = None
        self._exited(processes.exit_code(code), now)
        return True

    def _exited(self, code: int, now: float, reason: str | None = None, message: str | None = None) -> None:
        terminated: Obj = {
            "exitCode": code,
            "reason": reason or ("Completed" if code == 0 else "Error"),
            "startedAt": (self.state.get("running") or {}).get("startedAt") or now_rfc3339(),
            "finishedAt": now_rfc3339(),
            "containerID": self.container_id,
        }
        if message:
            terminated["message"] = message
        self._probes, self.target = {}, None
        restart = self.policy == "Always" or (self.policy == "OnFailure" and code != 0)
        if self.stopping or not restart:
            self.state, self.done = {"terminated": terminated}, True
            return
        if now - self._started_at >= BACKOFF_RESET_S:
            self._streak = 0
        delay = min(BACKOFF_START_S * 2**self._streak, BACKOFF_MAX_S)
        self._streak += 1
        self._next_start = now + delay
        self.last_state = {"terminated": terminated}
        message = f"back-off {delay:g}s restarting failed container={self.name}"
        self.state = {"waiting": {"reason": "CrashLoopBackOff", "message": message}}

    def kill(self, now: float, grace: float | None = None) -> None:
        """SIGTERM the process group now, SIGKILL it once ``grace`` (default: the pod's) has passed."""
        if self.proc is not None and self._kill_deadline is None:
            processes.signal_group(self.proc, signal.SIGTERM)
            self._kill_deadline = now + (self.grace if grace is None else grace)

    def probe(self, now: float) -> None:
        """Run the probes that are due; a failed startup or liveness probe kills the process."""
        if self.proc is None or self.target is None or self._kill_deadline is not None:
            return
        for kind, probe in self._probes.items():
            if (kind == "startup") == self._started or not probe.due(now):
                continue
            probe.record(check(probe.action, self.target, probe.timeout), now)
            if kind == "startup" and probe.result:
                self._started = True
            if kind != "readiness" and probe.result is False:
                log.info("container %s failed its %s probe; killing it", self.name, kind)
                grace = probe.action.get("terminationGracePeriodSeconds")
                self.kill(now, None if grace is None else float(grace))
                return

    @property
    def running(self) -> bool:
        return self.proc is not None

    @property
    def started(self) -> bool:
        return self.proc is not None and self._started

    @property
    def ready(self) -> bool:
        if not self.started or self._kill_deadline is not None:
            return False
        readiness = self._probes.get("readiness")
        return readiness is None or readiness.result is True

    def pre_stop(self, deadline: float, cancelled: threading.Event) -> None:
        """The ``lifecycle.preStop`` hook (sleep, exec or httpGet), bounded by ``deadline``."""
        hook = (self.spec.get("lifecycle") or {}).get("preStop")
        target = self.target
        if not hook or self.proc is None or target is None:
            return
        left = max(deadline - time.monotonic(), 0.0)
        if "sleep" in hook:
            cancelled.wait(min(float(hook["sleep"].get("seconds") or 0), left))
        elif "exec" in hook:
            with contextlib.suppress(OSError, subprocess.TimeoutExpired):
                run_exec(list(hook["exec"].get("command") or []), target, left)
        elif "httpGet" in hook:
            check(hook, target, left)

    def view(self) -> ContainerView:
        return ContainerView(
            name=self.name,
            image=self.spec.get("image", ""),
            state=self.state,
            last_state=self.last_state,
            restart_count=self.restart_count,
            started=self.started,
            ready=self.ready,
            container_id=self.container_id if self.container_id != "process://none" else None,
        )
