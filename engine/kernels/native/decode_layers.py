"""Every decoder layer of a step in one native call (``csrc/decode_layers.c``).

Where it sits: ``engine/model/fused_layers.py`` gathers a Llama model's per-layer operands into
:class:`LayerOperands` once and calls :meth:`NativeDecodeLayers.run` from the model's forward for a
step of decode rows and prompt chunks; the C side runs the per-op path's own kernels (this
library's norm, matmul, RoPE, attention and SiLU*up) back to back, so its result is that path's,
bit for bit, without Python and torch's dispatch between the ops. This module is the typed
boundary: the structs C reads and the pointers it is given, nothing about which model or when.
"""

from __future__ import annotations

import ctypes
import functools
from typing import NamedTuple

import torch

from kvfleet.engine.kernels.native.build import library
from kvfleet.engine.kernels.native.quant_gemm import check_quant_status

_WEIGHTS: tuple[str, ...] = ("input_norm", "post_norm", "qkv", "qkv_bias", "o", "o_bias", "gate_up")
_WEIGHTS += ("gate_up_bias", "down", "down_bias")


_TYPES = ("qkv_type", "o_type", "gate_up_type", "down_type")
_SCALES = ("qkv_scale", "o_scale", "gate_up_scale", "down_scale")
QUANT_FAILED = 100  # decode_layers.c: a status above it is QUANT_FAILED - the quantised kernel's status
INT8_CHANNEL = 256  # decode_layers.c's type of int8_gemm.c's per-channel int8 weights (not a ggml type)
BF16_PANELS = 257  # decode_layers.c's type of bf16_gemm.c's bf16 panels (a bf16 model on the CPU)


class _Layer(ctypes.Structure):
    _fields_ = (
        [(name, ctypes.c_void_p) for name in (*_WEIGHTS, "k_cache", "v_cache")]
        + [("scale", ctypes.c_float)]
        + [(name, ctypes.c_int32) for name in ("window", *_TYPES)]
        + [(name, ctypes.c_void_p) for name in _SCALES]
    )


_SHAPES = ("rows", "hidden", "heads", "kv_heads", "head_dim", "intermediate", "table_stride")
_STEP_POINTERS = ("cos", "sin", "slots", "seqs", "block_tables", "seq_lens", "query_start")
_SCRATCH = ("h", "o", "qkv", "q", "attn", "gate_up", "act")


class _Step(ctypes.Structure):
    _fields_ = (
        [(name, ctypes.c_int64) for name in _SHAPES]
        + [(name, ctypes.c_int32) for name in ("block_size", "packed", "threads")]
        + [("eps", ctypes.c_float)]
        + [("quant_path", ctypes.c_int32)]
        + [(name, ctypes.c_void_p) for name in _STEP_POINTERS + _SCRATCH]
        + [(name, ctypes.c_int64) for name in ("num_decode_seqs", "num_prefill_seqs", "num_keep")]
        + [(name, ctypes.c_void_p) for name in ("prefill_seqs", "keep")]
    )


class LayerOperands(NamedTuple):
    """One layer's weights as the C side reads them: the native GEMM's panels (``packed``) or
    (out, in) row-major matrices, contiguous float32, or where ``types`` gives a matmul's ggml
    type (qkv, o, gate_up, down; 0: float32), its GGUF blocks as ``quant_pack.c`` repacked them
    (uint8), with :data:`INT8_CHANNEL`, (out, in) int8 rows and their ``scales`` (out,)
    float32, or with :data:`BF16_PANELS`, ``bf16_gemm.py``'s panels (bf16); a bias may be None."""

    input_norm: torch.Tensor
    post_norm: torch.Tensor
    qkv: torch.Tensor
    qkv_bias: torch.Tensor | None
    o: torch.Tensor
    o_bias: torch.Tensor | None
    gate_up: torch.Tensor
    gate_up_bias: torch.Tensor | None
    down: torch.Tensor
    down_bias: torch.Tensor | None
    scale: float
    window: int | None
    types: tuple[int, int, int, int] = (0, 0, 0, 0)
    scales: tuple[torch.Tensor | None, ...] = (None, None, None, None)


class LayerGeometry(NamedTuple):
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    eps: float
    packed: bool  # the weights are packed_gemm.c panels (else row-major, for the few-row kernel)
    quant_path: int = (
        0  # the quantised kernel's path number (quant_gemm.PATHS, GGUF or int8; bf16_gemm.PATHS)
    )
    max_rows: int | None = None  # the most rows a step may have (the per-op path's kernels change above)


class NativeStepInputs(NamedTuple):
    """The step's per-row inputs, in the dtypes and layouts the attention kernels take."""

    cos: torch.Tensor  # (rows, head_dim) float32
    sin: torch.Tensor
    slots: torch.Tensor  # (rows,) int64: each row's cache slot
    seqs: torch.Tensor | None  # int64: the decoding sequences (one row each), None: none
    block_tables: torch.Tensor  # (num_seqs, max_blocks) int32, rows contiguous
    seq_lens: torch.Tensor  # (num_seqs,) int32
    query_start: torch.Tensor  # (num_seqs + 1,) int32
    prefills: torch.Tensor | None = None  # int64: the sequences with a prompt chunk, None: none
    keep: torch.Tensor | None = None  # int64, ascending: the rows the last layer keeps; None: all


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


class NativeDecodeLayers:
    """``decode_layers_f32`` over a fixed list of layers; caches bound by :meth:`bind_caches` each step."""

    def __init__(self, lib: ctypes.CDLL, geometry: LayerGeometry, layers: list[LayerOperands]) -> None:
        self._fn = lib.decode_layers_f32
        self._fn.argtypes = [ctypes.POINTER(_Step), ctypes.POINTER(_Layer), ctypes.c_int64]
        self._fn.argtypes += [ctypes.c_void_p, ctypes.c_void_p]
        self._fn.restype = ctypes.c_int
        self.geometry = geometry
        self.operands = layers  # held: the structs point into these tensors
        self._layers = (_Layer * len(layers))()
        for slot, op in zip(self._layers, layers, strict=True):
            for name in _WEIGHTS:
                setattr(slot, name, _ptr(getattr(op, name)))
            slot.scale, slot.window = op.scale, op.window or 0
            for name, kind in zip(_TYPES, op.types, strict=True):
                setattr(slot, name, kind)
            for name, scale in zip(_SCALES, op.scales, strict=True):
                setattr(slot, name, _ptr(scale))

    def bind_caches(self, kv_caches: list[torch.Tensor]) -> None:
        """Point each layer at its (2, num_blocks, block_size, kv_heads, head_dim) cache (every
        step: a few microseconds, and a cache reallocated in place of another is never missed)."""
        for slot, cache in zip(self._layers, kv_caches, strict=True):
            slot.k_cache, slot.v_cache = cache[0].data_ptr(), cache[1].data_ptr()

    def run(
        self, x: torch.Tensor, step: NativeStepInputs, block_size: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(the last layer's MLP output, the residual stream before it) for the embeddings ``x``
        (rows, hidden), at the rows ``step.keep`` (all rows if None): what the per-op path's layer
        loop returns. ``x`` is overwritten."""
        g, rows = self.geometry, x.shape[0]
        residual = torch.empty_like(x)
        widths = {"h": g.hidden, "o": g.hidden, "qkv": (g.heads + 2 * g.kv_heads) * g.head_dim}
        widths |= {"q": g.heads * g.head_dim, "attn": g.heads * g.head_dim}
        widths |= {"gate_up": 2 * g.intermediate, "act": g.intermediate}
        scratch = {name: x.new_empty(rows, width) for name, width in widths.items()}
        s = _Step(
            rows=rows,
            hidden=g.hidden,
            heads=g.heads,
            kv_heads=g.kv_heads,
            head_dim=g.head_dim,
            intermediate=g.intermediate,
            table_stride=step.block_tables.stride(0),
            block_size=block_size,
            packed=int(g.packed),
            threads=torch.get_num_threads(),
            eps=g.eps,
            quant_path=g.quant_path,
        )
        for name, tensor in zip(_STEP_POINTERS, step, strict=False):
            setattr(s, name, _ptr(tensor))
        for name, tensor in scratch.items():
            setattr(s, name, tensor.data_ptr())
        s.num_decode_seqs = 0 if step.seqs is None else step.seqs.numel()
        s.num_prefill_seqs = 0 if step.prefills is None else step.prefills.numel()
        s.prefill_seqs, s.keep = _ptr(step.prefills), _ptr(step.keep)
        s.num_keep = rows if step.keep is None else step.keep.numel()
        status = self._fn(
            ctypes.byref(s), self._layers, len(self.operands), x.data_ptr(), residual.data_ptr()
        )
        if status > QUANT_FAILED:
            check_quant_status(QUANT_FAILED - status, "the one-call decode's quantised matmul")
        if status != 0:
            longest = int(step.seq_lens.max())
            raise MemoryError(f"the CPU attention kernels could not allocate scratch for {longest} keys")
        return (x, residual) if step.keep is None else (x[: s.num_keep], residual[: s.num_keep])


@functools.cache
def load_decode_layers() -> ctypes.CDLL | None:
    """The native library (None where it does not build: the per-op path runs then)."""
    return library()
