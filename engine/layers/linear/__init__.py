"""Linear layers in every weight format behind one interface (``base.LinearMethod``).

Where it sits: ``engine/model`` builds the decoder; its loaders ask :func:`resolve_quantization`'s
config for the method of every matmul, one module per format: ``unquantized`` (float),
``packed`` (float with a GEMM library's packed copy), ``int8``, ``gguf_blocks`` (GGUF blocks),
``fp8``, ``bf16`` (bf16 weights, float32 compute, on the CPU). Importing the package registers them all by name.
"""

from kvfleet.engine.layers.linear import bf16, fp8, gguf_blocks, int8, packed, unquantized
from kvfleet.engine.layers.linear.base import (
    LinearKernel,
    LinearMethod,
    NativeOperand,
    get_method,
    native_operand,
    register,
    registered,
)
from kvfleet.engine.layers.linear.config import QuantizationConfig, resolve_quantization

__all__ = [
    "LinearKernel",
    "LinearMethod",
    "NativeOperand",
    "QuantizationConfig",
    "bf16",
    "fp8",
    "get_method",
    "gguf_blocks",
    "int8",
    "native_operand",
    "packed",
    "register",
    "registered",
    "resolve_quantization",
    "unquantized",
]
