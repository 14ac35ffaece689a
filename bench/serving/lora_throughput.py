"""Multi-LoRA offline throughput: the same prompts with 0, 1, 4 and 16 adapters mixed uniformly, as a
ratio to the base model alone (issue #15's goal: >= 0.8 at 4 adapters).

The model is ``tiny`` by default (``--model smollm2`` for the real one). Adapters are written here
in PEFT's format with random weights, rank ``--rank`` on all seven projections (q/k/v/o, gate/up/
down: the heaviest case), and registered with ``lora_modules``; ``max_loras`` is the number of
adapters (all resident), and one more row runs 16 adapters through 4 slots (the scheduler holds
the others back; slots are swapped as requests finish). Request ``i`` runs under adapter
``i % k``; every request generates exactly its output length (greedy, EOS ignored).

The box is shared and noisy: each configuration runs ``--repeats`` times, interleaved with the
others, and the medians are printed with the load average before and after. Throughput is output
tokens per second of wall time. Run: ``python -m bench.serving.lora_throughput [--model tiny]
[--num-prompts 64] [--repeats 3] [--rank 8]``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from kvfleet.engine import LLM, SamplingParams
from kvfleet.engine.loader.sources import resolve_model
from kvfleet.engine.lora.config import TARGET_MODULES
from kvfleet.engine.lora.weights import module_shapes
from kvfleet.engine.model.config import ModelConfig


def write_adapter(folder: Path, config: ModelConfig, rank: int, seed: int) -> Path:
    folder.mkdir(parents=True)
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config.num_layers):
        for module, (fan_in, fan_out) in module_shapes(config).items():
            part = "self_attn" if module in TARGET_MODULES[:4] else "mlp"
            key = f"base_model.model.model.layers.{layer}.{part}.{module}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, fan_in, generator=gen) * 0.05
            tensors[f"{key}.lora_B.weight"] = torch.randn(fan_out, rank, generator=gen) * 0.05
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    spec = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(TARGET_MODULES)}
    (folder / "adapter_config.json").write_text(json.dumps(spec))
    return folder


def workload(n: int, seed: int) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    return [
        ([rng.randrange(1, 250) for _ in range(rng.randint(32, 128))], rng.randint(32, 64)) for _ in range(n)
    ]


def run(llm: LLM, requests: list[tuple[list[int], int]], adapters: list[str]) -> float:
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for _, n in requests]
    loras = [adapters[i % len(adapters)] if adapters else None for i in range(len(requests))]
    start = time.perf_counter()
    outs = llm.generate([p for p, _ in requests], params, lora=loras)
    elapsed = time.perf_counter() - start
    return sum(len(o.outputs[0].token_ids) for o in outs) / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rank", type=int, default=8)
    args = parser.parse_args()
    folder = resolve_model(args.model)
    config = ModelConfig.from_file(folder / "config.json")
    requests = workload(args.num_prompts, seed=0)
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        paths = {f"a{i}": str(write_adapter(Path(tmp) / f"a{i}", config, args.rank, i)) for i in range(16)}
        configs = {"base only": (0, 1), "1 adapter": (1, 1), "4 adapters": (4, 4), "16 adapters": (16, 16)}
        configs["16 adapters, 4 slots"] = (16, 4)
        engines = {}
        for label, (k, slots) in configs.items():
            modules = {name: paths[name] for name in list(paths)[:k]}
            engines[label] = LLM(
                model=args.model, max_num_seqs=args.batch_size, enable_lora=True, max_loras=slots,
                lora_modules=modules, max_lora_rank=args.rank,
            )  # fmt: skip
            run(engines[label], requests[:4], list(modules))  # warm-up
        results: dict[str, list[float]] = {label: [] for label in configs}
        for _ in range(args.repeats):
            for label, (k, _slots) in configs.items():
                results[label].append(run(engines[label], requests, list(paths)[:k]))
    load_after = os.getloadavg()
    base = statistics.median(results["base only"])
    print(f"model={args.model} prompts={args.num_prompts} (in 32-128, out 32-64 tokens) batch={args.batch_size} "
          f"rank={args.rank} on q/k/v/o/gate/up/down, torch threads={torch.get_num_threads()}")  # fmt: skip
    print(f"load average before {load_before[0]:.2f} {load_before[1]:.2f}, after {load_after[0]:.2f} "
          f"{load_after[1]:.2f}; {args.repeats} interleaved runs per configuration, medians")  # fmt: skip
    print(f"{'configuration':<24} {'tok/s (median)':>15} {'ratio to base':>14}   runs")
    for label, values in results.items():
        median = statistics.median(values)
        runs = " ".join(f"{v:.0f}" for v in values)
        print(f"{label:<24} {median:>15.1f} {median / base:>14.2f}   {runs}")


if __name__ == "__main__":
    main()
