"""``--dtype auto`` resolved, as vLLM does, from the checkpoint's own dtype against the device.

Where it sits: ``engine/runner/model_runner.py`` calls :func:`checkpoint_dtype` (reads the checkpoint:
config.json, or a GGUF's tensor types) and :func:`resolve_dtype` (pure) once, before any weight is
read, and logs :meth:`DtypeChoice.line` as the start-up line. The rule (docs/engine/model-and-quantization.md):

- an explicit ``--dtype`` is served as asked;
- on a GPU, ``auto`` is bfloat16 (as before);
- on the CPU, a 16-bit checkpoint (bfloat16, or float16, which the CPU has no fast path for) is served
  in bfloat16 where the start-up line's ``bf16:`` path is ``amx`` (AMX-BF16 listed and the tile
  permission granted) or ``avx512_bf16``, and in float32 where the CPU has neither (bf16 matmuls
  would be emulated, slower than float32); a float32 checkpoint, or one whose config names no dtype,
  stays float32;
- a quantized checkpoint (a GGUF whose layer linears are blocks such as Q4_1 or Q8_0, whether served
  in its blocks or dequantized, as ``smollm2`` is; a compressed-tensors int8 or fp8 checkpoint; any
  ``--quantization``) keeps what ``auto`` was before: float32 on the CPU, where the GGUF and int8
  kernels compute.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from kvfleet.engine.config import EngineConfig
from kvfleet.engine.kernels.native.cpu_features import CpuPaths, probe_cpu_paths
from kvfleet.engine.loader.sources import SMOLLM2, gguf_source, smollm2_gguf

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
SIXTEEN_BIT = ("bfloat16", "float16")
# the float tensor types a GGUF's layer linears may hold, and the dtype each is
GGUF_FLOATS = {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}


@dataclass(frozen=True, slots=True)
class CheckpointDtype:
    """What a checkpoint's weights are: ``dtype`` a float dtype's name (None where config.json names
    none), or ``quantized`` the format in words (``GGUF Q4_1 blocks``, ``--quantization int8``)."""

    dtype: str | None
    quantized: str | None = None

    def __str__(self) -> str:
        if self.quantized is not None:
            return f"checkpoint quantized ({self.quantized})"
        return f"checkpoint {self.dtype}" if self.dtype is not None else "checkpoint names no dtype"


@dataclass(frozen=True, slots=True)
class DtypeChoice:
    """The dtype the engine computes in, and why (the start-up line's words)."""

    dtype: torch.dtype
    reason: str
    requested: str = "auto"

    @property
    def name(self) -> str:
        return str(self.dtype).removeprefix("torch.")

    def line(self) -> str:
        """The start-up line: ``dtype auto -> bfloat16: checkpoint bfloat16, cpu amx_bf16 (permission granted)``."""
        return f"dtype {self.requested} -> {self.name}: {self.reason}"


def cpu_path(paths: CpuPaths) -> str:
    """The ISA path bf16 would run on: ``amx`` or ``avx512_bf16``, else the best vector tier (``avx2``)."""
    return paths.bf16.path if paths.bf16.path != "none" else paths.isa


def resolve_dtype(
    requested: str, checkpoint: CheckpointDtype, device: torch.device, cpu_paths: CpuPaths | None
) -> DtypeChoice:
    """The dtype for ``--dtype requested`` (the module docstring's rule); ``cpu_paths`` is the CPU's
    probe, needed (not None) where ``device`` is the CPU."""
    cpu = None if device.type != "cpu" or cpu_paths is None else cpu_paths
    on = f"cpu path {cpu_path(cpu)}" if cpu is not None else f"device {device.type}"
    if requested != "auto":
        if requested not in DTYPES:
            raise ValueError(f"dtype: {requested!r} is not one of auto, {', '.join(DTYPES)}")
        return DtypeChoice(DTYPES[requested], f"asked, {on}", requested)
    if device.type != "cpu":
        return DtypeChoice(torch.bfloat16, f"{checkpoint}, {on}: bfloat16 on a GPU")
    if cpu is None:
        raise ValueError("resolve_dtype: the CPU's paths (probe_cpu_paths()) are needed on the CPU")
    if checkpoint.quantized is not None:
        return DtypeChoice(torch.float32, f"{checkpoint}: its CPU kernels compute in float32, {on}")
    if checkpoint.dtype not in SIXTEEN_BIT:
        return DtypeChoice(torch.float32, f"{checkpoint} kept, {on}")
    bf16 = cpu.bf16
    if bf16.path == "amx":
        return DtypeChoice(torch.bfloat16, f"{checkpoint}, cpu amx_bf16 (permission granted)")
    if bf16.path == "avx512_bf16":
        note = f" ({bf16.note})" if bf16.note else ""
        return DtypeChoice(torch.bfloat16, f"{checkpoint}, cpu avx512_bf16{note}")
    return DtypeChoice(
        torch.float32, f"{checkpoint}, but the cpu has no amx_bf16 or avx512_bf16 (best tier {cpu.isa})"
    )


def pick_dtype(config: EngineConfig, device: torch.device, folder: Path) -> DtypeChoice:
    """The runner's dtype for ``config.dtype`` on ``device``, the model resolved to ``folder``: the
    checkpoint is read only for ``auto``. A ``bfloat16`` float checkpoint on a CPU keeps bf16 weights on
    ``kernels/native/bf16_gemm.py`` (``layers/linear/bf16.py``: AMX tiles, AVX512-BF16, or the portable
    path that widens bf16 to float32), activations in float32; on a CPU with neither bf16 ISA (``bf16:
    none``) only an explicit one is served, with the runner's warning."""
    paths = probe_cpu_paths() if device.type == "cpu" else None
    asked = config.dtype
    checkpoint = (
        CheckpointDtype(None)
        if asked != "auto"
        else checkpoint_dtype(config.model, folder, config.quantization)
    )
    return resolve_dtype(asked, checkpoint, device, paths)


def checkpoint_dtype(model: str, folder: Path, quantization: str | None) -> CheckpointDtype:
    """What ``--model model``, resolved to ``folder``, holds: a GGUF's layer linears (``smollm2``, a
    .gguf file or a folder of one), else ``folder``'s config.json; ``quantization`` the flag."""
    if quantization is not None:
        return CheckpointDtype(None, f"--quantization {quantization}")
    gguf = smollm2_gguf() if model == SMOLLM2 else gguf_source(Path(model).expanduser())
    if gguf is not None:
        return gguf_dtype(gguf)
    try:
        raw = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return CheckpointDtype(None)  # the loader names a missing or broken config.json
    scheme = (raw.get("quantization_config") or {}).get("quant_method")
    if scheme is not None:
        return CheckpointDtype(None, f"{scheme} checkpoint")
    text = raw.get("text_config") or {}
    named = raw.get("torch_dtype") or raw.get("dtype") or text.get("torch_dtype") or text.get("dtype")
    return CheckpointDtype(named if isinstance(named, str) else None)


def gguf_dtype(path: Path) -> CheckpointDtype:
    """A GGUF file's layer linears: blocks (quantized, named by type), or the one float type they share."""
    from gguf import GGUFReader  # numpy and gguf: only for a GGUF model

    types = {
        t.tensor_type.name for t in GGUFReader(path).tensors if t.name.startswith("blk.") and len(t.shape) > 1
    }
    blocks = sorted(types - set(GGUF_FLOATS))
    if blocks:
        return CheckpointDtype(None, f"GGUF {'/'.join(blocks)} blocks")
    floats = sorted(types)
    if len(floats) == 1:
        return CheckpointDtype(GGUF_FLOATS[floats[0]])
    return CheckpointDtype("float32" if "F32" in types else None)
