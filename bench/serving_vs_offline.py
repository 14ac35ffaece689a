"""HTTP serving vs the offline engine on the tiny model: output tokens/s ratio (target >= 0.9), TTFT p50/p99.

Both sides run the same prompts (token ids), greedy, exactly ``--output-len`` tokens each
(``ignore_eos``), with the same engine settings. Offline: ``LLM.generate`` with every prompt
at once, run before and after the serving run (a busy machine drifts; the baseline is their
mean). Serving: a ``kvfleet engine --model tiny`` process, streamed by ``kvfleet bench``'s
load core from this process at ``--concurrency`` (32).

Both processes run torch with one intra-op thread (``OMP_NUM_THREADS=1``, set here before torch
loads and inherited by the engine process): on a busy 2-core machine torch's default of two
spinning OpenMP threads made steps up to 70 times slower and the comparison meaningless.

    python bench/serving_vs_offline.py [--num-requests 64] [--input-len 32] [--output-len 16]
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import random
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch loads (see the docstring)

from engine_process import engine_process  # noqa: E402

from kvfleet.bench import LoadSpec, parse_distribution, run_load  # noqa: E402
from kvfleet.bench.load import plan_requests  # noqa: E402
from kvfleet.engine.llm import LLM  # noqa: E402
from kvfleet.engine.sampling_params import SamplingParams  # noqa: E402


def offline_run(prompts: list[list[int]], output_len: int, engine_flags: dict[str, int]) -> tuple[int, float]:
    """(output tokens, seconds) of one ``LLM.generate`` over every prompt at once, after a warm-up."""
    llm = LLM("tiny", **engine_flags)
    llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2))
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    return sum(len(o.outputs[0].token_ids) for o in outs), time.perf_counter() - start


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--input-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--num-kv-blocks", type=int, default=1024)
    args = p.parse_args()
    spec = LoadSpec(
        url="",
        model="tiny",
        num_requests=args.num_requests,
        concurrency=args.concurrency,
        input_len=parse_distribution(f"fixed:{args.input_len}"),
        output_len=parse_distribution(f"fixed:{args.output_len}"),
        extra_body={"ignore_eos": True},
    )
    prompts = [list(r.prompt) for r in plan_requests(spec, random.Random(spec.seed))]  # what run_load sends
    engine_flags = {"num_kv_blocks": args.num_kv_blocks, "max_num_seqs": args.concurrency}

    offline = [offline_run(prompts, args.output_len, engine_flags)]
    flags = (
        "--model",
        "tiny",
        "--num-kv-blocks",
        str(args.num_kv_blocks),
        "--max-num-seqs",
        str(args.concurrency),
    )
    with engine_process(*flags) as url:
        warm = LoadSpec(url=url, model="tiny", num_requests=2, output_len=parse_distribution("fixed:2"))
        asyncio.run(run_load(warm))
        result = asyncio.run(run_load(dataclasses.replace(spec, url=url)))
    offline.append(offline_run(prompts, args.output_len, engine_flags))
    s = result.summary()
    offline_tps = sum(t for t, _ in offline) / sum(d for _, d in offline)

    print(
        f"tiny model, {args.num_requests} requests x {args.input_len} prompt + {args.output_len} output tokens"
    )
    print(
        f"concurrency {args.concurrency}, {args.num_kv_blocks} KV blocks, CPU, OMP_NUM_THREADS={os.environ['OMP_NUM_THREADS']}"
    )
    for i, (tokens, seconds) in enumerate(offline):
        print(
            f"offline LLM.generate, run {i + 1}: {tokens} tokens in {seconds:.2f} s = {tokens / seconds:.1f} tok/s"
        )
    print(
        f"HTTP serving, streamed: {s.total_output_tokens} tokens in {s.duration_s:.2f} s = "
        f"{s.output_token_throughput:.1f} tok/s ({s.num_failed} failed)"
    )
    print(f"serving / offline tokens/s: {s.output_token_throughput / offline_tps:.3f} (target >= 0.9)")
    assert s.ttft is not None and s.tpot is not None
    print(f"TTFT p50 {s.ttft.p50 * 1e3:.1f} ms, p99 {s.ttft.p99 * 1e3:.1f} ms")
    print(f"TPOT p50 {s.tpot.p50 * 1e3:.1f} ms, p99 {s.tpot.p99 * 1e3:.1f} ms")


if __name__ == "__main__":
    main()
