"""MXFP4 expert weights (gpt-oss checkpoints): dequantized to the compute dtype at load.

Where it sits: the float loader (``loader/hf_loader.py``) asks :func:`packed_tensors` which of a
checkpoint's tensors are stored as ``<name>_blocks`` + ``<name>_scales`` (``quantization_config``
``quant_method: mxfp4``: gpt-oss's ``mlp.experts.gate_up_proj`` and ``down_proj``) and reads each
through :func:`read_packed`, which gives ``<name>`` as the float checkpoint holds it. The model never
sees the packed form: its experts compute in the model dtype (``layers/moe/grouped.py``).

The format (OCP microscaling, as transformers' ``integrations/mxfp4.py`` reads it): along each
row, every 32 values share one scale byte, an e8m0 exponent (2^(byte - 127)); each value is a
4-bit e2m1 float (sign, 2 exponent bits, 1 mantissa bit: 0, 0.5, 1, 1.5, 2, 3, 4, 6), two a byte,
the even-indexed value in the low nibble. ``blocks``: (..., rows, G, 16) uint8, ``scales``:
(..., rows, G) uint8, G = columns / 32. gpt-oss stores each expert matrix as (out, in) rows;
the float checkpoint's tensor is its transpose, (E, in, out). :func:`pack` is the inverse (round
to the nearest e2m1 value under the group's scale), used to write test checkpoints.
"""

from __future__ import annotations

from typing import Any

import torch

# e2m1 codes 0..15: the value of each nibble (bit 3 is the sign).
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
GROUP = 32  # values per scale
SCALE_BIAS = 127  # e8m0: the exponent is the byte minus this


def dequantize(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(..., G, 16) uint8 blocks and (..., G) uint8 scales → (..., G * 32) values in ``dtype``."""
    # Invariant: value 2j of a group is the low nibble of byte j, value 2j + 1 its high nibble,
    # each times 2^(scale - 127), exact in float32 (and in bfloat16: 2 mantissa bits suffice).
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"mxfp4 blocks and scales must be uint8, got {blocks.dtype} and {scales.dtype}")
    if blocks.shape[-1] != GROUP // 2 or tuple(blocks.shape[:-1]) != tuple(scales.shape):
        raise ValueError(
            f"mxfp4 blocks {tuple(blocks.shape)} must be scales' shape {tuple(scales.shape)} + (16,)"
        )
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32)
    codes = torch.stack((blocks & 0x0F, blocks >> 4), dim=-1).flatten(-2).long()  # (..., G, 32)
    values = torch.ldexp(lut[codes], (scales.to(torch.int32) - SCALE_BIAS)[..., None].float())
    return values.flatten(-2).to(dtype)


def pack(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(..., K) floats, K a multiple of 32 → (blocks, scales): each group scaled by the smallest
    power of two that brings its largest magnitude to at most 6, each value to the nearest e2m1."""
    if values.shape[-1] % GROUP:
        raise ValueError(f"mxfp4 packs rows of a multiple of {GROUP} values, got {values.shape[-1]}")
    groups = values.float().unflatten(-1, (-1, GROUP))
    peak = groups.abs().amax(dim=-1).clamp(min=2.0**-126)
    exponent = torch.ceil(torch.log2(peak / 6.0)).clamp(-SCALE_BIAS, SCALE_BIAS).to(torch.int32)
    scaled = groups / torch.ldexp(torch.ones_like(peak), exponent)[..., None]
    lut = torch.tensor(FP4_VALUES[:8])
    magnitude = (scaled.abs()[..., None] - lut).abs().argmin(dim=-1)  # nearest of 0 .. 6
    codes = (magnitude | ((scaled < 0).long() << 3)).to(torch.uint8)
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return blocks, (exponent + SCALE_BIAS).to(torch.uint8)


def checkpoint_tensor(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The float checkpoint's expert tensor, (E, in, out), from its packed (E, out, G, 16) rows."""
    return dequantize(blocks, scales, dtype).transpose(1, 2).contiguous()


def packed_tensors(names: Any) -> dict[str, tuple[str, str]]:
    """``{name: (name_blocks, name_scales)}`` for each tensor stored packed among ``names``."""
    found = set(names)
    return {
        n.removesuffix("_blocks"): (n, n.removesuffix("_blocks") + "_scales")
        for n in found
        if n.endswith("_blocks") and n.removesuffix("_blocks") + "_scales" in found
    }


def read_packed(f: Any, names: tuple[str, str], dtype: torch.dtype) -> torch.Tensor:
    """The float tensor of the packed pair ``names`` (blocks, scales) of the open safetensors ``f``."""
    return checkpoint_tensor(f.get_tensor(names[0]), f.get_tensor(names[1]), dtype)
