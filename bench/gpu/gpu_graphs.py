"""CUDA graphs on a lent GPU (issue #30): decode step time and MBU with and without graphs, and
SmolLM2's offline GPU-busy fraction against transformers' best static batch.

Where it sits: stage ``graphs`` of ``bench/gpu/gpu_checks.sh``; writes ``$OUT/gpu_graphs.txt``.

1. Llama-3-8B shapes in bf16 with random weights (``gpu_decode.build_model``: the engine's own model),
   context 1024, batch 1/8/32/128, the triton backend, three ways per batch: today's eager step
   (``flatten_plan`` + forward), the decode path with the plain call (static buffers, one copy),
   and the decode path replaying CUDA graphs. Step = fill/flatten + copy + forward + sync; the
   sampler is left out. MBU = (weights + batch x (context + 1) x KV bytes per token) / step time /
   measured copy bandwidth, as in gpu_decode.py.
2. SmolLM2 (bf16) offline, graphs on and ``enforce_eager``: wall time, output tok/s, and the GPU-busy
   fraction (the profiler's summed CUDA kernel time over the wall time of a 64-prompt run), then
   transformers' static batches 32 and 128 and the ratio to the better one.

Run on the GPU machine:  python -m bench.gpu.gpu_graphs --out $OUT
Smoke-run on a CPU:      .venv/bin/python -m bench.gpu.gpu_graphs --smoke  (tiny shapes, plain calls)
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from bench.gpu.gpu_decode import BLOCK_SIZE, SMOKE_SHAPE, build_model, copy_bandwidth, sync, timed
from kvfleet.capacity import KNOWN_MODELS, ModelShape, kv_bytes_per_token, weights_bytes
from kvfleet.engine.attention import get_backend
from kvfleet.engine.model.batch import flatten_plan
from kvfleet.engine.runner.cuda_graphs import CudaGraphs, EagerCalls, GraphRunner
from kvfleet.engine.runner.padded_steps import DecodePath
from kvfleet.engine.runner.step_buffers import StepBuffers
from kvfleet.engine.sampling_params import SamplingParams
from kvfleet.engine.sched.plan import ScheduledSeq, SchedulerPlan
from kvfleet.engine.sequence import Sequence


def decode_plan(batch: int, context: int, vocab: int) -> SchedulerPlan:
    """``batch`` sequences of ``context`` prompt tokens, each decoding its first output token."""
    blocks = -(-(context + 1) // BLOCK_SIZE)
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    scheduled = []
    for s in range(batch):
        seq = Sequence(
            request_id=str(s), prompt_token_ids=[(s * 7 + i) % vocab for i in range(context)], params=params
        )
        seq.output_token_ids.append(1)
        scheduled.append(ScheduledSeq(seq, context, 1, tuple(range(s * blocks, (s + 1) * blocks))))
    return SchedulerPlan(scheduled=tuple(scheduled))


def decode_steps(
    model: Any, shape: ModelShape, batch: int, context: int, device: torch.device, repeat: int
) -> dict[str, float]:
    """Median step seconds of the three ways (see the module's docstring)."""
    plan = decode_plan(batch, context, shape.vocab_size)
    num_blocks = batch * -(-(context + 1) // BLOCK_SIZE)
    dims = (2, num_blocks + 1, BLOCK_SIZE, shape.num_kv_heads, shape.head_dim)
    caches = [
        torch.zeros(dims, dtype=next(model.parameters()).dtype, device=device)
        for _ in range(shape.num_layers)
    ]
    backend = get_backend("triton")
    max_blocks = num_blocks // batch + 1

    def eager() -> object:
        b = flatten_plan(plan, BLOCK_SIZE, device)
        with torch.inference_mode():
            return model(b.input_ids, b.positions, caches, b.meta, backend, b.sample_rows)

    times = {"eager (flatten_plan)": timed(eager, device, 2, repeat)}
    runners: list[tuple[str, GraphRunner]] = [("static buffers, call", EagerCalls((batch,)))]
    if device.type == "cuda":
        runners.append(("static buffers, CUDA graph", CudaGraphs((batch,), device)))
    for name, runner in runners:
        buffers = StepBuffers(batch, max_blocks, BLOCK_SIZE, num_blocks, device)
        path = DecodePath(model, caches, backend, buffers, runner, context + 1)

        def step(p: DecodePath = path) -> object:
            with torch.inference_mode():
                return p.run(plan, batch, native=False)  # a decode step of exactly a captured size

        times[name] = timed(step, device, 2, repeat)
        del path, buffers
    return times


def part_decode(args: argparse.Namespace, device: torch.device, dtype: torch.dtype, say: Any) -> None:
    bandwidth = copy_bandwidth(device, 4 << 30 if device.type == "cuda" else 1 << 20)
    say(f"measured copy bandwidth: {bandwidth / 1e9:.1f} GB/s")
    for shape in args.shapes:
        model = build_model(shape, device, dtype)
        assert model is not None, "the engine's model is not importable"
        for batch in args.batches:
            step_bytes = weights_bytes(shape) + batch * (args.context + 1) * kv_bytes_per_token(shape)
            times = decode_steps(model, shape, batch, args.context, device, args.repeat)
            base = times["eager (flatten_plan)"]
            for name, t in times.items():
                say(
                    f"{shape.name:<12}{batch:>6}  {name:<28}{t * 1e3:>9.2f} ms{batch / t:>10.1f} tok/s"
                    f"{step_bytes / t / bandwidth:>7.1%} MBU{base / t:>7.2f}x"
                )
        del model
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()


def busy_run(llm: Any, prompts: list[Any], params: list[Any]) -> tuple[float, float]:
    """(wall seconds, GPU-busy fraction) of one generate under the profiler."""
    from torch.profiler import ProfilerActivity, profile

    sync(torch.device("cuda"))
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        llm.generate(prompts, params)
        torch.cuda.synchronize()
        wall = time.perf_counter() - start
    kernels = sum(e.device_time_total for e in prof.key_averages() if e.device_type.name == "CUDA")
    return wall, kernels / 1e6 / wall


def part_smollm2(args: argparse.Namespace, say: Any) -> None:
    from bench.gpu import gpu_smollm2 as smol
    from kvfleet.engine import LLM

    sys.path.insert(
        0, str(Path(smol.__file__).resolve().parents[1])
    )  # hf_batch imports bench/offline_throughput
    sargs = smol.parse(["--num-prompts", str(args.num_prompts)])
    requests = smol.offline_requests(sargs)
    params = [SamplingParams(temperature=0.0, max_tokens=r.max_tokens, ignore_eos=True) for r in requests]
    outputs = sum(r.max_tokens for r in requests)
    best = None
    for eager in (False, True):
        llm = LLM(model="smollm2", dtype="bfloat16", kv_cache_memory=4 << 30, enforce_eager=eager)
        llm.generate([requests[0].prompt], params[:1])  # warm-up
        torch.cuda.synchronize()
        start = time.perf_counter()
        llm.generate([r.prompt for r in requests], params)
        torch.cuda.synchronize()
        wall = time.perf_counter() - start
        _, busy = busy_run(llm, [r.prompt for r in requests[:64]], params[:64])
        label = "enforce_eager" if eager else "CUDA graphs"
        say(
            f"  kvfleet SmolLM2 bf16 {label:<14} {wall:.2f} s, {outputs / wall:.0f} output tok/s, GPU busy {busy:.1%}"
        )
        best = wall if best is None else best
        del llm
        gc.collect()
        torch.cuda.empty_cache()
    hf = smol.hf_model(smol.smollm2_gguf(), torch.bfloat16, "cuda")
    hf_best = None
    for b in (32, 128):
        start = time.perf_counter()
        for i in range(0, len(requests), b):
            smol.hf_batch(hf, requests[i : i + b], "cuda")
        torch.cuda.synchronize()
        s = time.perf_counter() - start
        hf_best = s if hf_best is None else min(hf_best, s)
        say(f"  transformers static batch {b}: {s:.2f} s, {outputs / s:.0f} output tok/s")
    assert best is not None and hf_best is not None
    say(f"  kvfleet (CUDA graphs) vs transformers' best static batch: {hf_best / best:.2f}x")


def bench_parser(doc: str) -> argparse.ArgumentParser:
    """The flags this script and gpu_fp8.py share: where the figures go, the smoke run, the decode cells."""
    p = argparse.ArgumentParser(description=doc.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or "bench/results"))
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--batches", default="1,8,32,128")
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--repeat", type=int, default=20)
    return p


def bench_device(
    args: argparse.Namespace, results: str
) -> tuple[bool, torch.device, torch.dtype, Callable[[str], None]]:
    """Whether the run is on CUDA, its device and dtype (bf16 there; fp32 for the CPU smoke run, whose
    cells shrink), and ``say``: prints a line and rewrites ``args.out / results`` with every line so
    far (a run cut short keeps its figures)."""
    args.batches = [int(b) for b in args.batches.split(",")]
    cuda = torch.cuda.is_available() and not args.smoke
    device, dtype = (torch.device("cuda"), torch.bfloat16) if cuda else (torch.device("cpu"), torch.float32)
    if args.smoke:
        args.batches, args.context, args.repeat = [1, 3], 40, 1
    args.out.mkdir(parents=True, exist_ok=True)
    lines: list[str] = []

    def say(line: str) -> None:
        print(line, flush=True)
        lines.append(line)
        (args.out / results).write_text("\n".join(lines) + "\n")

    say(f"device: {torch.cuda.get_device_name() if cuda else 'cpu (smoke)'}; torch {torch.__version__}")
    return cuda, device, dtype, say


def main(argv: list[str]) -> int:
    p = bench_parser(__doc__ or "")
    p.add_argument("--num-prompts", type=int, default=256)
    p.add_argument("--skip-smollm2", action="store_true")
    p.add_argument("--skip-decode", action="store_true", help="only SmolLM2 (the GGUF's second call)")
    args = p.parse_args(argv)
    cuda, device, dtype, say = bench_device(args, "gpu_graphs.txt")
    args.shapes = [KNOWN_MODELS["llama-3-8b"]] if cuda else [SMOKE_SHAPE]
    if not args.skip_decode:
        part_decode(args, device, dtype, say)
    if cuda and not args.skip_smollm2:
        part_smollm2(args, say)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
