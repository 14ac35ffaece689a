"""Which steps run all their decoder layers in one native call, and with which operands.

Where it sits: the step dispatcher (``engine/runner/step_dispatch.py``) routes a step here from what
:meth:`FusedLayers.native_step` offers; ``LlamaForCausalLM.forward`` then calls :meth:`FusedLayers.run`,
which returns the layer loop's result through ``kernels/native/decode_layers.py``
(``csrc/decode_layers.c``), or, for a caller without a route whose step it cannot take, None, and
the per-op loop runs. The call runs the per-op path's own kernels in its order, so it
only takes a step where that path would run exactly those kernels: float32 on the CPU, the
``cpu`` attention backend, decode rows and prompt chunks (the chunks only where the backend runs
them on the native prefill kernel, not SDPA; the last layer past its attention at the sampling rows
only, as the per-op path prunes it), no LoRA, and every matmul on the native GEMM (weights packed
``native``), unpacked on the few-row kernel (at most ``SKINNY_MAX_ROWS`` rows), or for a quantised
model every layer matmul on the native quantised kernel: ``--quantization gguf``'s
:class:`QuantLinear` (any number of rows), or
``int8``'s :class:`Int8Linear` below ``ONEDNN_MIN_ROWS`` rows (from there the per-op path's
matmuls are oneDNN's), or for a bf16 model on the CPU (``layers/linear/bf16.py``: float32 compute)
every layer matmul on the native bf16 kernel's panels (any number of rows). Anything else is the
per-op path's, as before. Each resolved matmul says what the call reads of it and up to how many
rows (``native_operand``, ``kernels/operand.py``, part of ``layers/linear``'s one interface): this module never asks a weight's or a kernel's type.

Built once per model from its weights after ``prepack`` (which drops it to be built again):
a weight replaced afterwards in place of the tensor is not seen.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from kvfleet.engine.attention import AttentionBackend, AttentionMetadata
from kvfleet.engine.attention.checks import check_cache, check_forward, check_paged_bounds
from kvfleet.engine.attention.cpu_backend import CpuAttentionBackend
from kvfleet.engine.kernels.native.bf16_gemm import PATHS as BF16_PATHS
from kvfleet.engine.kernels.native.decode_layers import (
    LayerGeometry,
    LayerOperands,
    NativeDecodeLayers,
    NativeStepInputs,
    load_decode_layers,
)
from kvfleet.engine.kernels.native.quant_gemm import PATHS
from kvfleet.engine.kernels.operand import NativeOperand, native_operand


@dataclass(frozen=True)
class NativeStep:
    """The one-call native step the runner's weights offer: up to ``max_rows`` rows (None: any),
    prompt chunks too where ``prompt_chunks`` (the native prefill kernel takes this geometry)."""

    max_rows: int | None
    prompt_chunks: bool


def _f32(t: torch.Tensor | None) -> bool:
    return t is None or (t.dtype == torch.float32 and t.device.type == "cpu" and t.is_contiguous())


def _layer_operands(layer: Any) -> tuple[LayerOperands, NativeOperand] | None:
    """One layer's operands from its four matmuls' own (``native_operand``), with the first of them
    (what every matmul of the call shares: kind, kernel path, row limit); None where one offers none,
    they differ, or a tensor is not what the C side reads."""
    attn, mlp = layer.self_attn, layer.mlp
    ops = [native_operand(lin) for lin in (*attn.matmuls(), *mlp.matmuls())]
    first = ops[0]
    if first is None or any(op is None or op.key != first.key for op in ops):
        return None
    found = [op for op in ops if op is not None]
    norms = (layer.input_layernorm.weight.detach(), layer.post_attention_layernorm.weight.detach())
    floats = [*norms, *(op.bias for op in found), *(op.scale for op in found)]
    if first.kind not in ("quant", "bf16"):  # float32 rows or panels (quantised or bf16: read as stored)
        floats += [op.weight for op in found]
    if not all(_f32(t) for t in floats):
        return None
    qkv, o, gate_up, down = found
    operands = LayerOperands(
        *norms, qkv.weight, qkv.bias, o.weight, o.bias, gate_up.weight, gate_up.bias, down.weight,
        down.bias, attn.scale, attn.sliding_window,
        (qkv.type, o.type, gate_up.type, down.type), (qkv.scale, o.scale, gate_up.scale, down.scale),
    )  # fmt: skip
    return operands, first


class Operands(NamedTuple):
    """Every layer's operands, whether float32 weights are native panels, the quantised (or bf16)
    kernel's path number, and the most rows a step may have for the per-op path to run these same kernels."""

    layers: list[LayerOperands]
    packed: bool
    quant_path: int = 0
    max_rows: int | None = None


def _all_operands(layers: Sequence[Any]) -> Operands | None:
    """The layers' operands, or None where one does not fit: every matmul of every layer must offer
    one of the same kind, kernel path and row limit (``NativeOperand.key``)."""
    found = [_layer_operands(layer) for layer in layers]
    keys = {f[1].key for f in found if f is not None}
    if len(keys) != 1 or any(f is None for f in found):
        return None
    kind, path, max_rows = keys.pop()
    ops = [f[0] for f in found if f is not None]
    paths = BF16_PATHS if kind == "bf16" else PATHS  # each kernel's path numbers (decode_layers.c)
    return Operands(ops, kind != "rows", paths.index(path or paths[0]), max_rows)


def _ascending(rows: torch.Tensor) -> bool:
    return rows.numel() < 2 or bool((rows[1:] > rows[:-1]).all())


class FusedLayers:
    """The model's layers bound to the native call, and the per-step test of whether it applies."""

    def __init__(self, native: NativeDecodeLayers) -> None:
        self.native = native

    @classmethod
    def build(cls, layers: Sequence[Any], hidden: int, intermediate: int) -> FusedLayers | None:
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
        geometry = LayerGeometry(
            hidden=hidden, heads=attn.num_heads, kv_heads=attn.num_kv_heads,
            head_dim=attn.head_dim, intermediate=intermediate, eps=eps.pop(), packed=ops.packed,
            quant_path=ops.quant_path, max_rows=ops.max_rows,
        )  # fmt: skip
        return cls(NativeDecodeLayers(lib, geometry, ops.layers))

    def native_step(self, backend: AttentionBackend) -> NativeStep | None:
        """What the step dispatcher may route here over ``backend`` (None: no step: another backend);
        the plan-level half of :meth:`step_inputs`' checks."""
        if not isinstance(backend, CpuAttentionBackend):
            return None
        g = self.native.geometry
        return NativeStep(g.max_rows, backend.prefills_natively(g.heads, g.kv_heads, g.head_dim))

    def step_inputs(
        self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata,
        backend: AttentionBackend, sample_rows: torch.Tensor,
    ) -> NativeStepInputs | None:  # fmt: skip
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
        return NativeStepInputs(
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
