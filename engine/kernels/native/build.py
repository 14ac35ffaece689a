"""The native CPU kernels' one build: every ``csrc/*.c`` compiled into one library, once per machine.

Where it sits: each kernel module of this package (``paged_decode``, ``paged_prefill``,
``fused_ops``, ``skinny_gemm``, ``packed_gemm``, ``decode_layers``,
``quant_gemm`` (``quant_pack.c``, ``quant_gemm.c``, ``quant_vnni.c``), ``int8_gemm``, ``bf16_gemm``) binds its entry points from
:func:`library`; nothing else compiles. The C sources are built with the machine's C compiler
(``$CC``, ``cc`` or ``gcc``; :data:`FLAGS`: ``-O3 -march=native -fopenmp``) into
``$KVFLEET_CACHE/kernels`` (default ``~/.cache/kvfleet/kernels``), named by a hash of the sources,
the flags and the host CPU, written under a temporary name and renamed, so concurrent processes
never load half a file. No compiler, or a failed build: no library and the reason, and each
caller falls back to its torch path.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple, TypeVar

from kvfleet.engine.paths import cache_root

CSRC = Path(__file__).with_name("csrc")
SOURCES = tuple(
    CSRC / name
    for name in (
        "paged_decode.c",
        "fused_ops.c",
        "skinny_gemm.c",
        "packed_gemm.c",
        "paged_prefill.c",
        "decode_layers.c",
        "quant_pack.c",
        "quant_gemm.c",
        "quant_vnni.c",
        "int8_gemm.c",
        "int8_vnni.c",
        "bf16_gemm.c",
    )
)
HEADERS = (CSRC / "fast_exp.h", CSRC / "quant_layout.h")  # included by the sources: part of the build key
FLAGS = ("-O3", "-march=native", "-fno-trapping-math", "-fopenmp", "-fPIC", "-shared", "-std=gnu11")


class LibraryBuild(NamedTuple):
    """The compiled library of all ``SOURCES``, or None and the reason."""

    library: ctypes.CDLL | None
    reason: str | None = None


def library() -> ctypes.CDLL | None:
    """The library built with :data:`FLAGS` (None where it does not build: the callers' torch paths
    run then). Each kernel module keeps what it binds from it once per process (``functools.cache``)."""
    return build_library(FLAGS).library


Binding = TypeVar("Binding")


def bind(binding: Callable[[ctypes.CDLL], Binding]) -> Binding | None:
    """``binding`` over :func:`library` (None where the library does not build). Each kernel module's
    ``load_*`` calls it once per process (``functools.cache``)."""
    lib = library()
    return None if lib is None else binding(lib)


def build_library(flags: tuple[str, ...]) -> LibraryBuild:
    """The library built with ``flags``, cached on disk by sources, flags, compiler and CPU."""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        return LibraryBuild(None, "no C compiler (set CC, or install gcc)")
    target = cache_dir() / f"paged_decode-{_build_key(compiler, flags)}.so"
    try:
        if target.exists():
            try:
                return LibraryBuild(ctypes.CDLL(str(target)))
            except OSError:  # a damaged file in the cache (a full disk, a copied home): build it again
                target.unlink(missing_ok=True)
        _compile(compiler, flags, target)
        return LibraryBuild(ctypes.CDLL(str(target)))
    except (OSError, subprocess.SubprocessError) as err:
        detail = err.stderr.strip() if isinstance(err, subprocess.CalledProcessError) else str(err)
        names = " and ".join(source.name for source in SOURCES)
        return LibraryBuild(None, f"building {names} with {compiler} failed: {detail}"[:2000])


def cache_dir() -> Path:
    return cache_root() / "kernels"


def _build_key(compiler: str, flags: tuple[str, ...]) -> str:
    """Source, flags, compiler and host CPU: -march=native code is only valid on the CPU it was built for."""
    digest = hashlib.sha256(b"".join(path.read_bytes() for path in (*SOURCES, *HEADERS)))
    digest.update(" ".join((compiler, *flags, platform.machine(), _cpu_flags())).encode())
    return digest.hexdigest()[:16]


def _cpu_flags() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor()
    lines = [line for line in text.splitlines() if line.startswith(("flags", "Features", "model name"))]
    return "\n".join(sorted(set(lines)))


def _compile(compiler: str, flags: tuple[str, ...], target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        subprocess.run(
            [compiler, *flags, *map(str, SOURCES), "-o", tmp, "-lm"],
            check=True,
            capture_output=True,
            text=True,
            timeout=120,
        )
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
