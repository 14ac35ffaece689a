"""Which GEMM a float32 model's matmuls run on: weights packed for MKL, for oneDNN or for the native kernel.

Where it sits: ``ModelRunner`` resolves ``EngineConfig.weight_packing`` here once, at load,
and ``LlamaForCausalLM.prepack(kind)`` packs every layer's linears with :func:`pack_weight`;
``cpu_linear.linear`` then runs a step of more than ``SKINNY_MAX_ROWS`` rows through the
packed weight. Policies by name
(:data:`PACKERS`): ``mkl`` (``mkl_packed``), ``onednn`` (``onednn_packed``), ``native``
(``native_packed``, ``csrc/packed_gemm.c``), and ``auto``, which times them all on the
model's first gate/up weight and keeps the fastest.

Why measure instead of asking the CPU's vendor: the two libraries trade places by machine.
On an Intel Xeon with AVX-512 MKL's packed GEMM reached the fp32 roof; on an AMD EPYC
(AVX2) MKL ran a generic path at 95-130 GFLOP/s where oneDNN ran 145-160 and the native
kernel 185-205 (bench/results/native_packed.txt). A few milliseconds of timing at start-up
read the machine the engine actually runs on.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Protocol

import torch

from kvfleet.engine.kernels import mkl_packed, native_packed, onednn_packed

log = logging.getLogger(__name__)

CALIBRATION_ROWS = 256  # a prefill chunk's size: the rows the choice matters for
CALIBRATION_REPS = 3


class PackedWeight(Protocol):
    """A linear's weight packed once: ``F.linear(x, weight, bias)`` for the inputs it ``takes``."""

    @property
    def out_features(self) -> int: ...

    @property
    def in_features(self) -> int: ...

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor: ...

    def takes(self, x: torch.Tensor) -> bool: ...

    @property
    def streams_few_rows(self) -> bool:
        """Whether a decode step's few rows run here as fast as on the unpacked few-row kernel
        (``cpu_linear.linear`` then sends it every row count)."""
        ...


PACKERS: dict[str, Callable[[torch.Tensor], PackedWeight | None]] = {
    "mkl": mkl_packed.pack_weight,
    "onednn": onednn_packed.pack_weight,
    "native": native_packed.pack_weight,
}


def pack_weight(weight: torch.Tensor, kind: str) -> PackedWeight | None:
    """``weight`` packed by the packer named ``kind``, or None where it does not take it."""
    return PACKERS[kind](weight)


def _seconds(packed: PackedWeight, x: torch.Tensor) -> float:
    """Best of :data:`CALIBRATION_REPS` timed calls, after one untimed."""
    with torch.inference_mode():
        packed(x, None)
        best = float("inf")
        for _ in range(CALIBRATION_REPS):
            start = time.perf_counter()
            packed(x, None)
            best = min(best, time.perf_counter() - start)
    return best


def resolve(kind: str, sample: torch.Tensor) -> str | None:
    """The packer to use: ``kind`` itself, or for ``auto`` the faster on ``sample`` (a weight of
    the model). None where no packer takes a float32 CPU weight (then ``F.linear`` runs)."""
    if kind != "auto":
        return kind if kind in PACKERS else None
    timed: dict[str, float] = {}
    x = torch.randn(CALIBRATION_ROWS, sample.shape[1], dtype=sample.dtype)
    for name, packer in PACKERS.items():
        packed = packer(sample)
        if packed is not None:
            timed[name] = _seconds(packed, x)
    if not timed:
        return None
    choice = min(timed, key=timed.__getitem__)
    figures = ", ".join(f"{name} {seconds * 1e3:.2f} ms" for name, seconds in timed.items())
    log.info(
        "weight packing auto: %s (%d rows x %s weight: %s)",
        choice,
        CALIBRATION_ROWS,
        tuple(sample.shape),
        figures,
    )
    return choice
