"""Which GEMM a model's CPU matmuls run on: weights packed for MKL, for oneDNN or for the native kernel.

Where it sits: ``ModelRunner`` resolves ``EngineConfig.weight_packing`` here once, at load,
and ``LlamaForCausalLM.prepack(kind)`` packs every layer's linears with :func:`pack_weight`;
``kernels/linear.py`` then resolves each linear to its callable over the packed weight. Policies
by name (:data:`PACKERS`, each a subclass of ``base.PackedWeight``): ``mkl`` (``mkl.py``),
``onednn`` (``onednn.py``), ``native`` (``native/packed_gemm.py``, ``csrc/packed_gemm.c``), and
``auto``, which times them all on the model's first gate/up weight and keeps the fastest.

Why measure instead of asking the CPU's vendor: the two libraries trade places by machine.
On an Intel Xeon with AVX-512 MKL's packed GEMM reached the fp32 roof; on an AMD EPYC
(AVX2) MKL ran a generic path at 95-130 GFLOP/s where oneDNN ran 145-160 and the native
kernel 185-205 (bench/results/native_packed.txt). A few milliseconds of timing at start-up
read the machine the engine actually runs on.

A bfloat16 model (``--dtype bfloat16``) is prepacked only where the CPU computes bf16
(:func:`packs_model_dtype`: ``cpu_features.choose_bf16`` finds AMX or AVX512-BF16), and then only
oneDNN packs it (``onednn.py``), so ``auto`` is oneDNN; elsewhere its linears run ``F.linear``.
"""

from __future__ import annotations

import logging
import time

import torch

from kvfleet.engine.kernels.native.cpu_features import probe_cpu_paths
from kvfleet.engine.kernels.packing.base import PackedWeight
from kvfleet.engine.kernels.packing.mkl import MklPackedWeight
from kvfleet.engine.kernels.packing.native import NativePackedWeight
from kvfleet.engine.kernels.packing.onednn import OnednnPackedWeight

log = logging.getLogger(__name__)

CALIBRATION_ROWS = 256  # a prefill chunk's size: the rows the choice matters for
CALIBRATION_REPS = 5  # rounds, every packer timed once a round: a neighbour's burst slows them alike
NATIVE_MARGIN = 1.10  # the native panels also run the one-call decode: another packer must be 10% faster


PACKERS: dict[str, type[PackedWeight]] = {
    "mkl": MklPackedWeight,
    "onednn": OnednnPackedWeight,
    "native": NativePackedWeight,
}


def packs_model_dtype(dtype: torch.dtype) -> bool:
    """Whether a CPU model of ``dtype`` gets its weights prepacked here: float32 always, bfloat16
    where the CPU has a bf16 path (the start-up line's ``bf16:``), never another dtype."""
    if dtype == torch.bfloat16:
        return probe_cpu_paths().bf16.path != "none"
    return dtype == torch.float32


def pack_weight(weight: torch.Tensor, kind: str) -> PackedWeight | None:
    """``weight`` packed by the packer named ``kind``, or None where it does not take it."""
    return PACKERS[kind].pack(weight)


def _seconds(packed: PackedWeight, x: torch.Tensor) -> float:
    """One timed call (the caller makes an untimed one first)."""
    with torch.inference_mode():
        start = time.perf_counter()
        packed(x, None)
        return time.perf_counter() - start


def resolve(kind: str, sample: torch.Tensor) -> str | None:
    """The packer to use: ``kind`` itself, or for ``auto`` the faster on ``sample`` (a weight of
    the model), best of :data:`CALIBRATION_REPS` alternating rounds, ``native`` kept unless another
    beats it by :data:`NATIVE_MARGIN` (its panels also run the one-call decode, float32 only).
    None where no packer takes a CPU weight of its dtype (then ``F.linear`` runs)."""
    if kind != "auto":
        return kind if kind in PACKERS and PACKERS[kind].packs_dtype(sample.dtype) else None
    x = torch.randn(CALIBRATION_ROWS, sample.shape[1], dtype=sample.dtype)
    packs = {name: packed for name, packer in PACKERS.items() if (packed := packer.pack(sample)) is not None}
    if not packs:
        return None
    with torch.inference_mode():
        for packed in packs.values():
            packed(x, None)
    timed = dict.fromkeys(packs, float("inf"))
    for _ in range(CALIBRATION_REPS):
        for name, packed in packs.items():
            timed[name] = min(timed[name], _seconds(packed, x))
    choice = min(timed, key=timed.__getitem__)
    if "native" in timed and timed["native"] <= timed[choice] * NATIVE_MARGIN:
        choice = "native"
    figures = ", ".join(f"{name} {seconds * 1e3:.2f} ms" for name, seconds in timed.items())
    log.info(
        "weight packing auto: %s (%d rows x %s weight: %s)",
        choice,
        CALIBRATION_ROWS,
        tuple(sample.shape),
        figures,
    )
    return choice
