"""Compile the Triton kernels for a GPU target on a machine without one (no driver needed).

Run by ``test_kernels_compile_for_a_gpu.py`` in a subprocess without ``TRITON_INTERPRET``
(under the interpreter nothing is compiled): Triton lowers each kernel to PTX and its bundled
``ptxas`` assembles it for sm_90 (H100 / H200), which catches what the interpreter accepts
but a GPU compile rejects (dot shapes, types, loop-carried values, shared memory).
Prints one line per kernel and ``compiled N kernels``.
"""

from __future__ import annotations

import inspect
import sys

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from kvfleet.engine.kernels.triton import fused_ops as triton_fused
from kvfleet.engine.kernels.triton import kv_store, lora, paged_attention

TARGET = GPUTarget("cuda", 90, 32)


def compile_kernel(
    kernel: triton.JITFunction, pointers: dict[str, str], constants: dict[str, object], num_warps: int
) -> int:
    names = list(inspect.signature(kernel.fn).parameters)
    signature = {
        name: "constexpr"
        if name in constants
        else pointers.get(name, "fp32" if name in ("scale_log2", "eps") else "i32")
        for name in names
    }
    constexprs = {(names.index(name),): value for name, value in constants.items()}
    compiled = triton.compile(
        ASTSource(kernel, signature, constexprs), target=TARGET, options={"num_warps": num_warps}
    )
    return int(compiled.metadata.shared)


def attention(
    dtype: str,
    group: int,
    head_dim: int,
    block_size: int,
    max_query_len: int,
    window: bool = False,
    sinks: bool = False,
) -> str:
    cfg = paged_attention.choose_tiles(group, head_dim, max_query_len)
    pointers = {name: f"*{dtype}" for name in ("q_ptr", "k_cache_ptr", "v_cache_ptr", "out_ptr")}
    pointers |= {name: "*i32" for name in ("block_tables_ptr", "seq_lens_ptr", "query_start_ptr")}
    pointers["sinks_ptr"] = "*fp32"  # gpt-oss's per-head sink logits (read only with HAS_SINKS)
    constants = {
        "GROUP": group,
        "GROUP_PAD": cfg.group_pad,
        "HEAD_DIM": head_dim,
        "DIM_PAD": cfg.dim_pad,
        "BLOCK_SIZE": block_size,
        "BLOCK_Q": cfg.block_q,
        "TILE_N": cfg.tile_n,
        "PRECISION": "ieee" if dtype == "fp32" else "tf32",
        "DOT_FP32": False,
        "HAS_WINDOW": window,
        "HAS_SINKS": sinks,
    }
    shared = compile_kernel(paged_attention._paged_attention_kernel, pointers, constants, cfg.num_warps)
    name = (
        f"paged_attention {dtype} group={group} head_dim={head_dim} block={block_size} max_q={max_query_len}"
    )
    return f"{name}{' window' if window else ''}{' sinks' if sinks else ''}: {shared} B shared"


def store(source: str, cache: str, kv_heads: int, head_dim: int, block_size: int) -> str:
    row = kv_heads * head_dim
    pointers = {
        "k_ptr": f"*{source}",
        "v_ptr": f"*{source}",
        "k_cache_ptr": f"*{cache}",
        "v_cache_ptr": f"*{cache}",
    }
    pointers["slot_ptr"] = "*i64"
    constants = {
        "BLOCK_SIZE": block_size,
        "HEAD_DIM": head_dim,
        "ROW": row,
        "ROW_PAD": triton.next_power_of_2(row),
    }
    constants["TOKENS"] = kv_store._TOKENS_PER_PROGRAM
    shared = compile_kernel(kv_store._store_kv_kernel, pointers, constants, 4)
    return f"store_kv {source}->{cache} kv_heads={kv_heads} head_dim={head_dim} block={block_size}: {shared} B shared"


def lora_delta(dtype: str, rank: int) -> str:
    pointers = {name: f"*{dtype}" for name in ("x_ptr", "a_ptr", "b_ptr", "out_ptr")}
    pointers["slots_ptr"] = "*i32"
    constants = {
        "RANK": rank,
        "RANK_PAD": max(16, triton.next_power_of_2(rank)),
        "BLOCK_K": 64,
        "BLOCK_N": 64,
    }
    shared = compile_kernel(lora._lora_kernel, pointers, constants, 4)
    return f"lora {dtype} rank={rank}: {shared} B shared"


def fused(dtype: str) -> list[str]:
    """The decoder's fused ops (engine/kernels/triton/fused_ops.py) at SmolLM2's and Llama-3-8B's sizes."""
    norm = compile_kernel(
        triton_fused._add_rms_norm_kernel,
        {name: f"*{dtype}" for name in ("x_ptr", "res_ptr", "w_ptr", "out_ptr")},
        {"HAS_X": True, "BLOCK": 4096},
        4,
    )
    rope = compile_kernel(
        triton_fused._rope_kernel,
        {name: f"*{dtype}" for name in ("x_ptr", "cos_ptr", "sin_ptr")},
        {"HALF": 32, "BLOCK_H": 16, "BLOCK_D": 32},
        4,
    )
    silu = compile_kernel(
        triton_fused._silu_mul_kernel, {"gu_ptr": f"*{dtype}", "out_ptr": f"*{dtype}"}, {"BLOCK": 1024}, 4
    )
    return [
        f"add_rms_norm {dtype} hidden=4096: {norm} B shared",
        f"rope {dtype} heads=9 head_dim=64: {rope} B shared",
        f"silu_mul {dtype} block=1024: {silu} B shared",
    ]


def main() -> int:
    lines = [
        attention("bf16", 4, 128, 16, 512),  # Llama-3-8B prefill / mixed step
        attention("bf16", 4, 128, 16, 1),  # Llama-3-8B decode step
        attention("fp16", 7, 256, 32, 64),  # group not a power of two, the widest head
        attention("bf16", 4, 128, 16, 512, window=True),  # Mistral-7B: a sliding window
        attention("bf16", 8, 64, 16, 512, window=True, sinks=True),  # gpt-oss-20b: window and sinks
        store("fp32", "bf16", 8, 128, 16),
        lora_delta("bf16", 16),  # a LoRA delta (multi-LoRA, engine/kernels/triton/lora.py)
        *fused("bf16"),
    ]
    print("\n".join(lines))
    print(f"compiled {len(lines)} kernels")
    return 0


if __name__ == "__main__":
    sys.exit(main())
