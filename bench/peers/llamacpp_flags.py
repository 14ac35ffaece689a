"""The instruction-set flags bench/peers/llamacpp_env.sh builds llama.cpp's CPU backend with.

Where it sits: ``bench/peers/llamacpp_env.sh`` runs ``python -m bench.peers.llamacpp_flags`` and
passes the first line it prints to cmake; the rest (one reason per flag) goes to stderr and into
the build's record. ``GGML_NATIVE=ON`` (``-march=native``) is not used: a build so made died with
SIGILL on an AMX Xeon here, where Linux hands a process the AMX tile state only after
``arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)``. Every flag is named instead, ON where
``/proc/cpuinfo`` lists the feature, and AMX only where the permission was also granted (the same
probe as kvfleet's own kernels: ``kvfleet.engine.kernels.native.cpu_features``).
:func:`isa_flags` is pure (flags and the permission's outcome in, cmake definitions out).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import NamedTuple

from kvfleet.engine.kernels.native.cpu_features import (
    AMX_FLAGS,
    AmxPermission,
    cpuinfo_flags,
    request_amx_permission,
)

# ggml's option -> the /proc/cpuinfo flags it compiles for (all of them must be listed)
GGML_ISA: dict[str, tuple[str, ...]] = {
    "GGML_SSE42": ("sse4_2",),
    "GGML_AVX": ("avx",),
    "GGML_AVX2": ("avx2",),
    "GGML_BMI2": ("bmi2",),
    "GGML_FMA": ("fma",),
    "GGML_F16C": ("f16c",),
    "GGML_AVX_VNNI": ("avx_vnni",),
    # ggml's GGML_AVX512 compiles with -mavx512f -mavx512cd -mavx512vl -mavx512dq -mavx512bw
    "GGML_AVX512": ("avx512f", "avx512cd", "avx512vl", "avx512dq", "avx512bw"),
    "GGML_AVX512_VBMI": ("avx512vbmi",),
    "GGML_AVX512_VNNI": ("avx512_vnni",),
    "GGML_AVX512_BF16": ("avx512_bf16",),
}
GGML_AMX: dict[str, str] = {
    "GGML_AMX_TILE": "amx_tile",
    "GGML_AMX_INT8": "amx_int8",
    "GGML_AMX_BF16": "amx_bf16",
}
# what every build of this bench sets besides the instruction sets
BASE_FLAGS = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DGGML_NATIVE=OFF",
    "-DGGML_CUDA=OFF",
    "-DLLAMA_CURL=OFF",
    "-DLLAMA_OPENSSL=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DBUILD_SHARED_LIBS=OFF",
)


class Choice(NamedTuple):
    """One cmake definition and why it is ON or OFF."""

    option: str
    on: bool
    why: str

    @property
    def define(self) -> str:
        return f"-D{self.option}={'ON' if self.on else 'OFF'}"


# llama-server 11434.0.0 built with GGML_AMX_* died with SIGILL on an AMX Xeon here (2026-12-06) with the
# tile state granted, the permission asked by an LD_PRELOAD constructor too: gdb put it at `tilezero` in
# tinygemm_kernel_amx<block_q8_1, block_q4_1> (Q4_1, this GGUF's type) on an OpenMP thread. Off unless asked.
AMX_SIGILL = (
    "llama-server's AMX Q4_1 kernel dies with SIGILL at tilezero here (KVFLEET_LLAMACPP_AMX=1 to try)"
)


def isa_flags(flags: frozenset[str], amx: AmxPermission | None, *, llama_amx: bool = False) -> list[Choice]:
    """ggml's instruction-set options for a CPU listing ``flags``; ``amx`` is the outcome of the AMX
    permission request (None where it was not made). Each option is ON only if the CPU has every
    feature it compiles for; AMX also needs the permission (else SIGILL at the first tile op) and
    ``llama_amx`` (:data:`AMX_SIGILL`: llama.cpp's own AMX kernels fail here where ours run)."""
    out = []
    for option, needs in GGML_ISA.items():
        missing = [f for f in needs if f not in flags]
        why = f"cpuinfo lists {' '.join(needs)}" if not missing else f"cpuinfo lacks {' '.join(missing)}"
        out.append(Choice(option, not missing, why))
    listed = all(f in flags for f in AMX_FLAGS)
    for option, feature in GGML_AMX.items():
        if feature not in flags or not listed:
            out.append(
                Choice(option, False, f"cpuinfo lacks {feature if feature not in flags else 'amx_tile/int8'}")
            )
        elif amx is None or not amx.granted:
            why = "not requested" if amx is None else amx.reason
            out.append(Choice(option, False, f"arch_prctl(ARCH_REQ_XCOMP_PERM) refused: {why}"))
        elif not llama_amx:
            out.append(Choice(option, False, AMX_SIGILL))
        else:
            out.append(Choice(option, True, "cpuinfo lists it and arch_prctl granted the tile state"))
    return out


def cmake_flags(choices: list[Choice]) -> list[str]:
    """The whole cmake command line's definitions: :data:`BASE_FLAGS`, then each choice."""
    return [*BASE_FLAGS, *(c.define for c in choices)]


def probe() -> list[Choice]:
    """This machine's choices: /proc/cpuinfo, and the AMX permission asked only where AMX is listed."""
    flags = cpuinfo_flags(Path("/proc/cpuinfo").read_text())
    asked = request_amx_permission() if all(f in flags for f in AMX_FLAGS) else None
    return isa_flags(flags, asked, llama_amx=os.environ.get("KVFLEET_LLAMACPP_AMX") == "1")


def main() -> None:
    import sys

    choices = probe()
    print(" ".join(cmake_flags(choices)))
    for c in choices:
        print(f"  {c.define:28s} {c.why}", file=sys.stderr)


if __name__ == "__main__":
    main()
