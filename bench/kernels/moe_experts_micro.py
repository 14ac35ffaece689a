"""The grouped mixture-of-experts compute (``layers/moe/grouped.py``) against a dense SwiGLU MLP of the
same active size, per token, in float32 and int8, on this CPU.

    OMP_NUM_THREADS=2 python -m bench.kernels.moe_experts_micro [--hidden 1024] [--experts 8] [--top-k 2]
                                                                [--expert-inter 1024] [--rounds 20]

The MoE layer: ``experts`` SwiGLU experts of ``expert_inter`` columns, ``top_k`` per token (router
logits random, so tokens spread over the experts); the dense MLP: ``top_k x expert_inter`` columns,
the same multiply-adds per token. Medians of ``rounds`` calls at 1, 8, 64 and 256 tokens, alternated.
Prints its table (and publishes it to the bench results folder as moe_experts_micro.txt); on a shared, loaded box compare rows of one run only.
"""

from __future__ import annotations

import os
import statistics
from collections.abc import Callable

import torch

from bench.common import bench_args, call_seconds, cpu_name, publish
from kvfleet.engine.kernels.fused_ops import silu_mul
from kvfleet.engine.layers.linear import get_method
from kvfleet.engine.layers.moe import KernelExperts, StackedExperts, get_router, grouped_moe

TOKENS = (1, 8, 64, 256)


def _median_ms(fn: Callable[[], object], rounds: int) -> float:
    return statistics.median(call_seconds(fn, rounds, warm_up=False)) * 1e3


def main() -> None:
    args = bench_args(__doc__, hidden=1024, experts=8, top_k=2, expert_inter=1024, rounds=20)
    h, e, k, i = args.hidden, args.experts, args.top_k, args.expert_inter
    g = torch.Generator().manual_seed(0)
    w13, w2 = torch.randn(e, 2 * i, h, generator=g) * 0.02, torch.randn(e, h, i, generator=g) * 0.02
    dense_in, dense_out = (
        torch.randn(2 * k * i, h, generator=g) * 0.02,
        torch.randn(h, k * i, generator=g) * 0.02,
    )
    int8 = get_method("int8")
    q = int8.quantize  # type: ignore[attr-defined]
    moe_int8 = KernelExperts.load(int8, [q(w[:i]) for w in w13], [q(w[i:]) for w in w13], [q(w) for w in w2])
    dense_int8 = (int8.load([q(dense_in)], None), int8.load([q(dense_out)], None))
    moe_float = StackedExperts(w13, w2)
    lines = [
        f"MoE experts vs dense MLP of the same active size, per token (ms/token, median of {args.rounds})",
        f"cpu: {cpu_name()}, torch threads {torch.get_num_threads()}, OMP_NUM_THREADS="
        f"{os.environ.get('OMP_NUM_THREADS', 'unset')}, load {os.getloadavg()[0]:.1f}",
        f"hidden {h}, {e} experts x {i} columns, top-{k}; dense MLP {k * i} columns",
        f"{'tokens':>6} {'moe f32':>9} {'dense f32':>9} {'moe int8':>9} {'dense int8':>10}",
    ]
    for t in TOKENS:
        x = torch.randn(t, h, generator=g)
        routing = get_router("softmax_topk")(torch.randn(t, e, generator=g), k, True)
        calls: list[Callable[[], object]] = [
            lambda x=x, r=routing: grouped_moe(x, r, moe_float),
            lambda x=x: torch.nn.functional.linear(silu_mul(x @ dense_in.T), dense_out),
            lambda x=x, r=routing: grouped_moe(x, r, moe_int8),
            lambda x=x: dense_int8[1](silu_mul(dense_int8[0](x))),
        ]
        cells = [_median_ms(call, args.rounds) for call in calls]
        lines.append(f"{t:>6} " + " ".join(f"{c / t:>9.4f}" for c in cells))
    publish(lines, "moe_experts_micro.txt")


if __name__ == "__main__":
    main()
