"""Which quantisation a Hugging Face checkpoint already carries (its config.json), if any.

Where it sits: the engine's quantization config (``config.py`` beside it) asks
:func:`checkpoint_quantization` of a Hugging Face folder before anything is loaded, and
``engine/loader/hf_quant.py`` loads what it names as it is. Two formats of
compressed-tensors (``quantization_config.quant_method == "compressed-tensors"``, llm-compressor's
output) are taken: FP8 (``float-quantized``, float8_e4m3fn weights) and W8A8 int8
(``int-quantized``), 8-bit symmetric weights with a per-channel (or per-tensor) ``weight_scale``;
any other scheme (4-bit packed, group scales, asymmetric) is refused naming what it found. vLLM's
``quant_method: fp8`` checkpoints (per-tensor or per-channel ``weight_scale``) read as FP8 too.
Torch-free: it reads JSON.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

from kvfleet.engine.errors import ModelLoadError

Scheme = Literal["int8", "fp8"]


def checkpoint_quantization(folder: Path) -> Scheme | None:
    """``"fp8"`` or ``"int8"`` for a compressed-tensors checkpoint of those schemes, None for floats."""
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return None  # the loader names a missing or broken config.json
    return scheme_of(config.get("quantization_config"), folder)


def checkpoint_source(folder: Path, scheme: Scheme) -> str:
    """The checkpoint's quantisation in words, for logs and refusals: ``compressed-tensors int8
    checkpoint``, or ``fp8 checkpoint (quant_method fp8)``."""
    qc = json.loads((folder / "config.json").read_text()).get("quantization_config") or {}
    method = qc.get("quant_method")
    return (
        f"compressed-tensors {scheme} checkpoint"
        if method == "compressed-tensors"
        else f"{scheme} checkpoint (quant_method {method})"
    )


def scheme_of(qc: Any, where: Path | str) -> Scheme | None:
    """The scheme of a ``quantization_config`` mapping (None: no quantisation)."""
    if not isinstance(qc, dict):
        return None
    method = qc.get("quant_method")
    if method == "mxfp4":  # gpt-oss's experts: dequantised at load by loader/mxfp4.py, served as floats
        return None
    if method == "fp8":
        return _fp8_scheme(qc, where)
    if method != "compressed-tensors":
        raise ModelLoadError(
            f"{where}: quantization_config.quant_method {method!r} is not served; "
            "compressed-tensors FP8 and W8A8 int8 checkpoints and fp8 ones are (or --quantization int8 on floats)"
        )
    schemes = {_group_scheme(g, where) for g in (qc.get("config_groups") or {}).values()}
    if len(schemes) != 1:
        raise ModelLoadError(
            f"{where}: compressed-tensors config_groups must name one 8-bit scheme, got {schemes}"
        )
    return schemes.pop()


def _fp8_scheme(qc: dict[str, Any], where: Path | str) -> Scheme:
    """vLLM's ``fp8`` checkpoints (AutoFP8, llm-compressor's older output): e4m3 ``weight`` with a
    per-tensor or per-channel ``weight_scale``; block-wise scales (``weight_block_size``) are refused."""
    if qc.get("weight_block_size") is not None:
        raise ModelLoadError(
            f"{where}: fp8 weight_block_size {qc['weight_block_size']} (block-wise scales) is not served; "
            "per-tensor or per-channel fp8 is"
        )
    return "fp8"


def _group_scheme(group: Any, where: Path | str) -> Scheme:
    weights = group.get("weights") if isinstance(group, dict) else None
    if not isinstance(weights, dict):
        raise ModelLoadError(f"{where}: a compressed-tensors config group has no 'weights'")
    kind, bits = weights.get("type"), weights.get("num_bits")
    strategy, symmetric = weights.get("strategy"), weights.get("symmetric", True)
    if bits != 8 or kind not in ("int", "float") or strategy not in ("channel", "tensor") or not symmetric:
        raise ModelLoadError(
            f"{where}: compressed-tensors weights {kind} {bits}-bit, strategy {strategy}, symmetric {symmetric} "
            "are not served; 8-bit int or float, per channel or per tensor, symmetric are"
        )
    return "fp8" if kind == "float" else "int8"
