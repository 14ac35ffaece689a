"""Which CPU paths this machine offers, probed once and named in one log line at the engine's start.

Where it sits: ``engine/runner/model_runner.py`` logs ``quant_gemm.cpu_paths_line`` when the model runs on the CPU;
the native kernels (``native/build.py``, ``-march=native``) are compiled for this same CPU. The
probe reads ``/proc/cpuinfo``'s flags (AVX2, AVX-512F, AVX-512 VNNI, AVX512-BF16, AMX-TILE/INT8/
BF16) and, only where AMX is listed, asks the kernel for the AMX tile state with
``arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)``: Linux hands the tile registers to a
process only after that call succeeds, and code that touches them before dies with SIGILL (a
llama.cpp built with GGML_NATIVE=ON did so on a Xeon here); it is asked once per process, whichever
thread probes first (:class:`Once`), and the probe too. :func:`choose_cpu_paths` is pure:
flags and the permission's outcome in, the chosen path out, so both kinds of CPU are tested here.
The quantised GGUF kernels (``quant_gemm.c``) have an AVX-512 VNNI, an AVX2 and a portable path,
chosen from this probe (``quant_gemm.choose_path``), as ``int8_gemm.c``'s are. The line
names the GGUF kernels' path beside the best tier the CPU offers, then the low-precision paths:

- ``bf16``: what ``--dtype bfloat16``'s matmuls run on (oneDNN through torch, ``kernels/packing/
  onednn.py``): ``amx`` where AMX-BF16 is listed and the permission granted, ``avx512_bf16`` where
  that is listed (also a Xeon whose AMX permission was refused: oneDNN asks the kernel itself and
  falls back), else ``none``: oneDNN then converts bf16 to float32 around float32 FMAs, slower
  than float32 itself. As vLLM-CPU does, an explicit ``--dtype bfloat16`` is still honoured there
  (half the weights' memory), with a warning naming the fix (``--dtype float32``);
- ``int8``: the native path ``--quantization int8`` runs below 16 rows (``native/int8_gemm.py``):
  ``avx512_vnni``, ``avx2`` or ``portable``; from 16 rows oneDNN's s8 GEMM (``kernels/int8_linear.py``),
  which takes AMX-INT8 where it is listed and granted (named then), else VNNI or AVX2 by itself.
"""

from __future__ import annotations

import ctypes
import os
import platform
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Generic, TypeVar

SYS_ARCH_PRCTL = 158  # x86_64
ARCH_REQ_XCOMP_PERM = 0x1023
XFEATURE_XTILEDATA = 18
T = TypeVar("T")
AMX_FLAGS = ("amx_tile", "amx_int8")
AMX_BF16_FLAGS = ("amx_tile", "amx_bf16")


@dataclass(frozen=True, slots=True)
class AmxPermission:
    """The outcome of ``arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)``: granted, or why not."""

    granted: bool
    reason: str = ""


@dataclass(frozen=True, slots=True)
class CpuPaths:
    """The vector tier chosen (``avx512_vnni``, ``avx512``, ``avx2`` or ``portable``), whether AMX may
    be used and, where not, why; ``flags`` the features seen."""

    isa: str
    amx: bool
    amx_reason: str
    flags: frozenset[str]
    bf16: LowPrecisionPath
    int8: LowPrecisionPath

    def describe(self, kernels: str) -> str:
        """The log line: ``kernels`` is what the built library's hand-written paths run."""
        notes = []
        if self.isa in ("avx2", "portable"):
            notes.append("no avx512")
        else:
            extra = [f for f in ("avx512_vnni", "avx512_bf16") if f in self.flags]
            notes.append("cpu offers " + " ".join(["avx512f", *extra]))
        notes.append("amx usable" if self.amx else f"amx unavailable: {self.amx_reason}")
        return f"cpu kernels: {kernels} ({', '.join(notes)}; best tier {self.isa}); bf16: {self.bf16}; int8: {self.int8}"


@dataclass(frozen=True, slots=True)
class LowPrecisionPath:
    """The path one low-precision format runs on (``amx``, ``avx512_bf16``, ``avx2``, ``portable`` or
    ``none``) and, where it is not the best the CPU could offer, why."""

    path: str
    note: str = ""

    def __str__(self) -> str:
        return f"{self.path} ({self.note})" if self.note else self.path


def choose_bf16(flags: frozenset[str], amx: AmxPermission | None) -> LowPrecisionPath:
    """What bf16 matmuls run on (the module docstring): AMX, AVX512-BF16, or none."""
    amx_listed = all(f in flags for f in AMX_BF16_FLAGS)
    if amx_listed and amx is not None and amx.granted:
        return LowPrecisionPath("amx")
    if "avx512_bf16" in flags:
        refused = "permission not requested" if amx is None else amx.reason
        return LowPrecisionPath("avx512_bf16", f"amx_bf16 refused: {refused}" if amx_listed else "")
    return LowPrecisionPath(
        "none", "no avx512_bf16/amx_bf16: bf16 matmuls emulated, slower than float32; use --dtype float32"
    )


def choose_int8(flags: frozenset[str], amx: AmxPermission | None) -> LowPrecisionPath:
    """What ``--quantization int8`` runs on: ``int8_gemm.c``'s AVX-512 VNNI, AVX2 or portable path
    below 16 rows; the note names oneDNN's from 16 rows, with AMX-INT8 where granted."""
    if "avx512f" in flags and "avx512_vnni" in flags:
        path = "avx512_vnni"
    else:
        path = "avx2" if "avx2" in flags else "portable"
    amx_int8 = all(f in flags for f in AMX_FLAGS) and amx is not None and amx.granted
    return LowPrecisionPath(path, "from 16 rows: onednn amx_int8" if amx_int8 else "from 16 rows: onednn")


def choose_cpu_paths(flags: frozenset[str], amx: AmxPermission | None) -> CpuPaths:
    """The paths for a CPU with ``flags``; ``amx`` is the permission request's outcome (None where it
    was not made). AMX is chosen only when cpuinfo lists it *and* the permission was granted."""
    if "avx512f" in flags:
        isa = "avx512_vnni" if "avx512_vnni" in flags else "avx512"
    elif "avx2" in flags:
        isa = "avx2"
    else:
        isa = "portable"
    low = (choose_bf16(flags, amx), choose_int8(flags, amx))
    if not all(f in flags for f in AMX_FLAGS):
        return CpuPaths(isa, False, "not in cpuinfo", flags, *low)
    if amx is None or not amx.granted:
        why = "permission not requested" if amx is None else amx.reason
        return CpuPaths(isa, False, f"arch_prctl refused ({why})", flags, *low)
    return CpuPaths(isa, True, "", flags, *low)


def cpuinfo_flags(text: str) -> frozenset[str]:
    """The feature flags of the first processor in a ``/proc/cpuinfo`` text."""
    for line in text.splitlines():
        if line.startswith("flags"):
            return frozenset(line.split(":", 1)[1].split())
    return frozenset()


class Once(Generic[T]):
    """A value made once per process, by whichever thread asks first; the others wait for it and get
    the same (``functools.cache`` alone may run the function twice when two threads race)."""

    def __init__(self, make: Callable[[], T]) -> None:
        self._make = make
        self._lock = threading.Lock()
        self._value: T | None = None

    def __call__(self) -> T:
        with self._lock:
            if self._value is None:
                self._value = self._make()
            return self._value


def arch_prctl_xtiledata() -> int:
    """The raw request, ``arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)``: 0, or the errno."""
    libc = ctypes.CDLL(None, use_errno=True)
    rc = libc.syscall(SYS_ARCH_PRCTL, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)
    return 0 if rc == 0 else ctypes.get_errno()


def _ask_amx_permission() -> AmxPermission:
    if platform.system() != "Linux" or platform.machine() != "x86_64":
        return AmxPermission(False, f"not x86_64 Linux ({platform.system()} {platform.machine()})")
    err = arch_prctl_xtiledata()
    return AmxPermission(True) if err == 0 else AmxPermission(False, f"errno {err}: {os.strerror(err)}")


_AMX_PERMISSION = Once(_ask_amx_permission)


def request_amx_permission() -> AmxPermission:
    """Ask Linux for the AMX tile data state (x86_64 only), once per process whatever the threads:
    the outcome, never an exception. Linux keeps the permission for the process (a forked child
    inherits it with this cache; exec clears both), so asking again would only repeat the answer."""
    return _AMX_PERMISSION()


def _probe() -> CpuPaths:
    try:
        flags = cpuinfo_flags(Path("/proc/cpuinfo").read_text())
    except OSError:
        flags = frozenset()
    asked = request_amx_permission() if "amx_tile" in flags else None
    return choose_cpu_paths(flags, asked)


_CPU_PATHS = Once(_probe)


def probe_cpu_paths() -> CpuPaths:
    """This machine's paths, probed once per process: cpuinfo's flags, and the AMX permission asked
    only where AMX tiles are listed."""
    return _CPU_PATHS()
