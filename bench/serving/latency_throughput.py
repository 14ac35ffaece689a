"""A latency–throughput table for one engine at several Poisson request rates, and the knee.

The engine is ``kvfleet engine --simulate`` timed as ``--sim-model`` on ``--sim-gpu`` (default
Llama 3 8B on an L4: about 55 ms per decode step, so the table shows the GPU's limits rather
than this machine's). For each rate ``kvfleet bench``'s load core sends ``--num-requests``
open-loop requests; the table gives what was achieved and the latency percentiles. The knee is
the first rate whose p99 TTFT leaves the SLO (``--slo-ttft-ms``); goodput counts requests that
met both SLOs.

    python -m bench.serving.latency_throughput [--rates 1,2,4,6,8,12] [--num-requests 60]
"""

from __future__ import annotations

import asyncio

from bench.common import Flag, bench_args
from kvfleet.bench import LoadSpec, parse_distribution, run_load
from kvfleet.bench.stats import BenchSummary
from kvfleet.testing.processes import engine_process


def _row(rate: float, s: BenchSummary, slo_ttft_s: float) -> str:
    assert s.ttft is not None and s.tpot is not None
    met = "yes" if s.ttft.p99 <= slo_ttft_s else "NO"
    return (
        f"{rate:>6.1f} {s.request_throughput:>8.2f} {s.output_token_throughput:>9.0f} "
        f"{s.ttft.p50 * 1e3:>9.0f} {s.ttft.p99 * 1e3:>9.0f} {s.tpot.p50 * 1e3:>9.1f} {s.tpot.p99 * 1e3:>9.1f} "
        f"{s.goodput or 0.0:>8.2f} {met:>6}"
    )


def main() -> None:
    args = bench_args(
        __doc__,
        rates=Flag("1,2,4,6,8,12", "requests/s, comma-separated"),
        num_requests=60,
        input_len="uniform:256:768",
        output_len="uniform:64:192",
        sim_gpu="l4",
        sim_model="llama-3-8b",
        max_num_seqs=64,
        slo_ttft_ms=1000.0,
        slo_tpot_ms=150.0,
    )
    rates = [float(r) for r in args.rates.split(",")]
    slo_ttft, slo_tpot = args.slo_ttft_ms / 1e3, args.slo_tpot_ms / 1e3
    flags = (
        "--simulate",
        "--sim-gpu",
        args.sim_gpu,
        "--sim-model",
        args.sim_model,
        "--max-num-seqs",
        str(args.max_num_seqs),
    )

    print(
        f"simulated {args.sim_model} on {args.sim_gpu}, max_num_seqs {args.max_num_seqs}, {args.num_requests} requests per rate"
    )
    print(
        f"input {args.input_len}, output {args.output_len}; SLO: TTFT p99 <= {args.slo_ttft_ms:.0f} ms, TPOT <= {args.slo_tpot_ms:.0f} ms"
    )
    print(
        f"{'rate':>6} {'req/s':>8} {'out tok/s':>9} {'TTFT p50':>9} {'TTFT p99':>9} {'TPOT p50':>9} {'TPOT p99':>9} {'goodput':>8} {'SLO':>6}"
    )
    knee = None
    with engine_process(*flags) as (url, _):
        for rate in rates:
            spec = LoadSpec(
                url=url,
                num_requests=args.num_requests,
                rate=rate,
                input_len=parse_distribution(args.input_len),
                output_len=parse_distribution(args.output_len),
                seed=int(rate * 1000),
            )
            s = asyncio.run(run_load(spec)).summary(slo_ttft, slo_tpot)
            print(_row(rate, s, slo_ttft), flush=True)
            if knee is None and s.ttft is not None and s.ttft.p99 > slo_ttft:
                knee = rate
    if knee is None:
        print(f"knee: p99 TTFT stayed within {args.slo_ttft_ms:.0f} ms up to {rates[-1]} req/s")
    else:
        print(f"knee: p99 TTFT leaves the {args.slo_ttft_ms:.0f} ms SLO at {knee} req/s")


if __name__ == "__main__":
    main()
