"""HTTP serving vs the offline engine on the tiny model: output tokens/s ratio (target >= 0.9), TTFT p50/p99.

Both sides run the same prompts (token ids, the ones ``kvfleet bench`` draws for its seed),
greedy, exactly ``--output-len`` tokens each (``ignore_eos``), under one ``EngineConfig``:
the offline ``LLM`` is built from it and the server gets it as flags (printed below).
Offline: ``LLM.generate`` with every prompt at once, in this process. Serving: a
``kvfleet engine --model tiny`` process per ``--engine-core`` mode, streamed by a
``kvfleet bench --concurrency 32 --json`` process of its own (so the client's event loop
competes with neither side's GIL). Each run measures offline and then every mode back to
back, so a ratio compares neighbours in time; the figure is the median over ``--runs``.

Every process runs torch with one intra-op thread (``OMP_NUM_THREADS=1``, set here before
torch loads and inherited by the engine and its core): on a busy 2-core machine torch's
default of two spinning OpenMP threads made steps up to 70 times slower.

    python bench/serving_vs_offline.py [--runs 3] [--engine-core process,thread] [--num-requests 64]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch loads (see the docstring)

from engine_process import engine_process  # noqa: E402

from kvfleet.bench import LoadSpec, parse_distribution  # noqa: E402
from kvfleet.bench.load import plan_requests  # noqa: E402
from kvfleet.engine.config import EngineConfig  # noqa: E402
from kvfleet.engine.llm import LLM  # noqa: E402
from kvfleet.engine.sampling_params import SamplingParams  # noqa: E402


def server_flags(config: EngineConfig) -> list[str]:
    """``kvfleet engine`` flags that build exactly ``config`` (the fields this bench sets or relies on)."""
    assert config.num_kv_blocks is not None
    return [
        "--model", config.model, "--num-kv-blocks", str(config.num_kv_blocks),
        "--max-num-seqs", str(config.max_num_seqs), "--max-num-batched-tokens", str(config.max_num_batched_tokens),
        "--block-size", str(config.block_size), "--dtype", config.dtype, "--device", config.device,
        "--seed", str(config.seed), "--attention", config.attention_backend,
        "--scheduling-policy", config.scheduling_policy,
    ]  # fmt: skip


def offline_run(llm: LLM, prompts: list[list[int]], output_len: int) -> float:
    """Output tokens/s of one ``LLM.generate`` over every prompt at once."""
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    assert tokens == len(prompts) * output_len
    return tokens / (time.perf_counter() - start)


def client_run(url: str, args: argparse.Namespace, num_requests: int, output_len: int) -> dict[str, Any]:
    """``kvfleet bench --json`` in a process of its own; its summary."""
    cmd = [sys.executable, "-m", "kvfleet.cli", "bench", "--url", url, "--model", "tiny",
           "--concurrency", str(args.concurrency), "--num-requests", str(num_requests),
           "--input-len", f"fixed:{args.input_len}", "--output-len", f"fixed:{output_len}",
           "--ignore-eos", "--json", "--no-progress"]  # fmt: skip
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=600)
    summary: dict[str, Any] = json.loads(out.stdout)
    return summary


def bench_prompts(args: argparse.Namespace) -> list[list[int]]:
    """The prompts ``kvfleet bench`` sends with these flags (same spec, same seed)."""
    spec = LoadSpec(
        url="",
        model="tiny",
        num_requests=args.num_requests,
        concurrency=args.concurrency,
        input_len=parse_distribution(f"fixed:{args.input_len}"),
        output_len=parse_distribution(f"fixed:{args.output_len}"),
        extra_body={"ignore_eos": True},
    )
    return [list(r.prompt) for r in plan_requests(spec, random.Random(spec.seed))]


def load() -> str:
    return "load average " + " ".join(f"{x:.2f}" for x in os.getloadavg())


@contextlib.contextmanager
def servers(modes: list[str], config: EngineConfig) -> Iterator[dict[str, str]]:
    with contextlib.ExitStack() as stack:
        urls = {
            m: stack.enter_context(engine_process(*server_flags(config), "--engine-core", m)) for m in modes
        }
        yield urls


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--input-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--num-kv-blocks", type=int, default=1024)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--engine-core", default="process,thread", help="server modes to measure, comma-separated")
    args = p.parse_args()
    modes = args.engine_core.split(",")
    config = EngineConfig(
        model="tiny", device="cpu", num_kv_blocks=args.num_kv_blocks, max_num_seqs=args.concurrency
    )
    prompts = bench_prompts(args)

    print(
        f"tiny model, {args.num_requests} requests x {args.input_len} prompt + {args.output_len} output tokens"
    )
    print(
        f"concurrency {args.concurrency}, CPU, OMP_NUM_THREADS={os.environ['OMP_NUM_THREADS']}, {os.cpu_count()} CPUs"
    )
    print("engine (both sides): " + " ".join(server_flags(config)))
    print(f"start: {load()}")
    llm = LLM(config.model, **config.model_dump(exclude={"model"}))
    llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2))  # warm-up
    offline: list[float] = []
    serving: dict[str, list[dict[str, Any]]] = {m: [] for m in modes}
    with servers(modes, config) as urls:
        for url in urls.values():
            client_run(url, args, num_requests=args.concurrency, output_len=2)  # warm-up
        for run in range(args.runs):
            offline.append(offline_run(llm, prompts, args.output_len))
            line = f"run {run + 1}: offline {offline[-1]:.1f} tok/s"
            for mode, url in urls.items():
                s = client_run(url, args, args.num_requests, args.output_len)
                assert (
                    s["num_failed"] == 0 and s["total_output_tokens"] == args.num_requests * args.output_len
                ), s
                serving[mode].append(s)
                line += f", {mode} core {s['output_token_throughput']:.1f} tok/s"
            print(f"{line}  ({load()})")
    print(f"offline LLM.generate, median of {args.runs}: {statistics.median(offline):.1f} tok/s")
    for mode, runs in serving.items():
        report(mode, runs, offline)
    print(f"end: {load()}")


def report(mode: str, runs: list[dict[str, Any]], offline: list[float]) -> None:
    ratios = [s["output_token_throughput"] / o for s, o in zip(runs, offline, strict=True)]
    ratio = statistics.median(ratios)
    median_run = runs[ratios.index(sorted(ratios)[len(ratios) // 2])]
    tps = statistics.median(s["output_token_throughput"] for s in runs)
    print(
        f"HTTP serving, {mode} core: median {tps:.1f} tok/s; serving / offline tokens/s: "
        f"{ratio:.3f} (runs: {', '.join(f'{r:.3f}' for r in ratios)}; target >= 0.9)"
    )
    ttft, tpot = median_run["ttft"], median_run["tpot"]
    print(
        f"  median run: TTFT p50 {ttft['p50'] * 1e3:.1f} ms, p99 {ttft['p99'] * 1e3:.1f} ms; "
        f"TPOT p50 {tpot['p50'] * 1e3:.1f} ms, p99 {tpot['p99'] * 1e3:.1f} ms"
    )


if __name__ == "__main__":
    main()
