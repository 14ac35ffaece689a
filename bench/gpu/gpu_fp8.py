"""fp8 weights on a lent GPU (issue #34): the decode step of Llama-3-8B shapes with e4m3 linears
against the same model in bf16, with and without CUDA graphs.

Where it sits: stage ``graphs`` of ``bench/gpu/gpu_checks.sh`` runs it after ``gpu_graphs.py``;
writes ``$OUT/gpu_fp8.txt``. The model is the engine's own (``gpu_decode.build_model``, random
weights on the device); its linears are then quantised per output channel with
``kernels/fp8_linear.quantize_fp8_per_channel`` and resolved with ``resolve_fp8_linear``, as
``loader/hf_quant.py`` does for ``--quantization fp8`` (q/k/v and gate/up one matmul each,
the LM head in fp8, the embedding kept in bf16). Step = fill + copy + forward + sync, as in
``gpu_graphs.decode_steps``. Accuracy: one eager decode step's logits, fp8 against bf16 (relative
error of the logits and top-1 agreement over the batch).

Run on the GPU machine:  python -m bench.gpu.gpu_fp8 --out $OUT
Smoke-run on a CPU:      .venv/bin/python -m bench.gpu.gpu_fp8 --smoke  (tiny shapes; fp8 dequantised)
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import torch
from torch import nn

from bench.gpu.gpu_decode import BLOCK_SIZE, SMOKE_SHAPE, build_model, copy_bandwidth
from bench.gpu.gpu_graphs import bench_device, bench_parser, decode_plan, decode_steps
from kvfleet.capacity import KNOWN_MODELS, ModelShape, kv_bytes_per_token, per_rank_weight_bytes
from kvfleet.engine.attention import get_backend
from kvfleet.engine.kernels.fp8_linear import (
    Fp8Linear,
    concat_fp8,
    quantize_fp8_per_channel,
    resolve_fp8_linear,
)
from kvfleet.engine.model.batch import flatten_plan
from kvfleet.engine.model.projections import Matmuls, ProjectedBlock

GRAPH = "static buffers, CUDA graph"


def drop_weight(linear: nn.Linear) -> None:
    """Free a float weight once its fp8 copy serves the matmul (the model keeps the module)."""
    linear.weight = nn.Parameter(linear.weight.new_empty(0), requires_grad=False)


def to_fp8(model: Any, dtype: torch.dtype) -> int:
    """Quantise every linear of ``model`` to e4m3 in place; returns how many run ``_scaled_mm``."""
    fast = 0
    for block in model.modules():
        if not isinstance(block, ProjectedBlock):
            continue
        inputs = [getattr(block, n) for n in block.INPUTS]
        out = block.output_linear()
        qin = concat_fp8([quantize_fp8_per_channel(lin.weight) for lin in inputs])
        bias_in = None if inputs[0].bias is None else torch.cat([lin.bias for lin in inputs])
        block.fixed = Matmuls(
            resolve_fp8_linear(qin, bias_in, dtype),
            resolve_fp8_linear(quantize_fp8_per_channel(out.weight), out.bias, dtype),
        )
        fast += sum(isinstance(m, Fp8Linear) for m in block.fixed)
        block.fused, block._matmuls = None, None
        for lin in [*inputs, out]:
            drop_weight(lin)
    head = resolve_fp8_linear(quantize_fp8_per_channel(model.lm_head.weight), None, dtype)
    fast += isinstance(head, Fp8Linear)
    model.fixed_lm_head = head
    if model.lm_head.weight is not model.model.embed_tokens.weight:
        drop_weight(model.lm_head)
    model.use_fused_decode = False
    return fast


def logits_of(model: Any, shape: ModelShape, batch: int, context: int, device: torch.device) -> torch.Tensor:
    """One eager decode step's logits (the caches zero: the same inputs for both models)."""
    plan = decode_plan(batch, context, shape.vocab_size)
    blocks = batch * -(-(context + 1) // BLOCK_SIZE)
    dims = (2, blocks + 1, BLOCK_SIZE, shape.num_kv_heads, shape.head_dim)
    dtype = model.model.embed_tokens.weight.dtype
    caches = [torch.zeros(dims, dtype=dtype, device=device) for _ in range(shape.num_layers)]
    b = flatten_plan(plan, BLOCK_SIZE, device)
    with torch.inference_mode():
        logits: torch.Tensor = model(
            b.input_ids, b.positions, caches, b.meta, get_backend("triton"), b.sample_rows
        )
        return logits.float()


def run(args: argparse.Namespace, device: torch.device, dtype: torch.dtype, say: Any) -> None:
    shape: ModelShape = args.shape
    bandwidth = copy_bandwidth(device, 4 << 30 if device.type == "cuda" else 1 << 20)
    say(f"measured copy bandwidth: {bandwidth / 1e9:.1f} GB/s; {shape.name}, context {args.context}")
    model = build_model(shape, device, dtype)
    assert model is not None, "the engine's model is not importable"
    ref = logits_of(model, shape, 8, args.context, device)
    bf16 = {b: decode_steps(model, shape, b, args.context, device, args.repeat) for b in args.batches}
    fast = to_fp8(model, dtype)
    if device.type == "cuda":
        torch.cuda.empty_cache()
    got = logits_of(model, shape, 8, args.context, device)
    rel = (got - ref).norm() / ref.norm()
    top1 = (got.argmax(-1) == ref.argmax(-1)).float().mean()
    say(
        f"fp8 linears on _scaled_mm: {fast}; one decode step's output, fp8 vs bf16: relative error {rel:.4f}, top-1 agreement {top1:.0%} of 8 rows"
    )
    fp8 = {b: decode_steps(model, shape, b, args.context, device, args.repeat) for b in args.batches}
    say(f"{'batch':>5}  {'way':<28}{'bf16 ms':>9}{'fp8 ms':>9}{'fp8 speed-up':>14}{'fp8 MBU':>9}")
    for b in args.batches:
        step_bytes = per_rank_weight_bytes(shape, "bfloat16", 1, "fp8") + b * (
            args.context + 1
        ) * kv_bytes_per_token(shape)
        for way, t in fp8[b].items():
            base = bf16[b][way]
            say(
                f"{b:>5}  {way:<28}{base * 1e3:>9.2f}{t * 1e3:>9.2f}{base / t:>13.2f}x{step_bytes / t / bandwidth:>9.1%}"
            )
    if GRAPH in fp8[args.batches[0]]:
        b = args.batches[0]
        ratio = bf16[b][GRAPH] / fp8[b][GRAPH]
        say(
            f"target (issue #34): fp8 decode at batch {b} >= 1.7x the bf16 step (CUDA graphs both): {ratio:.2f}x -> {'met' if ratio >= 1.7 else 'NOT met'}"
        )


def main(argv: list[str]) -> int:
    args = bench_parser(__doc__ or "").parse_args(argv)
    cuda, device, dtype, say = bench_device(args, "gpu_fp8.txt")
    args.shape = KNOWN_MODELS["llama-3-8b"] if cuda else SMOKE_SHAPE
    run(args, device, dtype, say)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
