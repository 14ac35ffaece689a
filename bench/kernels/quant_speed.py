"""SmolLM2 served quantised (``--quantization gguf``) against today's float32 engine: decode steps
and a prefill step, both engines loaded side by side and timed in alternating rounds.

    OMP_NUM_THREADS=2 python -m bench.kernels.quant_speed [--rows 1,4,8] [--steps 24] [--prefill 256]
                                                          [--formats gguf,gguf-per-op,int8]

Decode: ``rows`` requests of a ~240-token prompt are prefilled, then ``engine.step()`` is timed
(median). Prefill: one step running a fresh ``--prefill``-token prompt (token ids differ per round,
so no round hits the prefix cache). Resident weight bytes (``quant_loader.resident_weight_bytes``)
are printed per engine, with the CPU's flags, the quantised kernels' path and the load average
before and after (a shared box: figures under load are noise). Writes bench/results/quant_speed.txt.
"""

from __future__ import annotations

import os
import statistics
import time

import torch

from bench.common import bench_args, cpu_name, publish
from kvfleet.engine.client.llm import LLM
from kvfleet.engine.kernels.native.cpu_features import probe_cpu_paths
from kvfleet.engine.kernels.native.int8_gemm import load_int8
from kvfleet.engine.kernels.native.quant_gemm import load_quant
from kvfleet.engine.loader.gguf_loader import resident_weight_bytes
from kvfleet.engine.sampling_params import SamplingParams

PROMPT = "Tell me a long story about a dragon and a knight. " * 20
PARAMS = SamplingParams(max_tokens=10_000, temperature=0.0, ignore_eos=True)


def load_average() -> str:
    return "load average " + ", ".join(f"{v:.2f}" for v in os.getloadavg())


def vector_flags() -> str:
    flags = probe_cpu_paths().flags
    return " ".join(sorted(f for f in flags if f.startswith(("avx2", "avx512", "amx", "fma", "f16c"))))


def decode_steps(llm: LLM, rows: int, steps: int, tag: str) -> list[float]:
    engine = llm.engine
    for i in range(rows):
        engine.add_request(f"{tag}{i}", PROMPT + tag + str(i), PARAMS)
    while engine.scheduler.waiting or any(not s.output_token_ids for s in engine.scheduler.running):
        engine.step()
    walls = []
    for _ in range(steps):
        start = time.perf_counter()
        engine.step()
        walls.append(time.perf_counter() - start)
    for i in range(rows):
        engine.abort(f"{tag}{i}")
    return walls


def prefill_step(llm: LLM, tokens: int, tag: str, seed: int) -> float:
    ids = [(7 * i + 7919 * seed) % 20000 + 100 for i in range(tokens)]  # fresh per seed: no cache hit
    llm.engine.add_request(tag, ids, PARAMS)
    start = time.perf_counter()
    llm.engine.step()
    took = time.perf_counter() - start
    llm.engine.abort(tag)
    return took


def build_engines(formats: list[str]) -> dict[str, LLM]:
    """float32 first (the baseline), then each format; ``gguf-per-op`` is the gguf model with its
    one-call decode turned off (the per-op path the one call replaced)."""
    # float32 at its fastest decode: native panels (what ``auto`` picks on a quiet box here) run the
    # one-call decode; a noisy start-up timing may pick oneDNN, which does not (packing/__init__.py)
    engines = {"float32": LLM("smollm2", max_model_len=1024, num_kv_blocks=512, weight_packing="native")}
    for name in formats:
        quantization = name.removesuffix("-per-op")
        engines[name] = LLM("smollm2", quantization=quantization, max_model_len=1024, num_kv_blocks=512)
        if name.endswith("-per-op"):
            engines[name].engine.runner.model.use_fused_decode = False
    return engines


def compare(label: str, times: dict[str, float]) -> str:
    """One line: every engine's median ms, and float32's over each (the speed-up)."""
    base = times["float32"]
    parts = [f"float32 {base * 1e3:6.1f} ms"]
    parts += [f"{name} {t * 1e3:6.1f} ms ({base / t:.2f}x)" for name, t in times.items() if name != "float32"]
    return f"{label}: " + "  ".join(parts)


def main() -> None:
    args = bench_args(__doc__, rows="1,4,8", steps=24, rounds=2, prefill=256, formats="gguf,gguf-per-op,int8")
    engines = build_engines(args.formats.split(","))
    med = statistics.median
    native, int8 = load_quant(), load_int8()
    lines = [
        f"CPU: {cpu_name()}, {torch.get_num_threads()} threads; SmolLM2-135M: Q4_1 GGUF, int8 from the float32 weights",
        f"flags: {vector_flags()}; gguf kernel path: {native.path if native else 'not built'}; "
        f"int8 kernel path: {int8.path if int8 else 'not built'}",
        f"before: {load_average()}",
    ]
    resident = len(lines)
    for rows in (int(r) for r in args.rows.split(",")):
        times: dict[str, list[float]] = {name: [] for name in engines}
        for r in range(args.rounds):
            for name, llm in engines.items():
                times[name] += decode_steps(llm, rows, args.steps // args.rounds, f"d{rows}-{r}-")
        lines.append(compare(f"decode {rows} rows, per step", {n: med(t) for n, t in times.items()}))
    pre: dict[str, list[float]] = {name: [] for name in engines}
    for r in range(3):
        for name, llm in engines.items():
            pre[name].append(prefill_step(llm, args.prefill, f"p{r}", r + 1))
    lines.append(compare(f"prefill {args.prefill} tokens", {n: med(t) for n, t in pre.items()}))
    for name, llm in reversed(engines.items()):  # after the runs: the weights as packed by then
        model = llm.engine.runner.model
        one_call = "one-call decode" if model.fused_decode() is not None else "per-op decode"
        line = f"{name:12s} resident weights {resident_weight_bytes(model) / 1e6:7.1f} MB  ({one_call})"
        lines.insert(resident, line)
    lines.append(f"after: {load_average()}")
    publish(lines, "quant_speed.txt")


if __name__ == "__main__":
    main()
