"""The one quantization config of an engine: which linear method every layer gets, and why.

Where it sits: ``ModelRunner`` calls :func:`resolve_quantization` once, first, before it starts a
tensor-parallel worker or reads a weight; the config then picks the loader
(``loader/registry.py``, by :attr:`QuantizationConfig.loader`) and names the
``layers/linear`` method the loader hands every linear to. As vLLM infers it, the checkpoint says
what it is: a GGUF ``--model`` (a .gguf file, or a folder holding one) is served in its blocks, a
Hugging Face folder whose config.json carries a compressed-tensors scheme in that scheme
(``checkpoint.py``), anything else in floats; ``--quantization`` overrides where it
can (``int8``/``fp8`` quantise a float checkpoint at load, ``gguf`` serves the ``smollm2`` alias's
file in blocks) and a combination that cannot be served is a :class:`ModelLoadError` naming it.
A float checkpoint in ``--dtype bfloat16`` on the CPU gets the ``bf16`` method where the native
library builds (:func:`bf16_config`: bf16 weights, float32 compute, ``layers/linear/bf16.py``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
from gguf import GGUFReader

from kvfleet.engine.errors import ModelLoadError
from kvfleet.engine.kernels.fp8_linear import fp8_supported
from kvfleet.engine.kernels.native.bf16_gemm import load_bf16
from kvfleet.engine.kernels.native.quant_gemm import BLOCK_LAYOUTS
from kvfleet.engine.layers.linear.base import LinearMethod, get_method
from kvfleet.engine.layers.linear.checkpoint import Scheme, checkpoint_quantization, checkpoint_source

log = logging.getLogger(__name__)
Flag = Literal["gguf", "int8", "fp8"]
Stored = Literal["float", "gguf", "int8", "fp8"]  # how the checkpoint holds its linears
Target = Literal["int8", "fp8", "float"]
FP8_ON_CPU = (
    "--quantization fp8 needs a GPU of compute capability >= 8.9 (torch._scaled_mm on e4m3); "
    "on the CPU use --quantization int8 (any Hugging Face checkpoint) or gguf (a .gguf model)"
)


@dataclass(frozen=True, slots=True)
class QuantizationConfig:
    """``method``: the registered linear method of every layer matmul (``float``, ``gguf``,
    ``int8``, ``fp8``, ``bf16``); ``stored``: how the checkpoint holds the linears; ``source``: why, in words
    (logged, and named by every refusal); ``gguf_file``: the blocks' file for ``gguf``."""

    method: str
    stored: Stored
    source: str
    gguf_file: Path | None = None

    @property
    def quantized(self) -> bool:
        """Whether the linears are read or served other than as plain floats (a quantised loader)."""
        return self.method != "float" or self.stored != "float"

    @property
    def quantizes_floats(self) -> bool:
        """Float weights quantised at load (``--quantization int8``/``fp8`` on a float checkpoint)."""
        return self.stored == "float" and self.method != "float"

    @property
    def loader(self) -> str:
        """The loader registered by this name in ``loader/registry.py``."""
        if self.stored == "gguf":
            return "gguf"
        return "quantized" if self.quantized else "float"

    @property
    def prepacks(self) -> bool:
        """Whether the loaded weights may be packed for a GEMM library after loading: a float
        checkpoint served by a method that packs (a quantised loader resolves every matmul itself)."""
        return not self.quantized and get_method(self.method).prepacks

    def linear_method(self, dtype: torch.dtype) -> LinearMethod:
        return get_method(self.method, dtype)

    def compute_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """What the model's activations, norms and KV cache are held in for the engine's ``dtype``:
        float32 under the ``bf16`` method (only its weights are bf16), else ``dtype`` itself."""
        return torch.float32 if self.method == "bf16" else dtype

    def check_serves(self, device: torch.device, dtype: torch.dtype) -> None:
        """Refuse, before a tensor-parallel worker starts, what this config cannot serve on ``device``
        in ``dtype``, naming its source: GGUF blocks run on the CPU kernels in float32 only. Every
        loader shards (each method cutting its own weights: ``LinearMethod.shard``), and LoRA wraps
        every method: its delta is added to the matmul's output, whatever kernel made it
        (``lora/context.py``)."""
        if self.loader == "gguf" and (device.type != "cpu" or dtype != torch.float32):
            raise ModelLoadError(
                f"quantization {self.method!r} ({self.source}) runs on the CPU kernels in float32; "
                f"got device {device}, dtype {dtype}"
            )


FLOAT = QuantizationConfig("float", "float", "a float checkpoint")


@dataclass(frozen=True, slots=True)
class GgufModel:
    """The GGUF file ``--model`` names (``loader/gguf_loader.py``'s ``gguf_model``): by path
    (``by_path``: a .gguf, a folder of one), or by an alias (``smollm2``: float unless asked)."""

    file: Path
    by_path: bool


def resolve_quantization(
    flag: str | None,
    folder: Path,
    device: torch.device,
    dtype: torch.dtype,
    gguf: GgufModel | None = None,
) -> QuantizationConfig:
    """The config for ``--quantization flag`` (None: inferred) on a model resolved to ``folder`` (a
    Hugging Face folder; a GGUF's conversion) that names ``gguf``, computing in ``dtype`` on
    ``device`` (over any number of tensor-parallel ranks: every loader shards)."""
    # Invariant: the flag decides only where it names what the checkpoint is, or the checkpoint is
    # float; a GGUF model named by path without the flag is served in its blocks where they run.
    if flag == "gguf":
        if gguf is None:
            raise ModelLoadError(
                f"{folder}: --quantization gguf serves a GGUF checkpoint (a .gguf file or smollm2); "
                "this is a Hugging Face folder"
            )
        return QuantizationConfig("gguf", "gguf", "--quantization gguf", gguf.file)
    if flag not in (None, "int8", "fp8"):
        raise ModelLoadError(f"--quantization {flag!r} is not served; gguf, int8 and fp8 are")
    if flag is None and gguf is not None and gguf.by_path:
        return _detected_gguf(gguf.file, device, dtype)
    scheme = checkpoint_quantization(folder)
    if flag is None and scheme is None:
        return bf16_config(device, dtype) or FLOAT
    method = serving_target(flag, scheme, device)
    source = f"--quantization {flag}" if scheme is None else checkpoint_source(folder, scheme)
    return QuantizationConfig(method, scheme or "float", source)


def _detected_gguf(path: Path, device: torch.device, dtype: torch.dtype) -> QuantizationConfig:
    """A GGUF ``--model`` without the flag: in its blocks where any layer linear is in a block format
    the kernel takes and it runs here (the CPU, float32, on any number of ranks); a float GGUF (F32,
    F16) is a float checkpoint, and elsewhere its conversion is served in floats, as before the
    detection."""
    if not gguf_holds_blocks(path):
        return FLOAT
    if device.type == "cpu" and dtype == torch.float32:
        return QuantizationConfig("gguf", "gguf", f"GGUF file {path.name}", path)
    log.warning(
        "GGUF file %s on %s in %s: its blocks run on the CPU kernels in float32 only; dequantised at load",
        path.name,
        device,
        dtype,
    )
    return FLOAT


def gguf_holds_blocks(path: Path) -> bool:
    """Whether a layer linear of the GGUF file ``path`` is stored in a block format the kernel takes."""
    tensors = GGUFReader(path).tensors
    return any(t.name.startswith("blk.") and int(t.tensor_type) in BLOCK_LAYOUTS for t in tensors)


def bf16_config(device: torch.device, dtype: torch.dtype) -> QuantizationConfig | None:
    """The ``bf16`` method for a float checkpoint in bfloat16 on the CPU where the native bf16 kernel
    builds (its path named); None elsewhere (the GPU, no compiler: the all-bf16 torch path)."""
    if device.type != "cpu" or dtype != torch.bfloat16:
        return None
    native = load_bf16()
    if native is None:
        return None
    return QuantizationConfig("bf16", "float", f"--dtype bfloat16 on the CPU: bf16 weights on {native.path}")


def serving_target(flag: str | None, scheme: Scheme | None, device: torch.device) -> Target:
    """What the linears become for ``--quantization flag``, the checkpoint's ``scheme``, on ``device``."""
    if flag is not None and scheme is not None and flag != scheme:
        raise ModelLoadError(f"--quantization {flag} asked of a compressed-tensors {scheme} checkpoint")
    want = flag or scheme
    if want == "int8":
        if device.type == "cpu":
            return "int8"
        if scheme is None:
            raise ModelLoadError(
                "--quantization int8 runs on the CPU kernels; on a GPU use --quantization fp8"
            )
        log.warning("int8 checkpoint on %s: no int8 GPU kernel, weights dequantised at load", device)
        return "float"
    if fp8_supported(device):
        return "fp8"
    if scheme is None:
        raise ModelLoadError(FP8_ON_CPU)
    log.warning(
        "fp8 checkpoint on %s (fp8 matmuls need a GPU of compute capability >= 8.9): dequantised at load",
        device,
    )
    return "float"
