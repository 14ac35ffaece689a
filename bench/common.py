"""The bits every benchmark shares: where results go, a process's CPU time, the engine core's pid,
model folders, thread settings, a call's wall times and the peers' side venvs.

bench/ is a package run from the repository root (``python -m bench.peers.peers --smoke``); its
subjects (``serving``, ``router``, ``kernels``, ``gpu``, ``peers``) import one another only as
``bench.<subject>.<module>`` and share what is general through this module.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import subprocess
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import NamedTuple

BENCH = Path(__file__).resolve().parent
RESULTS = BENCH / "results"  # only what README.md or docs/ cite is committed here
SIDE_VENVS = BENCH / "peers"  # vllm_env.sh, guidellm_env.sh (through side_venv.sh)


class TokenRates:
    """Output and total (prompt + output) tokens per second: what every bench's result row reports."""

    seconds: float
    prompt_tokens: int
    output_tokens: int

    @property
    def out_tps(self) -> float:
        return self.output_tokens / self.seconds

    @property
    def total_tps(self) -> float:
        return (self.prompt_tokens + self.output_tokens) / self.seconds


class Flag(NamedTuple):
    """A :func:`bench_args` option with a help line (a plain default says enough for the others)."""

    default: object
    help: str


def cpu_name() -> str:
    """The CPU's model name as /proc/cpuinfo gives it (every figure names its CPU)."""
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown CPU"


def bench_args(doc: str | None, **options: object) -> argparse.Namespace:
    """Every bench's command line, parsed: ``--name-with-dashes`` per keyword, typed by its default
    (a bool is a switch, off by default), the module docstring's first line as the description."""
    parser = argparse.ArgumentParser(description=(doc or "").splitlines()[0] if doc else None)
    for name, option in options.items():
        default, help_line = option if isinstance(option, Flag) else (option, None)
        flag = "--" + name.replace("_", "-")
        if isinstance(default, bool):
            parser.add_argument(flag, action="store_true", help=help_line)
        else:
            parser.add_argument(flag, type=type(default), default=default, help=help_line)
    return parser.parse_args()


def call_seconds(fn: Callable[[], object], reps: int, *, warm_up: bool = True) -> list[float]:
    """The wall seconds of each of ``reps`` calls of ``fn``, after one untimed call unless not ``warm_up``."""
    if warm_up:
        fn()
    walls = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        walls.append(time.perf_counter() - start)
    return walls


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds process ``pid`` (all its threads) has used so far, from ``/proc/PID/stat``."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime: fields 14, 15


def core_pid(server_pid: int) -> int | None:
    """The engine core process of a ``kvfleet engine`` (its multiprocessing child), if it has one."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            if ppid == server_pid and b"spawn_main" in (stat.parent / "cmdline").read_bytes():
                return int(stat.parent.name)
        except (OSError, ValueError):
            continue
    return None


def resolve_model(name: str) -> Path:
    """A folder as is; a name (``smollm2``) through kvfleet's model sources where that module exists."""
    path = Path(name).expanduser()
    if path.is_dir():
        return path.resolve()
    try:
        from kvfleet.engine.loader.sources import resolve_model as resolve  # type: ignore[import-not-found]
    except ImportError:
        raise SystemExit(
            f"--model {name}: not a folder, and this kvfleet has no kvfleet.engine.loader.sources to resolve "
            "names: give a Hugging Face folder (fp32 safetensors, config.json, tokenizer)"
        ) from None
    return Path(resolve(name)).resolve()


def side_venv(script: str, timeout_s: float) -> str:
    """The last line a side-venv script prints (its tool's path), creating the venv first if needed
    (``bench/peers/vllm_env.sh``, ``bench/peers/guidellm_env.sh``)."""
    out = subprocess.run(
        ["bash", str(SIDE_VENVS / script)], check=True, stdout=subprocess.PIPE, text=True, timeout=timeout_s
    )
    return out.stdout.strip().splitlines()[-1]


def thread_env(threads: str, **extra: str) -> dict[str, str]:
    """This environment with ``OMP_NUM_THREADS`` set and numpy's OpenBLAS held to one thread (its
    pool spins on the cores torch's OpenMP pool uses; kvfleet's engine sets that itself), or for
    ``default`` both removed: every contender gets the same tuning."""
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS")}
    if threads != "default":
        env["OMP_NUM_THREADS"] = threads
        env["OPENBLAS_NUM_THREADS"] = "1"
    env.update(extra)
    return env


def publish(lines: Sequence[str], filename: str) -> None:
    """Print the figure and write it to ``bench/results/<filename>``."""
    text = "\n".join(lines)
    print(text)
    (RESULTS / filename).write_text(text + "\n")


@contextlib.contextmanager
def omp_threads(threads: str) -> Iterator[None]:
    """``OMP_NUM_THREADS`` set to ``threads`` in this process's environment (``default``: removed)
    while the block runs (an engine started in it inherits it), then put back as it was."""
    old = os.environ.get("OMP_NUM_THREADS")
    os.environ.pop("OMP_NUM_THREADS", None)
    if threads != "default":
        os.environ["OMP_NUM_THREADS"] = threads
    try:
        yield
    finally:
        os.environ.pop("OMP_NUM_THREADS", None)
        if old is not None:
            os.environ["OMP_NUM_THREADS"] = old
