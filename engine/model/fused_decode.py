"""Which steps run all their decoder layers in one native call, and with which operands.

Where it sits: ``LlamaForCausalLM.forward`` asks :meth:`FusedDecode.run` first; it returns the
layer loop's result through ``kernels/native/decode_layers.py`` (``csrc/decode_layers.c``), or None,
and the per-op loop runs. The call runs the per-op path's own kernels in its order, so it
only takes a step where that path would run exactly those kernels: float32 on the CPU, the
``cpu`` attention backend, decode rows and prompt chunks (the chunks only where the backend runs
them on the native prefill kernel, not SDPA; the last layer past its attention at the sampling rows
only, as the per-op path prunes it), no LoRA, and every matmul on the native GEMM (weights packed
``native``), unpacked on the few-row kernel (at most ``SKINNY_MAX_ROWS`` rows), or for a quantised
model every layer matmul on the native quantised kernel: ``--quantization gguf``'s
:class:`QuantLinear` (any number of rows), or
``int8``'s :class:`Int8Linear` below ``ONEDNN_MIN_ROWS`` rows (from there the per-op path's
matmuls are oneDNN's). Anything else is the per-op path's, as before.

Built once per model from its weights after ``prepack`` (which drops it to be built again):
a weight replaced afterwards in place of the tensor is not seen.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import torch

from kvfleet.engine.attention import AttentionBackend, AttentionMetadata
from kvfleet.engine.attention.checks import check_cache, check_forward, check_paged_bounds
from kvfleet.engine.attention.cpu_backend import CpuAttentionBackend
from kvfleet.engine.kernels.int8_linear import ONEDNN_MIN_ROWS, Int8Linear
from kvfleet.engine.kernels.native.decode_layers import (
    INT8_CHANNEL,
    Geometry,
    LayerOperands,
    NativeDecodeLayers,
    StepInputs,
    load_decode_layers,
)
from kvfleet.engine.kernels.native.quant_gemm import PATHS
from kvfleet.engine.kernels.native.skinny_gemm import SKINNY_MAX_ROWS
from kvfleet.engine.kernels.packing.native import NativePackedWeight
from kvfleet.engine.kernels.quant_linear import QuantLinear


def _f32(t: torch.Tensor | None) -> bool:
    return t is None or (t.dtype == torch.float32 and t.device.type == "cpu" and t.is_contiguous())


def _quant_operands(layer: Any) -> tuple[LayerOperands, str] | None:
    """A quantised layer's operands (the loaders' ``fixed`` matmuls: all four a native
    :class:`QuantLinear` of GGUF blocks, or all a native :class:`Int8Linear`), with the kernel
    path they run on; None where they are not."""
    attn, mlp = layer.self_attn, layer.mlp
    linears = (attn.fixed.inputs, attn.fixed.output, mlp.fixed.inputs, mlp.fixed.output)
    kinds = {type(lin) for lin in linears}
    if (
        len(kinds) != 1
        or kinds.pop() not in (QuantLinear, Int8Linear)
        or len({lin.native for lin in linears}) != 1
    ):
        return None
    norms = (layer.input_layernorm.weight.detach(), layer.post_attention_layernorm.weight.detach())
    biases = [lin.bias for lin in linears]
    if not all(_f32(t) for t in (*biases, *norms)):
        return None
    if isinstance(linears[0], Int8Linear):
        weights = [lin.weight.qweight for lin in linears]
        scales: tuple[torch.Tensor | None, ...] = tuple(lin.weight.scale for lin in linears)
        types = (INT8_CHANNEL,) * 4
    else:
        weights = [lin.weight.data for lin in linears]
        scales, types = (None,) * 4, tuple(lin.weight.ggml_type for lin in linears)  # type: ignore[assignment]
    if not all(_f32(t) for t in scales):
        return None
    qkv, o, gate_up, down = weights
    qkv_b, o_b, gate_up_b, down_b = biases
    operands = LayerOperands(
        *norms, qkv, qkv_b, o, o_b, gate_up, gate_up_b, down, down_b, attn.scale, attn.sliding_window,
        types, scales,
    )  # fmt: skip
    return operands, linears[0].native.path


def _operands(layer: Any, packed: bool) -> LayerOperands | None:
    attn, mlp = layer.self_attn, layer.mlp
    if attn.fused is None or mlp.fused is None:
        return None
    if packed:
        packs = (attn.packed_in, attn.packed_out, mlp.packed_in, mlp.packed_out)
        if not all(isinstance(p, NativePackedWeight) for p in packs):
            return None
        weights = tuple(p.panels for p in packs)
    else:
        weights = (attn.fused.weight, attn.o_proj.weight, mlp.fused.weight, mlp.down_proj.weight)
    qkv, o, gate_up, down = (w.detach() for w in weights)
    biases = (attn.fused.bias, attn.o_proj.bias, mlp.fused.bias, mlp.down_proj.bias)
    qkv_b, o_b, gate_up_b, down_b = (None if b is None else b.detach() for b in biases)
    norms = (layer.input_layernorm.weight.detach(), layer.post_attention_layernorm.weight.detach())
    if not all(_f32(t) for t in (qkv, o, gate_up, down, qkv_b, o_b, gate_up_b, down_b, *norms)):
        return None
    return LayerOperands(
        *norms, qkv, qkv_b, o, o_b, gate_up, gate_up_b, down, down_b, attn.scale, attn.sliding_window
    )


class Operands(NamedTuple):
    """Every layer's operands, whether float32 weights are native panels, the quantised kernel's
    path, and the most rows a step may have for the per-op path to run these same kernels."""

    layers: list[LayerOperands]
    packed: bool
    quant_path: str = PATHS[0]
    max_rows: int | None = None


def _all_operands(layers: Sequence[Any]) -> Operands | None:
    """The layers' operands, or None where one does not fit: a quantised model's layers (``fixed``
    matmuls) must all run on one kernel and path; a float32 model's are read as packed now."""
    first = layers[0]
    if first.self_attn.fixed is not None:
        quant = [_quant_operands(layer) for layer in layers]
        paths = {q[1] for q in quant if q is not None}
        if len(paths) != 1 or any(q is None for q in quant):
            return None
        ops = [q[0] for q in quant if q is not None]
        int8 = ops[0].types[0] == INT8_CHANNEL
        return Operands(ops, True, paths.pop(), ONEDNN_MIN_ROWS - 1 if int8 else None)
    packed = first.self_attn.packed_in is not None
    float_ops = [_operands(layer, packed) for layer in layers]  # float32 CPU weights first: no build on a GPU
    if any(op is None for op in float_ops):
        return None
    return Operands(
        [op for op in float_ops if op is not None], packed, max_rows=None if packed else SKINNY_MAX_ROWS
    )


def _ascending(rows: torch.Tensor) -> bool:
    return rows.numel() < 2 or bool((rows[1:] > rows[:-1]).all())


class FusedDecode:
    """The model's layers bound to the native call, and the per-step test of whether it applies."""

    def __init__(self, native: NativeDecodeLayers) -> None:
        self.native = native

    @classmethod
    def build(cls, layers: Sequence[Any], hidden: int, intermediate: int) -> FusedDecode | None:
        """For a Llama model's decoder ``layers`` as packed now (of ``hidden`` and ``intermediate``
        sizes), or None where they do not fit the native call. The layers are read by their
        attributes only (``engine/model/llama.py``'s ``DecoderLayer``): this module never imports
        the model, which imports it."""
        if not layers:
            return None
        first = layers[0]
        ops = _all_operands(layers)
        eps = {n.eps for layer in layers for n in (layer.input_layernorm, layer.post_attention_layernorm)}
        lib = load_decode_layers() if ops is not None and len(eps) == 1 else None
        if ops is None or lib is None:
            return None
        attn = first.self_attn
        geometry = Geometry(
            hidden=hidden, heads=attn.num_heads, kv_heads=attn.num_kv_heads,
            head_dim=attn.head_dim, intermediate=intermediate, eps=eps.pop(), packed=ops.packed,
            quant_path=PATHS.index(ops.quant_path), max_rows=ops.max_rows,
        )  # fmt: skip
        return cls(NativeDecodeLayers(lib, geometry, ops.layers))

    def step_inputs(
        self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata,
        backend: AttentionBackend, sample_rows: torch.Tensor,
    ) -> StepInputs | None:  # fmt: skip
        """The step's inputs where the native call takes it (the caches aside), else None."""
        g, rows = self.native.geometry, x.shape[0]
        if (
            not isinstance(backend, CpuAttentionBackend)
            or meta.lora is not None
            or torch.is_grad_enabled()
            or not _f32(x)
            or (g.max_rows is not None and rows > g.max_rows)
        ):
            return None
        cos, sin = rope
        trig = all(_f32(t) and t.shape == (rows, g.head_dim) for t in (cos, sin))
        ints = all(
            t.dtype == torch.int32 and t.is_contiguous() for t in (meta.seq_lens, meta.query_start_loc)
        )
        slots = meta.slot_mapping
        if not (trig and ints and slots.dtype == torch.int64 and slots.is_contiguous()):
            return None
        if meta.block_tables.dtype != torch.int32 or meta.block_tables.stride(1) != 1:
            return None
        decodes, prefills = backend.split(meta)
        if prefills is not None and not backend.prefills_natively(g.heads, g.kv_heads, g.head_dim):
            return None  # the per-op path runs these chunks on SDPA
        # the last layer's rows past its attention: all (the caller picks the sampling rows from every
        # row), or fewer, kept in place by the C side (ascending)
        keep = None if sample_rows.shape[0] == rows else sample_rows.to(torch.int64).contiguous()
        if keep is not None and not _ascending(keep):
            return None
        return StepInputs(
            cos, sin, slots, decodes, meta.block_tables, meta.seq_lens, meta.query_start_loc, prefills, keep
        )

    def run(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
        backend: AttentionBackend,
        sample_rows: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The layer loop's (x, residual) for this step, or None where the native call does not take it."""
        step = self.step_inputs(x, rope, meta, backend, sample_rows)
        if step is None or not all(_f32(c) and c.dim() == 5 for c in kv_caches):
            return None
        g, k_cache = self.native.geometry, kv_caches[0][0]
        check_cache(k_cache, kv_caches[0][1])
        q_shape = x.new_empty(1).expand(x.shape[0], g.heads, g.head_dim)  # checked for its shape only
        windows = {op.window for op in self.native.operands}
        for window in windows:
            check_forward(q_shape, k_cache, meta, window)
        check_paged_bounds(q_shape, k_cache, meta)
        if any(c.shape != kv_caches[0].shape for c in kv_caches):
            return None
        self.native.bind_caches(kv_caches)
        return self.native.run(x, step, block_size=k_cache.shape[1])
