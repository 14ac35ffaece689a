"""Operating-system helpers every part uses (torch-free): a free TCP port, how a process ended.

The engine's API process names how its core process died; ``kvfleet up`` names how an engine
process ended; the tests and benches take ports from the same ``free_port``.
"""

from __future__ import annotations

import contextlib
import signal
import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on now."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def describe_exit(code: int | None) -> str:
    """``exit code 3``, ``killed by SIGKILL``, or ``still running`` for a process's exit status.

    ``code`` is ``Popen.returncode`` or ``multiprocessing.Process.exitcode``: negative when a
    signal ended the process.
    """
    if code is None:
        return "still running"
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"killed by {signal.Signals(-code).name}"
        return f"killed by signal {-code}"
    return f"exit code {code}"
