"""Where an engine step's time goes on a GPU: ``LLM.generate`` under cProfile, on random weights.

Where it sits: a benchmark for a session that is lent a GPU. The real SmolLM2 is a 98 MB GGUF
that travels in two calls; this needs one: ``prepare`` (here) writes the converted SmolLM2
folder without its weights (config, tokenizer, each tensor's name and shape) under
``.gpumodel/shapes``; ``run`` (there) fills it with random weights (std 0.02, bf16) and
profiles the offline workload of ``bench/gpu/gpu_smollm2.py``. Step times equal the real model's:
the same shapes, kernels and host work (greedy tokens differ, lengths do not: EOS is ignored).

    .venv/bin/python -m bench.gpu.gpu_step_profile prepare
    run(command="... python3 -m bench.gpu.gpu_step_profile run --out $OUT", carry=[".whl", ".gpumodel/shapes"])
Smoke-run on a CPU:  .venv/bin/python -m bench.gpu.gpu_step_profile all --smoke
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

SHAPES = Path(".gpumodel/shapes")


def prepare(folder: Path, dest: Path) -> None:
    """Copy ``folder`` but its weights; record each weight's name and shape in shapes.json."""
    from safetensors import safe_open

    dest.mkdir(parents=True, exist_ok=True)
    for f in folder.iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, dest / f.name)
    shapes = {}
    for f in folder.glob("*.safetensors"):
        with safe_open(f, "pt") as st:
            shapes.update({k: list(st.get_slice(k).get_shape()) for k in st.keys()})  # noqa: SIM118 - safe_open is not iterable
    (dest / "shapes.json").write_text(json.dumps(shapes))
    print(f"prepared {dest}: {len(shapes)} tensors")


def materialise(folder: Path, dtype: torch.dtype) -> None:
    from safetensors.torch import save_file

    shapes = json.loads((folder / "shapes.json").read_text())
    gen = torch.Generator().manual_seed(0)
    weights = {}
    for name, shape in shapes.items():
        t = torch.randn(shape, generator=gen) * 0.02
        weights[name] = (t + 1.0 if name.endswith("norm.weight") else t).to(dtype)
    save_file(weights, str(folder / "model.safetensors"))


def profile(folder: Path, args: argparse.Namespace) -> None:
    from gpu_smollm2 import offline_requests  # the same workload as the SmolLM2 run

    from kvfleet.engine import LLM, SamplingParams

    requests = offline_requests(args)
    llm = LLM(model=str(folder), dtype=args.dtype, kv_cache_memory=4 << 30)
    params = [SamplingParams(temperature=0.0, max_tokens=r.max_tokens, ignore_eos=True) for r in requests]
    llm.generate([r.prompt for r in requests[:8]], params[:8])  # warm-up: kernels compile
    steps = count_steps(llm)
    prof = cProfile.Profile()
    start = time.perf_counter()
    prof.enable()
    llm.generate([r.prompt for r in requests], params)
    prof.disable()
    seconds = time.perf_counter() - start
    outputs = sum(r.max_tokens for r in requests)
    n = steps()
    print(
        f"{len(requests)} prompts, {outputs} output tokens in {seconds:.2f} s: {outputs / seconds:.0f} tok/s; "
        f"{n} steps, {1000 * seconds / max(n, 1):.1f} ms a step; device {llm.engine.runner.device}, "
        f"attention {llm.engine.runner.backend.name}"
    )
    for key in ("tottime", "cumtime"):
        text = io.StringIO()
        pstats.Stats(prof, stream=text).sort_stats(key).print_stats(args.top)
        print(text.getvalue())
    if torch.cuda.is_available():
        device_table(llm, requests[:64], params[:64], args.top)


def device_table(llm: Any, requests: list[Any], params: list[Any], top: int) -> None:
    """torch.profiler over a smaller run: the GPU's own time per kernel beside the host's."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        llm.generate([r.prompt for r in requests], params)
    events = prof.key_averages()
    print(events.table(sort_by="self_device_time_total", row_limit=top))
    print(events.table(sort_by="self_cpu_time_total", row_limit=top))


def count_steps(llm: Any) -> Callable[[], int]:
    """Wrap the engine's ``step`` to count calls; returns a reader of the count."""
    engine = llm.engine
    inner = engine.step
    calls = [0]

    def step(*a: object, **k: object) -> object:
        calls[0] += 1
        return inner(*a, **k)

    engine.step = step
    return lambda: calls[0]


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("what", choices=["prepare", "run", "all"])
    p.add_argument("--out", type=Path, default=None, help="also write the report there")
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--num-prompts", type=int, default=256)
    p.add_argument("--input-len", default="uniform:64:512")
    p.add_argument("--output-len", default="uniform:32:128")
    p.add_argument("--top", type=int, default=30)
    args = p.parse_args(argv)
    args.dtype = "bfloat16" if torch.cuda.is_available() else "float32"
    if args.smoke:
        args.num_prompts, args.input_len, args.output_len, args.top = 4, "uniform:16:32", "uniform:4:8", 5
    if args.what in ("prepare", "all"):
        from kvfleet.engine.loader.sources import resolve_model

        prepare(resolve_model("smollm2"), SHAPES)
    if args.what in ("run", "all"):
        work = Path("/tmp/kvfleet-random-smollm2")
        shutil.rmtree(work, ignore_errors=True)
        shutil.copytree(SHAPES, work)
        materialise(work, getattr(torch, args.dtype))
        buffer = io.StringIO()
        real_stdout, sys.stdout = sys.stdout, buffer
        try:
            profile(work, args)
        finally:
            sys.stdout = real_stdout
        print(buffer.getvalue())
        if args.out:
            args.out.mkdir(parents=True, exist_ok=True)
            (args.out / "gpu_step_profile.txt").write_text(buffer.getvalue())
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
