"""``kvfleet bench``: load-test any OpenAI-compatible endpoint and print TTFT/TPOT/ITL/e2e, throughput, goodput.

Where it sits: flags → :class:`kvfleet.bench.load.LoadSpec` → :func:`run_load` →
:func:`summarize` → a table (or ``--json``). Torch-free: it runs on any laptop.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys

from kvfleet.bench.dists import DistributionError, parse_distribution
from kvfleet.bench.load import LoadSpec, run_load
from kvfleet.bench.stats import format_summary


def _dist(text: str) -> object:
    try:
        return parse_distribution(text)
    except DistributionError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", required=True, help="the server's base URL, e.g. http://127.0.0.1:8000")
    parser.add_argument("--api-key", default=None, help="sent as Authorization: Bearer KEY")
    parser.add_argument("--model", default=None, help="model name (default: the first of /v1/models)")
    parser.add_argument("--endpoint", choices=["completions", "chat"], default="completions")
    loop = parser.add_mutually_exclusive_group()
    loop.add_argument("--rate", type=float, default=None, help="open loop: Poisson arrivals per second")
    loop.add_argument("--concurrency", type=int, default=None, help="closed loop: clients in flight")
    parser.add_argument("--num-requests", type=int, default=100)
    parser.add_argument(
        "--input-len",
        type=_dist,
        default=parse_distribution("fixed:128"),
        help="fixed:N | uniform:A:B | lognormal:MEAN:SIGMA",
    )
    parser.add_argument(
        "--output-len", type=_dist, default=parse_distribution("fixed:128"), help="as --input-len"
    )
    parser.add_argument(
        "--shared-prefix", type=float, default=0.0, metavar="F", help="fraction of each prompt shared by all"
    )
    parser.add_argument("--slo-ttft-ms", type=float, default=None)
    parser.add_argument("--slo-tpot-ms", type=float, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    parser.add_argument(
        "--ignore-eos", action="store_true", help="send vLLM's ignore_eos extension (exact output lengths)"
    )
    parser.add_argument("--json", action="store_true", help="print the summary as JSON")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def run(args: argparse.Namespace) -> int:
    try:
        spec = LoadSpec(
            url=args.url,
            model=args.model,
            endpoint=args.endpoint,
            num_requests=args.num_requests,
            rate=args.rate,
            concurrency=args.concurrency,
            input_len=args.input_len,
            output_len=args.output_len,
            shared_prefix=args.shared_prefix,
            api_key=args.api_key,
            seed=args.seed,
            timeout_s=args.timeout,
            extra_body={"ignore_eos": True} if args.ignore_eos else {},
        )
    except ValueError as exc:
        print(f"kvfleet bench: {exc}", file=sys.stderr)
        return 2
    try:
        result = asyncio.run(run_load(spec, progress=not args.no_progress and not args.json))
    except Exception as exc:  # the server is unreachable or /v1/models failed: say so, no traceback
        print(f"kvfleet bench: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    slo_ttft = None if args.slo_ttft_ms is None else args.slo_ttft_ms / 1e3
    slo_tpot = None if args.slo_tpot_ms is None else args.slo_tpot_ms / 1e3
    summary = result.summary(slo_ttft, slo_tpot)
    if args.json:
        print(json.dumps({"model": result.model, "endpoint": spec.endpoint, **summary.to_dict()}, indent=2))
    else:
        print(
            f"model: {result.model}  endpoint: {spec.endpoint}  input: {spec.input_len}  output: {spec.output_len}"
        )
        print(format_summary(summary))
    return 0 if summary.num_ok else 1
