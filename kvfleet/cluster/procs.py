"""Child processes of the local cluster: started in their own process group with a log file each,
stopped as a group (TERM, then KILL), waited on with a bound (docs/cluster.md).

Where it sits: under :mod:`.controlplane` and :mod:`.local`, which start etcd, the Kubernetes
binaries, kwok and the process node through :meth:`Proc.start`.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from . import processes


@dataclass
class Proc:
    """One child process: its name, its ``Popen`` and the file its output goes to."""

    name: str
    popen: subprocess.Popen[bytes]
    log: Path

    @property
    def pid(self) -> int:
        return int(self.popen.pid)

    @classmethod
    def start(cls, name: str, argv: list[str], logs: Path, env: Mapping[str, str] | None = None) -> Proc:
        logs.mkdir(parents=True, exist_ok=True)
        log = logs / f"{name}.log"
        popen = processes.start(argv, dict(os.environ if env is None else env), os.getcwd(), str(log))
        return cls(name, popen, log)

    def alive(self) -> bool:
        return self.popen.poll() is None

    def tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def stop(self, grace: float = 10.0) -> None:
        """TERM the process group, KILL it after ``grace`` seconds."""
        if not self.alive():
            return
        processes.signal_group(self.popen, signal.SIGTERM)
        try:
            self.popen.wait(grace)
        except subprocess.TimeoutExpired:
            processes.signal_group(self.popen, signal.SIGKILL)
            self.popen.wait(10)

    def detach(self) -> None:
        """Leave the process running after this one exits (``up``): it is in a session of its own."""
        self.popen.returncode = 0  # Popen's finaliser then never reaps or warns about it


def stop_all(procs: Iterable[Proc], grace: float = 10.0) -> None:
    """Stop in reverse start order: dependants before what they depend on."""
    for proc in reversed(list(procs)):
        proc.stop(grace)


def wait_until(ready: Callable[[], bool], timeout: float, what: str, watched: Iterable[Proc] = ()) -> None:
    """Poll ``ready`` until true; fail at ``timeout`` or as soon as a watched process has died."""
    deadline = time.monotonic() + timeout
    watched = list(watched)
    while not ready():
        for proc in watched:
            if not proc.alive():
                raise RuntimeError(
                    f"{proc.name} exited ({proc.popen.returncode}) before {what}:\n{proc.tail()}"
                )
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not ready after {timeout:.0f} s")
        time.sleep(0.25)
