"""kvfleet beside its peers on one CPU model: vLLM (CPU build) and transformers, offline and serving.

Same fp32 weights from the same Hugging Face folder for every contender (``--model``:
``smollm2`` resolves through ``kvfleet.engine.loader.sources.resolve_model`` where that
module exists, else give a folder), same prompts, every request generating exactly its
output budget (greedy, ``ignore_eos``). One run measures:

1. offline: kvfleet ``LLM.generate``, vLLM ``LLM.generate`` and transformers ``generate`` in
   left-padded static batches (``--hf-batch-sizes``, the best counts), each in a process of
   its own (``bench/peers/peers_offline.py``; vLLM under its own venv, ``bench/peers/vllm_env.sh``);
   output and total (prompt + output) tokens/s, ratios kvfleet/vLLM and kvfleet/HF;
2. serving: ``kvfleet engine`` and vLLM's OpenAI server through ``kvfleet bench``'s load
   core (``run_load``), closed loop at each ``--concurrency``, chat prompts of ``--input-len``
   words (about a token each) and outputs of ``--output-len`` tokens, two workloads:
   ``random`` (unrelated prompts) and ``shared`` (the first ``--shared-fraction`` of every
   prompt is one prefix all requests share, a long common system prompt); output and
   total tokens/s, TTFT and ITL p50/p99, ratios kvfleet/vLLM (vLLM's best thread setting);
3. roof: each row's model FLOP/s (2 x matmul parameters per token, the LM head for output
   tokens only, causal attention 2 x layers x q-width x context^2 per request) over the
   best fp32 ``torch.mm`` GFLOP/s of this machine on ``--roof-threads`` threads, measured
   in the same run.

vLLM's CPU build runs its model on one torch thread by default here; ``--vllm-threads
default,2`` measures it as it comes (its model on one thread: vLLM keeps a core for its
scheduler) and with its model bound to 2 cores (``VLLM_CPU_OMP_THREADS_BIND=0-1``,
``OMP_NUM_THREADS=2``, numpy's OpenBLAS on one thread), and kvfleet is
compared with the better of the two. ``--kvfleet-threads`` does the same for kvfleet
(``default``: torch's own choice, one thread per core).

    python -m bench.peers.peers --model smollm2 # the full run (about 20-25 min on a quiet 2-core machine)
    python -m bench.peers.peers --smoke         # a few requests of each part, to check it end to end
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import random
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

from bench.common import RESULTS, omp_threads, resolve_model, side_venv, thread_env
from bench.peers.roof import Row, Shape, matmul_roof, ms, pct, table
from kvfleet.bench import LoadSpec, parse_distribution, run_load
from kvfleet.bench.load import plan_requests
from kvfleet.bench.stats import RequestRecord, summarize
from kvfleet.testing.processes import engine_process as engine_process_handle
from kvfleet.testing.processes import free_port, stop, wait_http


def vllm_env(args: argparse.Namespace, threads: str) -> dict[str, str]:
    """vLLM's CPU worker binds its model's OpenMP threads itself and, by default (``auto``), keeps
    one core per rank for its scheduler process: on 2 cores the model runs on 1 thread whatever
    ``OMP_NUM_THREADS`` says. A thread count here binds that many cores, 0 .. N-1
    (``VLLM_CPU_OMP_THREADS_BIND``), so that vLLM's model really runs on N threads."""
    extra = {"VLLM_CPU_KVCACHE_SPACE": str(args.vllm_kv_gib), "VLLM_LOGGING_LEVEL": "WARNING"}
    if threads != "default":
        extra["VLLM_CPU_OMP_THREADS_BIND"] = f"0-{int(threads) - 1}"
    return thread_env(threads, **extra)


# ---------------------------------------------------------------- offline


def offline_requests(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Token-id prompts (printable byte-level ids, as ``kvfleet bench`` draws them) and output budgets."""
    spec = LoadSpec(
        url="", num_requests=args.num_prompts, input_len=args.input_dist, output_len=args.output_dist
    )
    return [
        {"prompt": p.prompt, "max_tokens": p.max_tokens}
        for p in plan_requests(spec, random.Random(args.seed))
    ]


def run_worker(python: str, engine: str, folder: Path, file: Path, env: dict[str, str], timeout: float,
               *extra: str) -> list[dict[str, Any]]:  # fmt: skip
    """``bench/peers/peers_offline.py`` in a process of its own (from a scratch folder: the repository's ``operator/``
    would shadow the standard library's); its result rows."""
    argv = [python, str(Path(__file__).with_name("peers_offline.py")), "--engine", engine, "--model", str(folder),
            "--requests", str(file), *extra]  # fmt: skip
    with tempfile.TemporaryDirectory() as cwd:
        proc = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    for line in proc.stdout.splitlines():
        if line.startswith("PEERS_RESULT "):
            return list(json.loads(line.removeprefix("PEERS_RESULT ")))
    raise RuntimeError(f"{engine} offline worker failed ({proc.returncode}):\n{proc.stderr[-4000:]}")


def offline(args: argparse.Namespace, folder: Path, shape: Shape, say: Any) -> list[Row]:
    requests = offline_requests(args)
    flops = sum(shape.flops(len(r["prompt"]), r["max_tokens"]) for r in requests)
    rows: list[Row] = []
    with tempfile.TemporaryDirectory() as tmp:
        file = Path(tmp) / "requests.json"
        file.write_text(json.dumps(requests))
        jobs: list[tuple[str, str, str, dict[str, str], tuple[str, ...]]] = []
        for t in args.kvfleet_threads:
            jobs.append((f"threads={t}", sys.executable, "kvfleet", thread_env(t), ()))
        for t in args.vllm_threads:
            jobs.append((f"threads={t}", args.vllm_python, "vllm", vllm_env(args, t), ()))
        for t in args.hf_threads:
            jobs.append(
                (f"threads={t}", sys.executable, "hf", thread_env(t), ("--batch-sizes", args.hf_batch_sizes))
            )
        for label, python, engine, env, extra in jobs:
            for r in run_worker(python, engine, folder, file, env, args.worker_timeout, *extra):
                row = Row("offline", f"{r['name']}, {label} ({r['torch_threads']} torch)", r["seconds"],
                          r["prompt_tokens"], r["output_tokens"], flops, extra={"engine": engine})  # fmt: skip
                rows.append(row)
                say(f"  {row.name}: {row.out_tps:.1f} output tok/s, {row.total_tps:.1f} total tok/s")
    return rows


# ---------------------------------------------------------------- serving


@contextlib.contextmanager
def vllm_server(
    args: argparse.Namespace, folder: Path, threads: str, dtype: str = "float32"
) -> Iterator[str]:
    """vLLM's OpenAI server on 127.0.0.1 (``python -m vllm.entrypoints.openai.api_server``); stopped at the end."""
    port = free_port()
    argv = [args.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(folder),
            "--dtype", dtype, "--host", "127.0.0.1", "--port", str(port), "--seed", str(args.seed),
            "--max-model-len", str(args.max_model_len)]  # fmt: skip

    def ready(url: str, proc: subprocess.Popen[bytes]) -> None:
        wait_http(url + "/v1/models", proc, timeout_s=args.start_timeout)

    with logged_server(argv, vllm_env(args, threads), port, "vllm.log", ready) as url:
        yield url


@contextlib.contextmanager
def logged_server(
    argv: list[str],
    env: dict[str, str],
    port: int,
    log_name: str,
    ready: Callable[[str, subprocess.Popen[bytes]], None],
) -> Iterator[str]:
    """A peer's server on 127.0.0.1:``port``, run in a scratch folder with its output in ``log_name``
    there; yields its URL once ``ready(url, proc)`` returns (the log's tail on stderr where that
    raises ``RuntimeError``); stopped at the end."""
    with tempfile.TemporaryDirectory() as cwd, open(Path(cwd) / log_name, "wb") as log:
        proc = subprocess.Popen(argv, cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            url = f"http://127.0.0.1:{port}"
            try:
                ready(url, proc)
            except RuntimeError:
                sys.stderr.write((Path(cwd) / log_name).read_text(errors="replace")[-4000:])
                raise
            yield url
        finally:
            stop([proc])


@contextlib.contextmanager
def kvfleet_server(args: argparse.Namespace, folder: Path, threads: str) -> Iterator[str]:
    flags = ["--model", str(folder), "--dtype", "float32", "--device", "cpu", "--seed", str(args.seed),
             "--max-model-len", str(args.max_model_len)]  # fmt: skip
    # the engine holds numpy's OpenBLAS to one thread itself
    with omp_threads(threads), engine_process_handle(*flags, ready_timeout_s=args.start_timeout) as (url, _):
        yield url


def load_spec(args: argparse.Namespace, workload: str, concurrency: int) -> LoadSpec:
    n = max(args.min_requests, args.rounds * concurrency)
    return LoadSpec(
        url="",
        endpoint="chat",
        num_requests=n,
        concurrency=concurrency,
        input_len=args.input_dist,
        output_len=args.output_dist,
        shared_prefix=args.shared_fraction if workload == "shared" else 0.0,
        seed=args.seed + 1000 * concurrency + (1 if workload == "shared" else 0),  # one prompt set per cell
        extra_body={"ignore_eos": True},
        timeout_s=args.worker_timeout,
    )


def serve_cells(args: argparse.Namespace, url: str, name: str, shape: Shape, say: Any) -> list[Row]:
    """Every (workload, concurrency) cell against one server; a short warm-up first."""
    warm = replace(load_spec(args, "random", 2), url=url, num_requests=2)
    asyncio.run(run_load(warm))
    rows = []
    for workload in args.workloads:
        for c in args.concurrency:
            spec = replace(load_spec(args, workload, c), url=url)
            result = asyncio.run(run_load(spec))
            s = summarize(result.records, result.duration_s)
            wanted = sum(p.max_tokens for p in plan_requests(spec, random.Random(spec.seed)))
            ok = [r for r in result.records if r.ok]
            row = Row("serving", name, s.duration_s, s.total_prompt_tokens, s.total_output_tokens,
                      flops(shape, ok), workload, c, pct(s.ttft), pct(s.itl), s.num_failed,
                      extra={"records": result.records})  # fmt: skip
            if s.num_failed or s.total_output_tokens != wanted:
                say(f"  WARNING {name} {workload} c={c}: {s.num_failed} failed {s.errors}, "
                    f"{s.total_output_tokens} output tokens of {wanted}")  # fmt: skip
            rows.append(row)
            say(f"  {name} {workload} c={c}: {row.out_tps:.1f} out tok/s, {row.total_tps:.1f} total tok/s, "
                f"TTFT p50/p99 {ms(row.ttft)} ms, ITL p50/p99 {ms(row.itl)} ms")  # fmt: skip
    return rows


def flops(shape: Shape, records: list[RequestRecord]) -> float:
    return sum(shape.flops(r.prompt_tokens, r.output_tokens) for r in records)


def serving(args: argparse.Namespace, folder: Path, shape: Shape, say: Any) -> list[Row]:
    rows: list[Row] = []
    for t in args.kvfleet_threads:
        with kvfleet_server(args, folder, t) as url:
            rows += serve_cells(args, url, f"kvfleet engine, threads={t}", shape, say)
    for t in args.vllm_threads:
        with vllm_server(args, folder, t) as url:
            rows += serve_cells(args, url, f"vLLM server, threads={t}", shape, say)
    return rows


# ---------------------------------------------------------------- main


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2", help="a Hugging Face folder, or a name kvfleet resolves")
    p.add_argument(
        "--parts", default="offline,serving", help="comma-separated: offline, serving (roof: always)"
    )
    p.add_argument("--smoke", action="store_true", help="a short end-to-end check: small sizes (< 5 min)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--input-len", default="uniform:64:512", help="prompt tokens (offline) / words (chat)")
    p.add_argument("--output-len", default="uniform:32:128")
    p.add_argument("--num-prompts", type=int, default=32, help="offline prompts")
    p.add_argument("--hf-batch-sizes", default="8,32", help="transformers static batch sizes tried")
    p.add_argument("--concurrency", default="1,8,32")
    p.add_argument("--workloads", default="random,shared")
    p.add_argument("--shared-fraction", type=float, default=0.8)
    p.add_argument("--min-requests", type=int, default=8, help="serving: requests per cell at least")
    p.add_argument("--rounds", type=int, default=1, help="serving: requests per cell = rounds x concurrency")
    p.add_argument("--kvfleet-threads", default="1,2", help="OMP_NUM_THREADS values ('default': unset)")
    p.add_argument("--vllm-threads", default="default,2", help="'' leaves vLLM out")
    p.add_argument("--hf-threads", default="1,2")
    p.add_argument("--roof-threads", type=int, default=2)
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--vllm-kv-gib", type=int, default=4, help="VLLM_CPU_KVCACHE_SPACE")
    p.add_argument("--start-timeout", type=float, default=600.0, help="seconds for a server to become ready")
    p.add_argument("--worker-timeout", type=float, default=1200.0, help="seconds for one offline contender")
    p.add_argument(
        "--out", type=Path, default=None, help="default: bench/results/peers.txt (peers_smoke.txt)"
    )
    args = p.parse_args(argv)
    if args.smoke:
        args.num_prompts, args.hf_batch_sizes, args.concurrency = 4, "4", "1,4"
        args.min_requests, args.rounds, args.output_len = 2, 1, "uniform:16:32"
        args.input_len, args.vllm_threads, args.kvfleet_threads, args.hf_threads = (
            "uniform:64:256",
            "2",
            "1",
            "1",
        )
    args.out = args.out or RESULTS / ("peers_smoke.txt" if args.smoke else "peers.txt")
    args.parts = set(args.parts.split(","))
    args.concurrency = [int(c) for c in args.concurrency.split(",")]
    args.workloads = args.workloads.split(",")
    # thread settings per contender; an empty list ("") leaves that contender out
    for name in ("kvfleet_threads", "vllm_threads", "hf_threads"):
        setattr(args, name, [t for t in getattr(args, name).split(",") if t])
    args.input_dist, args.output_dist = (
        parse_distribution(args.input_len),
        parse_distribution(args.output_len),
    )
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    folder = resolve_model(args.model)
    shape = Shape.of(folder)
    started = time.monotonic()
    lines = [
        f"# kvfleet vs vLLM (CPU) vs transformers on {args.model} ({folder}), fp32",
        f"# {time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime())}, {platform.processor() or platform.machine()}, "
        f"{os.cpu_count()} CPUs, load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}"
        + (", SMOKE sizes" if args.smoke else ""),
        f"# FLOPs: {shape.params / 1e6:.1f} M matmul weights + {shape.lm_head / 1e6:.1f} M LM head (output tokens), "
        f"attention 2 x {shape.layers} layers x {shape.q_width} x context^2 per request",
    ]
    for line in lines:
        print(line, flush=True)

    def say(text: str) -> None:
        print(text, flush=True)

    if args.vllm_threads:
        args.vllm_python = side_venv("vllm_env.sh", 1800)
    gflops, per_size = matmul_roof(args.roof_threads)
    roof = (f"roof: fp32 torch.mm on {args.roof_threads} threads, best {gflops:.1f} GFLOP/s "
            f"({', '.join(f'{n}: {g:.1f}' for n, g in per_size.items())})")  # fmt: skip
    say(roof)
    lines.append(roof)
    offline_rows = offline(args, folder, shape, say) if "offline" in args.parts else []
    serving_rows = serving(args, folder, shape, say) if "serving" in args.parts else []
    gflops_end, _ = matmul_roof(args.roof_threads)
    lines.append(f"roof again at the end: {gflops_end:.1f} GFLOP/s (roof % below uses the best of both)")
    lines.append("")
    lines += table(args, offline_rows, serving_rows, max(gflops, gflops_end))
    lines.append(f"# wall time {time.monotonic() - started:.0f} s, load average at the end "
                 f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}")  # fmt: skip
    text = "\n".join(lines)
    print("\n" + text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
