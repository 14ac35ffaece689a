"""Which CPU paths this machine offers, probed once and named in one log line at the engine's start.

Where it sits: ``engine/runner.py`` logs ``quant_gemm.cpu_paths_line`` when the model runs on the CPU;
the native kernels (``native/build.py``, ``-march=native``) are compiled for this same CPU. The
probe reads ``/proc/cpuinfo``'s flags (AVX2, AVX-512F, AVX-512 VNNI, AVX512-BF16, AMX-TILE/INT8/
BF16) and, only where AMX is listed, asks the kernel for the AMX tile state with
``arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)``: Linux hands the tile registers to a
process only after that call succeeds, and code that touches them before dies with SIGILL (a
llama.cpp built with GGML_NATIVE=ON did so on a Xeon here). :func:`choose_cpu_paths` is pure:
flags and the permission's outcome in, the chosen path out, so both kinds of CPU are tested here.
The quantised GGUF kernels (``quant_gemm.c``) have an AVX-512 VNNI, an AVX2 and a portable path,
chosen from this probe (``quant_gemm.choose_path``); ``int8_gemm.c`` has AVX2 and portable. The line
names the GGUF kernels' path beside the best tier the CPU offers.
"""

from __future__ import annotations

import ctypes
import functools
import os
import platform
from dataclasses import dataclass
from pathlib import Path

SYS_ARCH_PRCTL = 158  # x86_64
ARCH_REQ_XCOMP_PERM = 0x1023
XFEATURE_XTILEDATA = 18
AMX_FLAGS = ("amx_tile", "amx_int8")


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

    def describe(self, kernels: str) -> str:
        """The log line: ``kernels`` is what the built library's hand-written paths run."""
        notes = []
        if self.isa in ("avx2", "portable"):
            notes.append("no avx512")
        else:
            extra = [f for f in ("avx512_vnni", "avx512_bf16") if f in self.flags]
            notes.append("cpu offers " + " ".join(["avx512f", *extra]))
        notes.append("amx usable" if self.amx else f"amx unavailable: {self.amx_reason}")
        return f"cpu kernels: {kernels} ({', '.join(notes)}; best tier {self.isa})"


def choose_cpu_paths(flags: frozenset[str], amx: AmxPermission | None) -> CpuPaths:
    """The paths for a CPU with ``flags``; ``amx`` is the permission request's outcome (None where it
    was not made). AMX is chosen only when cpuinfo lists it *and* the permission was granted."""
    if "avx512f" in flags:
        isa = "avx512_vnni" if "avx512_vnni" in flags else "avx512"
    elif "avx2" in flags:
        isa = "avx2"
    else:
        isa = "portable"
    if not all(f in flags for f in AMX_FLAGS):
        return CpuPaths(isa, False, "not in cpuinfo", flags)
    if amx is None or not amx.granted:
        why = "permission not requested" if amx is None else amx.reason
        return CpuPaths(isa, False, f"arch_prctl refused ({why})", flags)
    return CpuPaths(isa, True, "", flags)


def cpuinfo_flags(text: str) -> frozenset[str]:
    """The feature flags of the first processor in a ``/proc/cpuinfo`` text."""
    for line in text.splitlines():
        if line.startswith("flags"):
            return frozenset(line.split(":", 1)[1].split())
    return frozenset()


def request_amx_permission() -> AmxPermission:
    """Ask Linux for the AMX tile data state (x86_64 only); the outcome, never an exception."""
    if platform.system() != "Linux" or platform.machine() != "x86_64":
        return AmxPermission(False, f"not x86_64 Linux ({platform.system()} {platform.machine()})")
    libc = ctypes.CDLL(None, use_errno=True)
    rc = libc.syscall(SYS_ARCH_PRCTL, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)
    if rc != 0:
        err = ctypes.get_errno()
        return AmxPermission(False, f"errno {err}: {os.strerror(err)}")
    return AmxPermission(True)


@functools.cache
def probe_cpu_paths() -> CpuPaths:
    """This machine's paths: cpuinfo's flags, and the AMX permission asked only where AMX is listed."""
    try:
        flags = cpuinfo_flags(Path("/proc/cpuinfo").read_text())
    except OSError:
        flags = frozenset()
    asked = request_amx_permission() if all(f in flags for f in AMX_FLAGS) else None
    return choose_cpu_paths(flags, asked)
