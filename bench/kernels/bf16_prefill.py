"""``--dtype bfloat16`` against float32 on this CPU: prefill and decode forwards of the same model.

    python -m bench.kernels.bf16_prefill [--model smollm2] [--threads 2] [--reps 7] [--rounds 3]

Where it sits: beside ``kernels/forward_ab.py``, whose step shapes and timing it reuses (one
``LlamaForCausalLM.forward`` through the runner, paged KV cache, no scheduler or sampler). It
loads the model three times, as ``ModelRunner`` does for ``EngineConfig(dtype=...)``: float32
(weights prepacked, the default), bfloat16 with its weights prepacked for oneDNN's bf16 GEMM (the
default; ``kernels/packing/onednn.py``) and bfloat16 with ``prepack_weights=False`` (``F.linear``
per call). Rounds alternate the three, case by case, so each ratio compares figures taken
seconds apart; the load average is printed beside every round. Writes
``bench/results/bf16_cpu.txt`` with ``--publish``, adds to it with ``--append`` (another
``--threads``).
"""

from __future__ import annotations

import os
import statistics

import torch

from bench.common import RESULTS, Flag, bench_args, cpu_name, publish
from bench.kernels.forward_ab import BLOCK, Case, time_case
from kvfleet.engine.config import EngineConfig
from kvfleet.engine.kernels.native.cpu_features import probe_cpu_paths
from kvfleet.engine.loader.sources import resolve_model
from kvfleet.engine.runner.model_runner import ModelRunner

CASES = {
    "prefill256": Case(1, 256, 0),
    "prefill1024": Case(1, 1024, 0),
    "decode1": Case(1, 1, 300),
    "decode8": Case(8, 1, 300),
}
VARIANTS = {  # label: (dtype, prepack_weights)
    "fp32": ("float32", True),
    "bf16": ("bfloat16", True),
    "bf16-flinear": ("bfloat16", False),
}
FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_bf16", "amx_int8")


def load() -> str:
    """The 1, 5 and 15 minute load averages (2 cores here: above 2, neighbours share them)."""
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def runners(model: str) -> dict[str, ModelRunner]:
    blocks = max(c.num_seqs * -(-(c.new + c.cached) // BLOCK) for c in CASES.values())
    out = {}
    for label, (dtype, prepack) in VARIANTS.items():
        config = EngineConfig(
            model=model, dtype=dtype, num_kv_blocks=blocks, block_size=BLOCK, prepack_weights=prepack
        )
        out[label] = ModelRunner(config, config.model)
    return out


def main() -> None:
    args = bench_args(
        __doc__,
        model="smollm2",
        threads=2,
        reps=7,
        rounds=3,
        publish=Flag(False, "write bench/results/bf16_cpu.txt"),
        append=Flag(False, "add this run to bench/results/bf16_cpu.txt"),
    )
    torch.set_num_threads(args.threads)
    cpu = probe_cpu_paths()
    lines = [
        f"# {cpu_name()}, {args.threads} threads, torch {torch.__version__}, model {args.model}",
        "# flags: " + " ".join(f for f in FLAGS if f in cpu.flags),
        f"# {cpu.describe('n/a')}",
        f"# load before: {load()}",
    ]
    print("\n".join(lines), flush=True)
    by_variant = runners(str(resolve_model(args.model)))
    packers = ", ".join(f"{label} {runner.weight_packing}" for label, runner in by_variant.items())
    lines.append(f"# weights packed for: {packers}; load after loading: {load()}")
    medians: dict[tuple[str, str], list[float]] = {}
    for r in range(args.rounds):
        for name, case in CASES.items():
            walls = {label: time_case(runner, case, args.reps)[0] for label, runner in by_variant.items()}
            for label, wall in walls.items():
                medians.setdefault((name, label), []).append(wall)
            row = "  ".join(f"{label} {wall:8.2f} ms" for label, wall in walls.items())
            ratio = walls["fp32"] / walls["bf16"]
            flin = walls["fp32"] / walls["bf16-flinear"]
            line = (
                f"round {r} {name:12} {row}  fp32/bf16 {ratio:4.2f}x  fp32/bf16-flinear {flin:4.2f}x  "
                f"load {load()}"
            )
            print(line, flush=True)
            lines.append(line)
    lines.append(
        "# medians over rounds (ms); in brackets the median over rounds of fp32 / variant (>1: faster)"
    )
    for name in CASES:
        fp32 = medians[(name, "fp32")]
        cells = [f"fp32 {statistics.median(fp32):8.2f}"]
        for label in list(VARIANTS)[1:]:
            walls = medians[(name, label)]
            ratio = statistics.median(f / w for f, w in zip(fp32, walls, strict=True))
            cells.append(f"{label} {statistics.median(walls):8.2f} ({ratio:4.2f}x)")
        lines.append(f"{name:12} " + "  ".join(cells))
    lines.append(f"# load after: {load()}")
    if args.publish:
        publish(lines, "bf16_cpu.txt")
    elif args.append:
        print("\n".join(lines))
        with (RESULTS / "bf16_cpu.txt").open("a") as f:
            f.write("\n".join(["", *lines]) + "\n")
    else:
        print("\n".join(lines[-len(CASES) - 2 :]))


if __name__ == "__main__":
    main()
