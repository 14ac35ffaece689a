"""One container as successive processes (kvfleet/cluster/containers.py): restarts, back-off, probes, kills.

Real processes; the tick's clock is passed in, so back-off and probe timing need no sleeping.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

from kvfleet.cluster.containers import ContainerRun
from kvfleet.cluster.podspec import LaunchPlan


def plan(code: str, tmp_path: Path) -> LaunchPlan:
    return LaunchPlan(argv=[sys.executable, "-c", code], env={"PATH": os.environ["PATH"]}, cwd=str(tmp_path))


def run_of(tmp_path: Path, policy: str = "Always", **spec: Any) -> ContainerRun:
    return ContainerRun({"name": "c", "image": "img", **spec}, str(tmp_path / "c.log"), policy, grace=5.0)


def reap(run: ContainerRun, now: float, timeout: float = 10.0) -> None:
    """Poll until the process exited (bounded)."""
    deadline = time.monotonic() + timeout
    while not run.poll(now):
        assert time.monotonic() < deadline, "the process did not exit"
        time.sleep(0.02)


def test_an_exiting_container_restarts_after_a_back_off_that_doubles_and_counts_restarts(
    tmp_path: Path,
) -> None:
    run = run_of(tmp_path)
    run.start(plan("print('hello'); raise SystemExit(3)", tmp_path), "127.1.0.2", now=0.0)
    assert "running" in run.state and run.container_id == f"process://{run.proc.pid}"  # type: ignore[union-attr]
    reap(run, now=1.0)
    assert run.state["waiting"]["reason"] == "CrashLoopBackOff"
    assert run.last_state["terminated"]["exitCode"] == 3 and run.last_state["terminated"]["reason"] == "Error"
    assert (run.due(1.9), run.due(2.0)) == (False, True)  # 1 s
    run.start(plan("raise SystemExit(3)", tmp_path), "127.1.0.2", now=2.0)
    assert run.restart_count == 1
    reap(run, now=2.5)
    assert (run.due(4.4), run.due(4.5)) == (False, True)  # then 2 s
    assert "hello" in (tmp_path / "c.log").read_text()


def test_never_and_on_failure_policies_leave_a_container_terminated(tmp_path: Path) -> None:
    never = run_of(tmp_path, "Never")
    never.start(plan("raise SystemExit(4)", tmp_path), "127.1.0.2", now=0.0)
    reap(never, now=1.0)
    assert never.done and never.state["terminated"]["exitCode"] == 4 and not never.due(100.0)
    on_failure = run_of(tmp_path, "OnFailure")
    on_failure.start(plan("pass", tmp_path), "127.1.0.2", now=0.0)
    reap(on_failure, now=1.0)
    assert on_failure.done and on_failure.state["terminated"]["reason"] == "Completed"


def test_a_command_that_does_not_exist_is_a_start_error_then_backs_off(tmp_path: Path) -> None:
    run = run_of(tmp_path)
    run.start(LaunchPlan(argv=["/no/such/program"], env={}, cwd=str(tmp_path)), "127.1.0.2", now=0.0)
    assert (
        run.last_state["terminated"]["reason"] == "StartError"
        and run.last_state["terminated"]["exitCode"] == 128
    )
    assert run.state["waiting"]["reason"] == "CrashLoopBackOff" and run.view().container_id is None


def test_a_failing_liveness_probe_kills_the_process_group_and_the_policy_restarts_it(tmp_path: Path) -> None:
    liveness = {"exec": {"command": ["false"]}, "periodSeconds": 1, "failureThreshold": 2}
    run = run_of(tmp_path, livenessProbe=liveness)
    child = tmp_path / "child.pid"
    code = f"import subprocess, time; open({str(child)!r}, 'w').write(str(subprocess.Popen(['sleep', '60']).pid)); time.sleep(60)"
    run.start(plan(code, tmp_path), "127.1.0.2", now=0.0)
    try:
        assert run.started and run.ready  # no startup or readiness probe: started and ready at once
        deadline = time.monotonic() + 10
        while not child.exists() or not child.read_text():
            assert time.monotonic() < deadline
            time.sleep(0.02)
        run.probe(now=0.0)
        assert run.running  # one failure of two
        run.probe(now=1.0)
        assert not run.ready  # being killed
        reap(run, now=1.5)
    finally:
        if run.proc is not None:
            run.kill(now=0.0, grace=0.0)
            reap(run, now=10.0)
    deadline = time.monotonic() + 5
    while alive(int(child.read_text())):  # the group's SIGKILL reached the grandchild too
        assert time.monotonic() < deadline, "the container's child outlived it"
        time.sleep(0.02)
    assert (
        run.last_state["terminated"]["exitCode"] == 143
        and run.state["waiting"]["reason"] == "CrashLoopBackOff"
    )


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_readiness_needs_a_passing_probe_and_startup_holds_the_other_probes_back(tmp_path: Path) -> None:
    startup = {"exec": {"command": ["true"]}, "periodSeconds": 1}
    readiness = {"exec": {"command": ["true"]}, "periodSeconds": 1, "successThreshold": 2}
    run = run_of(tmp_path, startupProbe=startup, readinessProbe=readiness)
    run.start(plan("import time; time.sleep(60)", tmp_path), "127.1.0.2", now=0.0)
    try:
        assert (run.started, run.ready) == (False, False)
        run.probe(now=0.0)  # startup passes; readiness has not run yet
        assert (run.started, run.ready) == (True, False)
        run.probe(now=1.0)
        run.probe(now=2.0)
        assert run.ready and run.view().ready and run.view().started
    finally:
        run.kill(now=3.0, grace=0.0)
        reap(run, now=3.0)


def test_pre_stop_sleep_waits_its_seconds_but_never_past_the_deadline(tmp_path: Path) -> None:
    run = run_of(tmp_path, lifecycle={"preStop": {"sleep": {"seconds": 30}}})
    run.start(plan("import time; time.sleep(60)", tmp_path), "127.1.0.2", now=0.0)
    try:
        began = time.monotonic()
        run.pre_stop(deadline=began + 0.3, cancelled=threading.Event())
        assert 0.25 <= time.monotonic() - began < 5
    finally:
        run.stopping = True
        run.kill(now=0.0, grace=0.0)
        reap(run, now=1.0)
    assert run.done and run.state["terminated"]["exitCode"] == 143  # stopping: no restart
