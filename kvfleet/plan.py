"""``kvfleet plan`` (docs/architecture.md §3): the capacity maths of :mod:`kvfleet.capacity` as a table or JSON.

A user asks what a model needs before deploying it: the weights, the KV cache per token,
how many tokens and sequences fit, and the decode bound, for one or several GPU types side
by side (``--gpu h100,h200``), on ``--tensor-parallel-size N`` GPUs per replica: then the
"per GPU" rows are one rank's share (1/N of the sharded weights, its KV heads), and the verdict
is the engine's own (:func:`kvfleet.capacity.check_engine_fits`). Torch-free, like everything the CLI loads for this command.
"""

from __future__ import annotations

import argparse
import json
import sys

from kvfleet.capacity import (
    GIB,
    RANK_RUNTIME_OVERHEAD_BYTES,
    WEIGHT_FORMATS,
    CapacityError,
    CapacityPlan,
    plan_capacity,
    resolve_gpu,
    resolve_model,
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="a config.json, a folder holding one, or a known name")
    parser.add_argument("--gpu", required=True, help="GPU type, or several comma-separated: h100,h200")
    parser.add_argument(
        "--tensor-parallel-size",
        "-tp",
        "--num-gpus",
        dest="tensor_parallel_size",
        type=int,
        default=1,
        help="GPUs per replica, each holding 1/N of the model (vLLM's flag; --num-gpus is the old name)",
    )
    parser.add_argument("--block-size", type=int, default=16, help="tokens per KV block, as the engine's")
    parser.add_argument(
        "--context", type=int, default=None, help="tokens per sequence (default: the model's max)"
    )
    parser.add_argument(
        "--dtype", default="bfloat16", help="weights and KV dtype: bfloat16, float16, float32, fp8, int8"
    )
    parser.add_argument(
        "--quantization",
        default="none",
        choices=sorted(WEIGHT_FORMATS),
        help="the decoder linears' weight format (bytes per weight: fp8/int8 1 + a scale per row, "
        "gguf-q4_1 0.625, gguf-q8_0 1.0625, ...); embeddings, LM head and KV stay in --dtype",
    )
    parser.add_argument(
        "--gpu-memory-utilization", type=float, default=0.9, help="share of GPU memory to use"
    )
    parser.add_argument("--json", action="store_true", help="print JSON (an object, a list for several GPUs)")


def _plans(args: argparse.Namespace) -> list[CapacityPlan]:
    shape = resolve_model(args.model)
    gpu_names = [g for g in args.gpu.split(",") if g.strip()]
    if not gpu_names:
        raise CapacityError(f"--gpu {args.gpu!r} names no GPU")
    return [
        plan_capacity(
            shape,
            resolve_gpu(name),
            num_gpus=args.tensor_parallel_size,
            block_size=args.block_size,
            context=args.context,
            dtype=args.dtype,
            gpu_memory_utilization=args.gpu_memory_utilization,
            quantization=args.quantization,
        )
        for name in gpu_names
    ]


def _gib(n: int) -> str:
    return f"{n / GIB:.2f} GiB"


def format_table(plans: list[CapacityPlan]) -> str:
    """One column per GPU, one row per figure, then the reason for any plan that does not fit."""
    first = plans[0]
    head = (
        f"model {first.model} ({first.num_params / 1e9:.2f} B params"
        + ("" if first.active_params == first.num_params else f", {first.active_params / 1e9:.2f} B active")
        + f"), dtype {first.dtype}, "
        + ("" if first.quantization == "none" else f"quantization {first.quantization}, ")
        + f"context {first.context}, gpu-memory-utilization {first.gpu_memory_utilization}"
    )
    rows: list[tuple[str, list[str]]] = [
        ("GPU", [f"{p.num_gpus} x {p.gpu}" for p in plans]),
        ("weights", [_gib(p.weights_bytes) for p in plans]),
        ("KV bytes/token", [str(p.kv_bytes_per_token) for p in plans]),
        ("per GPU: usable", [_gib(p.usable_bytes) for p in plans]),
        ("per GPU: weights", [_gib(p.weights_bytes_per_rank) for p in plans]),
        ("per GPU: CUDA, NCCL", [_gib(RANK_RUNTIME_OVERHEAD_BYTES) for _ in plans]),
        ("per GPU: act. reserve", [_gib(p.activation_bytes) for p in plans]),
        ("per GPU: KV cache", [_gib(p.kv_bytes) for p in plans]),
        ("per GPU: KV heads", [str(p.kv_heads_per_rank) for p in plans]),
        ("per GPU: KV B/token", [str(p.kv_bytes_per_token_per_rank) for p in plans]),
        ("KV blocks", [f"{p.kv_blocks} x {p.block_size}" for p in plans]),
        ("KV tokens that fit", [str(p.kv_tokens) for p in plans]),
        (f"max seqs at {first.context}", [str(p.max_concurrent_sequences) for p in plans]),
        ("decode batch", [str(p.decode_batch_size) for p in plans]),
        ("decode tokens/s bound", [f"{p.decode_tokens_per_s_bound:.1f}" for p in plans]),
        ("fits", ["yes" if p.fits else "no" for p in plans]),
    ]
    label_w = max(len(label) for label, _ in rows)
    col_w = [max(len(cells[i]) for _, cells in rows) for i in range(len(plans))]
    lines = [head]
    for label, cells in rows:
        lines.append(
            "  ".join([label.ljust(label_w), *(c.rjust(w) for c, w in zip(cells, col_w, strict=True))])
        )
    lines += [f"{p.gpu}: {p.reason}" for p in plans if p.reason]
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    try:
        plans = _plans(args)
    except CapacityError as exc:
        print(f"kvfleet plan: error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        dicts = [p.to_dict() for p in plans]
        print(json.dumps(dicts[0] if len(dicts) == 1 else dicts, indent=2))
    else:
        print(format_table(plans))
    return 0
