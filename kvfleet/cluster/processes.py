"""Local processes for the process node's containers (issue #43): start, signal, reap; the bind shim.

Where it sits: :class:`kvfleet.cluster.containers.ContainerRun` starts each container with
:func:`start` (its own session, hence its own process group, so a signal reaches whatever the
container spawned, and the kubelet's own Ctrl-C does not), stdout and stderr appended to
``<pod dir>/<container>.log``. :func:`build_shim` compiles ``bindshim.c`` (the per-pod address
of every ``bind`` to 0.0.0.0) with the system C compiler, once per source hash.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from pathlib import Path

SHIM_SOURCE = Path(__file__).with_name("bindshim.c")
_shim_lock = threading.Lock()


def build_shim(state_dir: str | os.PathLike[str]) -> str:
    """``<state_dir>/bindshim.so``, compiled from ``bindshim.c`` unless a build of the same source is there."""
    out = Path(state_dir) / "bindshim.so"
    stamp = Path(state_dir) / "bindshim.so.sha256"
    digest = hashlib.sha256(SHIM_SOURCE.read_bytes()).hexdigest()
    with _shim_lock:
        if out.exists() and stamp.exists() and stamp.read_text().strip() == digest:
            return str(out)
        compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
        if compiler is None:
            raise RuntimeError("no C compiler (cc) to build the process node's bind shim")
        out.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
            built = Path(tmp) / "bindshim.so"
            cmd = [compiler, "-shared", "-fPIC", "-O2", "-o", str(built), str(SHIM_SOURCE), "-ldl"]
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False)
            if done.returncode != 0:
                raise RuntimeError(f"building the bind shim failed: {done.stderr.strip()}")
            os.replace(built, out)
        stamp.write_text(digest + "\n")
    return str(out)


def start(argv: list[str], env: dict[str, str], cwd: str, log_path: str) -> subprocess.Popen[bytes]:
    """``argv`` in a new session, output appended to ``log_path``; raises OSError when it cannot start."""
    with open(log_path, "ab") as log:
        return subprocess.Popen(
            argv,
            env=env,
            cwd=cwd,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            close_fds=True,
        )


def signal_group(proc: subprocess.Popen[bytes], sig: int) -> None:
    """``sig`` to the process group ``proc`` leads (what the container spawned too); gone is fine."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, sig)


def exit_code(returncode: int) -> int:
    """A container's exit code as the runtime reports it: 128 + N for death by signal N."""
    return 128 - returncode if returncode < 0 else returncode


def stop(procs: list[subprocess.Popen[bytes]], grace: float) -> None:
    """SIGTERM each group, wait up to ``grace`` seconds for the leaders, then SIGKILL every group."""
    for proc in procs:
        signal_group(proc, signal.SIGTERM)
    deadline = time.monotonic() + grace
    for proc in procs:
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=max(deadline - time.monotonic(), 0.0))
    for proc in procs:
        signal_group(proc, signal.SIGKILL)
        proc.wait()
