"""Offline throughput: kvfleet's engine vs transformers' generate, and continuous vs static batching.

The same model (``tiny`` by default) and the same prompts for every contender: ``--num-prompts``
prompts (256 in the issue's workload) with input lengths uniform in [16, 512] tokens and
output lengths uniform in [16, 256] tokens, drawn from a fixed seed; every request
generates exactly its output length (greedy, EOS ignored).

Contenders, each with at most ``--batch-size`` sequences at a time:
- kvfleet, continuous batching (scheduling_policy="fcfs"): a finished sequence's slot is
  refilled at the next step, prefill chunks mix with decodes;
- kvfleet, static batches (scheduling_policy="static"): a new batch starts only when the
  whole previous batch has finished;
- transformers ``generate`` in padded static batches (left padding, every row runs to the
  batch's longest output).

Three more rows:
- kvfleet static batches *padded*: each request generates its batch's longest output, and
  only its own output length counts as useful. This is the static batching of a server that
  keeps a batch's rows in one tensor until the last finishes, as transformers ``generate``
  and the baselines of the Orca and vLLM papers do; kvfleet's plain static policy drops a
  finished row at once, which is already half of iteration-level scheduling;
- kvfleet continuous at the same KV memory as the static batch: the blocks a contiguous
  allocator reserves for ``--batch-size`` sequences of the longest prompt + output, up to 256
  sequences in them (paging is what lets more sequences share that memory);
- kvfleet continuous with the ``torch`` reference attention backend: the gain of the native
  ``cpu`` decode kernel that ``auto`` picks on a CPU.

Throughput is useful output tokens (the ones requested) per second of wall time; the
printed ratios compare contenders measured in the same run.

A second, clearly labelled SIMULATED section runs the same workload, continuous vs static,
through the real engine (scheduler, KV accounting, output processing) over
``engine/sim.py``'s ``SimRunner``: each step's time comes from the capacity-maths
``TimingModel`` of a named GPU and model (weights read once per step + compute per batched
token + KV read per context token). The timing model sees only the step's plan, never the
policy, so the ratio shows what the schedule alone gains where a step's cost barely depends
on its batch size. It is a model of GPU step cost, not a measurement. Run:
``python -m bench.serving.offline_throughput [--num-prompts 256] [--batch-size 32] [--model tiny]
[--sim-gpu h100] [--sim-model llama-3-8b]``.
"""

from __future__ import annotations

import os
import platform
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM

from bench.common import Flag, TokenRates, bench_args
from kvfleet.engine import LLM, SamplingParams
from kvfleet.engine.config import EngineConfig
from kvfleet.engine.core.engine import Engine
from kvfleet.engine.loader.sources import resolve_model
from kvfleet.engine.runner.model_runner import resolve_backend
from kvfleet.engine.sim import SimRunner, TimingModel, kv_blocks_for_hardware
from kvfleet.engine.testing.tiny import BOS_ID, PAD_ID
from kvfleet.engine.tokenizer.byte_level import ByteTokenizer


@dataclass(frozen=True)
class Request:
    prompt: list[int]
    output_len: int


@dataclass(frozen=True)
class Result(TokenRates):
    name: str
    seconds: float
    output_tokens: int
    prompt_tokens: int


def workload(n: int, seed: int, vocab: int = 256) -> list[Request]:
    rng = random.Random(seed)
    requests = []
    for _ in range(n):
        input_len, output_len = rng.randint(16, 512), rng.randint(16, 256)
        prompt = [BOS_ID] + [rng.randrange(vocab) for _ in range(input_len - 1)]
        requests.append(Request(prompt, output_len))
    return requests


MAX_LEN = 512 + 256  # the workload's longest prompt plus its longest output
BLOCK_SIZE = 16


def equal_memory_blocks(batch_size: int) -> int:
    """KV blocks of the memory a contiguous allocator reserves for ``batch_size`` max-length sequences."""
    return batch_size * MAX_LEN // BLOCK_SIZE


def generated_lengths(requests: list[Request], batch_size: int, padded: bool) -> list[int]:
    """Tokens each request generates: its own output length, or (``padded``) its static batch's longest."""
    if not padded:
        return [r.output_len for r in requests]
    lengths = []
    for i in range(0, len(requests), batch_size):
        batch = requests[i : i + batch_size]
        lengths += [max(r.output_len for r in batch)] * len(batch)
    return lengths


def config(model: str, policy: str, batch_size: int, num_kv_blocks: int | None, **extra: Any) -> EngineConfig:
    """The engine every contender of this bench runs, real or simulated: ``policy`` at ``batch_size`` rows."""
    return EngineConfig(
        model=model,
        scheduling_policy=policy,
        max_num_seqs=batch_size,
        max_num_batched_tokens=2048,
        block_size=BLOCK_SIZE,
        num_kv_blocks=num_kv_blocks,
        **extra,
    )


def run_kvfleet(
    name: str,
    model: Path,
    requests: list[Request],
    policy: str,
    batch_size: int,
    num_kv_blocks: int | None = None,
    attention: str = "auto",
    padded: bool = False,
) -> Result:
    llm = LLM(
        engine=Engine(config(str(model), policy, batch_size, num_kv_blocks, attention_backend=attention))
    )
    lengths = generated_lengths(requests, batch_size, padded)
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in lengths]
    llm.generate([requests[0].prompt], params[:1])  # warm-up: first-call allocations
    start = time.perf_counter()
    outputs = llm.generate([r.prompt for r in requests], params)
    seconds = time.perf_counter() - start
    produced = [len(o.outputs[0].token_ids) for o in outputs]
    assert produced == lengths, "every request must produce its output length"
    # only the requested tokens count: a padded row's extra tokens are the waste being measured
    return Result(name, seconds, sum(r.output_len for r in requests), sum(len(r.prompt) for r in requests))


def run_simulated(
    requests: list[Request],
    policy: str,
    batch_size: int,
    gpu: str,
    model: str,
    num_kv_blocks: int | None = None,
    padded: bool = False,
) -> tuple[float, int]:
    """(simulated seconds, engine steps) for the workload under ``policy``; the timing model never sees the policy."""
    blocks = num_kv_blocks or kv_blocks_for_hardware(
        gpu, model, block_size=BLOCK_SIZE, max_num_seqs=batch_size
    )
    runner = SimRunner(blocks, TimingModel.for_hardware(gpu, model), sleep=lambda _: None)
    engine_config = config(model, policy, batch_size, blocks, max_model_len=4096)
    llm = LLM(engine=Engine(engine_config, runner=runner, tokenizer=ByteTokenizer()))
    lengths = generated_lengths(requests, batch_size, padded)
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in lengths]
    outputs = llm.generate([r.prompt for r in requests], params)
    assert [len(o.outputs[0].token_ids) for o in outputs] == lengths
    return runner.simulated_seconds, runner.num_steps


def print_simulated(requests: list[Request], batch_size: int, gpu: str, model: str) -> None:
    timing = TimingModel.for_hardware(gpu, model)
    print(
        f"SIMULATED ({model} on {gpu}, bf16; a model of GPU step cost, not a measurement): step = "
        f"{timing.base_s * 1e3:.2f} ms + {timing.per_token_s * 1e6:.1f} us/batched token + "
        f"{timing.per_context_token_s * 1e9:.1f} ns/context token; same prompts, same engine and scheduler"
    )
    out_tokens = sum(r.output_len for r in requests)
    memory = equal_memory_blocks(batch_size)
    rates = []
    contenders = (
        (f"continuous batching, batch {batch_size}", "fcfs", batch_size, None, False),
        (f"static batches, batch {batch_size}", "static", batch_size, None, False),
        (f"continuous, {memory} KV blocks, <= 256 seqs", "fcfs", 256, memory, False),
        (f"static batches, batch {batch_size}, padded", "static", batch_size, None, True),
    )
    for name, policy, seqs, blocks, padded in contenders:
        seconds, steps = run_simulated(requests, policy, seqs, gpu, model, blocks, padded)
        rates.append(out_tokens / seconds)
        print(
            f"  simulated kvfleet {name:<40} {steps:6d} steps {seconds:8.2f} simulated s  "
            f"{rates[-1]:9.1f} simulated output tok/s"
        )
    print(f"  simulated continuous / static, same batch size:  {rates[0] / rates[1]:.2f}x (target >= 2x)")
    print(f"  simulated continuous / static, same KV memory:   {rates[2] / rates[1]:.2f}x (target >= 2x)")
    print(f"  simulated continuous / padded static, same batch: {rates[0] / rates[3]:.2f}x (target >= 2x)")
    print(
        f"  simulated continuous / padded static, same KV memory: {rates[2] / rates[3]:.2f}x (target >= 2x)"
    )
    prompt_s = timing.per_token_s * sum(len(r.prompt) for r in requests)
    print(
        f"  (both contenders spend {prompt_s:.2f} simulated s on prompt-token compute alone; the gain is in "
        "decode steps, bounded by the decode-step ratio printed above)"
    )


def run_hf(model_dir: Path, requests: list[Request], batch_size: int) -> Result:
    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    start = time.perf_counter()
    for i in range(0, len(requests), batch_size):
        _hf_batch(model, requests[i : i + batch_size])
    seconds = time.perf_counter() - start
    return Result(
        "transformers generate (padded static batches)",
        seconds,
        sum(r.output_len for r in requests),
        sum(len(r.prompt) for r in requests),
    )


def left_padded(prompts: list[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, attention mask) of ``prompts`` padded on the left to the longest, as ``generate`` takes them."""
    width = max(map(len, prompts))
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt) :] = torch.tensor(prompt)
        mask[row, width - len(prompt) :] = 1
    return ids, mask


def _hf_batch(model: torch.nn.Module, batch: list[Request]) -> None:
    ids, mask = left_padded([r.prompt for r in batch], PAD_ID)
    longest = max(r.output_len for r in batch)
    with torch.inference_mode():
        model.generate(  # type: ignore[operator]
            ids, attention_mask=mask, do_sample=False, max_new_tokens=longest, pad_token_id=PAD_ID
        )


def main() -> None:
    args = bench_args(
        __doc__,
        model="tiny",
        num_prompts=256,
        batch_size=32,
        seed=0,
        sim_gpu=Flag("h100", "GPU of the simulated section (capacity maths)"),
        sim_model=Flag("llama-3-8b", "model shape of the simulated section"),
        repeats=Flag(2, "runs per contender; the fastest is printed"),
        sim_only=Flag(False, "skip the CPU measurements"),
        threads=Flag(1, "torch CPU threads for every contender (1: no spin-wait on a shared box)"),
    )
    torch.set_num_threads(args.threads)
    model = resolve_model(args.model)
    requests = workload(args.num_prompts, args.seed)
    print(
        f"offline throughput: model={args.model} prompts={len(requests)} batch={args.batch_size} "
        f"input 16-512, output 16-256 (seed {args.seed}); torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads, {platform.processor() or platform.machine()}, "
        f"cuda={torch.cuda.is_available()}; load {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores; "
        f"best of {args.repeats} runs per contender"
    )
    print(
        f"prompt tokens {sum(len(r.prompt) for r in requests)}, output tokens {sum(r.output_len for r in requests)}"
    )
    if args.sim_only:
        print(step_bound(requests, args.batch_size))
        print_simulated(requests, args.batch_size, args.sim_gpu, args.sim_model)
        return
    memory = equal_memory_blocks(args.batch_size)
    b = args.batch_size
    contenders: list[Callable[[], Result]] = [
        lambda: run_kvfleet(f"kvfleet continuous batching, batch {b}", model, requests, "fcfs", b),
        lambda: run_kvfleet(f"kvfleet static batches, batch {b}", model, requests, "static", b),
        lambda: run_hf(model, requests, b),
        lambda: run_kvfleet(
            f"kvfleet continuous, {memory} KV blocks, <= 256 seqs", model, requests, "fcfs", 256, memory
        ),
        lambda: run_kvfleet(
            f"kvfleet continuous, batch {b}, torch attention", model, requests, "fcfs", b, attention="torch"
        ),
        lambda: run_kvfleet(
            f"kvfleet static batches, batch {b}, padded", model, requests, "static", b, padded=True
        ),
    ]
    results = best_of(contenders, args.repeats)
    for r in results:
        print(
            f"{r.name:<52} {r.seconds:8.2f} s  {r.out_tps:9.1f} output tok/s  {r.total_tps:9.1f} total tok/s"
        )
    cont, static, hf, paged, reference, padded = results
    print(
        f"kvfleet continuous / transformers generate:         {cont.out_tps / hf.out_tps:.2f}x (target >= 3x)"
    )
    print(
        f"kvfleet continuous / kvfleet static, same batch:    {cont.out_tps / static.out_tps:.2f}x "
        "(target >= 2x)"
    )
    print(
        f"kvfleet continuous / kvfleet static, same KV memory: {paged.out_tps / static.out_tps:.2f}x "
        f"(target >= 2x; {memory} blocks of {BLOCK_SIZE} = what a contiguous allocator reserves for "
        f"{args.batch_size} sequences of {MAX_LEN} tokens, the static batch's worst case)"
    )
    print(
        f"kvfleet continuous / kvfleet static, padded, same batch: {cont.out_tps / padded.out_tps:.2f}x "
        "(target >= 2x; every row of a static batch steps until the batch's longest output, as a "
        "static-batching server computes it: the baseline of the Orca and vLLM papers)"
    )
    print(
        f"kvfleet continuous / static, padded, same KV memory: {paged.out_tps / padded.out_tps:.2f}x "
        "(target >= 2x)"
    )
    print(
        f"attention backend {resolve_backend('auto', torch.device('cpu'))!r} (auto) / 'torch': "
        f"{cont.out_tps / reference.out_tps:.2f}x"
    )
    print(step_bound(requests, args.batch_size))
    print_simulated(requests, args.batch_size, args.sim_gpu, args.sim_model)


def best_of(contenders: list[Callable[[], Result]], repeats: int) -> list[Result]:
    """Each contender's fastest of ``repeats`` runs, the runs taken in rounds so drift hits all alike."""
    rounds = [[run() for run in contenders] for _ in range(repeats)]
    return [min(runs, key=lambda r: r.seconds) for runs in zip(*rounds, strict=True)]


def step_bound(requests: list[Request], batch_size: int) -> str:
    """The continuous/static ratio if every decode step cost the same whatever the batch occupancy."""
    outs = [r.output_len for r in requests]
    static = sum(max(outs[i : i + batch_size]) for i in range(0, len(outs), batch_size))
    continuous = sum(outs) / batch_size
    return (
        f"decode steps: static batches {static} (each batch lasts its longest output), continuous >= "
        f"{continuous:.0f} (output tokens / batch): {static / continuous:.2f}x is the most continuous "
        "batching can gain over static when a step's cost does not depend on how many sequences it holds"
    )


if __name__ == "__main__":
    main()
