"""What issue #11's targets ask of this machine: for every cell of ``bench/peers/peers.py``, the least
FLOPs its work needs, against the time the target allows, as a fraction of the FMA peak.

    .venv/bin/python -m bench.peers.peers_bounds --results bench/results/peers_bound2_full.txt [--peak-gflops 214.7]

Where it sits: beside ``bench/peers/peers.py``, reading one of its results files for vLLM's figures
(its best row per cell) and rebuilding the same prompts from the same seeds and defaults.
Nothing is served: the bounds are arithmetic.

The bounds hold for any engine on this machine, kvfleet included:
- FLOPs: 2 x the layers' matmul weights per prompt token, counted once per distinct prefix
  (a perfect prefix cache: a trie over the token ids), and per output token the layers plus
  the LM head; causal attention, 2 x layers x heads x head_dim x (n^2 - s^2) for positions
  s..n-1 computed. Norms, RoPE and sampling are left out, so the true work is larger.
- Time: FLOPs / the float32 FMA peak (``bench/peers/fma_peak.c``: every FMA pipe of every core busy).
- TTFT: requests that arrive together (the first ``concurrency``) give their first tokens one
  by one; the k-th first token needs k prompts computed: their private tokens, and the shared
  tokens of one of them; the last needs every distinct position of the wave. With one request at a time, each request needs its own tokens that no
  earlier request computed. Order statistics keep the bound: p99 of the TTFTs >= p99 of the bounds.
- Throughput: 1.5x vLLM's tokens/s means the cell's FLOPs in vLLM's time / 1.5.
A ratio above 100% of the peak is a target no engine can reach here in float32.
"""

from __future__ import annotations

import argparse
import random
import re
import subprocess
import tempfile
from pathlib import Path
from typing import Any

from bench.peers import peers  # the same workloads, seeds and FLOP model
from kvfleet.bench.load import plan_requests  # noqa: E402
from kvfleet.bench.stats import percentile  # noqa: E402

SERVED = re.compile(r"^(vLLM server, threads=\S+)\s+(\w+)\s+(\d+)\s+[\d.]+\s+([\d.]+)\s+\d+/(\d+)\s")
OFFLINE = re.compile(r"^vLLM LLM\.generate, threads=\S+ \(.*?\)\s+([\d.]+)\s+[\d.]+\s+([\d.]+)\s")


def fma_peak() -> float:
    """GFLOP/s of ``bench/peers/fma_peak.c`` on 2 threads (x86 with AVX2 and FMA, and a C compiler)."""
    source = Path(__file__).with_name("fma_peak.c")
    with tempfile.TemporaryDirectory() as tmp:
        exe = Path(tmp) / "fma_peak"
        subprocess.run(["cc", "-O2", "-mavx2", "-mfma", "-fopenmp", str(source), "-o", str(exe)], check=True)
        out = subprocess.run(
            [str(exe)], check=True, capture_output=True, text=True, env={"OMP_NUM_THREADS": "2"}
        )
    return float(out.stdout.strip().splitlines()[-1].split()[-1])


def vllm_best(path: Path) -> tuple[float | None, dict[tuple[str, int], tuple[float, float]]]:
    """vLLM's offline seconds, and per (workload, concurrency) its best total tok/s and TTFT p99 (s)."""
    offline: float | None = None
    cells: dict[tuple[str, int], tuple[float, float]] = {}
    for line in path.read_text().splitlines():
        if m := OFFLINE.match(line):
            offline = min(offline or float("inf"), float(m.group(1)))
        elif m := SERVED.match(line):
            key, tps, p99 = (m.group(2), int(m.group(3))), float(m.group(4)), float(m.group(5)) / 1e3
            best = cells.get(key, (0.0, float("inf")))
            cells[key] = (max(best[0], tps), min(best[1], p99))
    return offline, cells


class Trie:
    """Distinct prefixes of token sequences: the positions a perfect prefix cache computes."""

    def __init__(self) -> None:
        self.root: dict[int, Any] = {}
        self.visits: dict[int, int] = {}  # id(node) -> sequences through it

    def add(self, ids: list[int]) -> int:
        """Insert ``ids``; the number of positions no earlier sequence had."""
        node, new = self.root, 0
        for t in ids:
            if t not in node:
                node[t] = {}
                new += 1
            node = node[t]
            self.visits[id(node)] = self.visits.get(id(node), 0) + 1
        return new

    def private(self, ids: list[int]) -> int:
        """Positions of ``ids`` that no other added sequence shares."""
        node, alone = self.root, 0
        for t in ids:
            node = node[t]
            alone += self.visits[id(node)] == 1
        return alone


class Cost:
    """FLOPs of computing positions s..n-1 of one sequence: the layers' matmuls and causal attention."""

    def __init__(self, shape: peers.Shape) -> None:
        self.per_token = 2.0 * shape.params
        self.attention = 2.0 * shape.layers * shape.q_width

    def __call__(self, n: int, s: int = 0) -> float:
        return self.per_token * (n - s) + self.attention * (n * n - s * s)


def ttft_bounds(prompts: list[list[int]], concurrency: int, cost: Cost) -> list[float]:
    """A lower bound (FLOPs) on each order statistic of the cell's TTFTs (see the module doc)."""
    if concurrency == 1:
        trie = Trie()
        return [cost(len(p), len(p) - trie.add(p)) for p in prompts]
    wave = prompts[:concurrency]
    trie = Trie()
    for p in wave:
        trie.add(p)
    private = sorted(cost(len(p), len(p) - trie.private(p)) for p in wave)
    shared = min(cost(len(p) - trie.private(p)) for p in wave)
    bounds = [sum(private[: k + 1]) + shared for k in range(len(wave))]
    whole, seen = 0.0, Trie()  # the last first token needs every distinct position of the wave
    for p in wave:
        whole += cost(len(p), len(p) - seen.add(p))  # a position's cost does not depend on who computes it
    bounds[-1] = max(bounds[-1], whole)
    return bounds + [bounds[-1]] * (len(prompts) - len(wave))  # later requests: no tighter bound here


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--results", type=Path, required=True, help="a bench/peers/peers.py results file (vLLM's figures)"
    )
    p.add_argument(
        "--peak-gflops", type=float, default=None, help="default: measured by bench/peers/fma_peak.c"
    )
    own, rest = p.parse_known_args(argv)
    args = peers.parse(rest)  # peers.py's workload defaults and seeds
    peak = (own.peak_gflops or fma_peak()) * 1e9
    folder = peers.resolve_model(args.model)
    shape = peers.Shape.of(folder)
    from kvfleet.engine.tokenizer.hf import HFTokenizer

    tok = HFTokenizer(folder)
    offline_s, cells = vllm_best(own.results)
    cost, head_flop = Cost(shape), 2.0 * shape.lm_head
    print(f"# {args.model}: float32 FMA peak {peak / 1e9:.1f} GFLOP/s; vLLM's figures from {own.results}")
    print(
        "# % of peak: the least FLOPs of the cell / the time the target allows / the peak (> 100%: unreachable)"
    )
    if offline_s is not None:
        reqs = peers.offline_requests(args)
        flop = sum(shape.flops(len(r["prompt"]), r["max_tokens"]) for r in reqs)
        print(
            f"offline: vLLM {offline_s:.2f} s; 1.5x its throughput needs {100 * flop / (offline_s / 1.5) / peak:.0f}% of peak"
        )
    print(
        f"{'cell':<12}{'1.5x vLLM tok/s':>18}{'vLLM TTFT p99':>15}{'target':>9}{'bound':>9}{'bound/target':>14}"
    )
    for workload in args.workloads:
        for c in args.concurrency:
            if (workload, c) not in cells:
                continue
            tps, p99 = cells[(workload, c)]
            spec = peers.load_spec(args, workload, c)
            planned = plan_requests(spec, random.Random(spec.seed))
            prompts = [
                tok.encode(
                    tok.apply_chat_template([{"role": "user", "content": r.prompt}]), add_special_tokens=False
                )
                for r in planned
            ]
            trie, flop = Trie(), 0.0
            for ids, r in zip(prompts, planned, strict=True):
                n, computed = len(ids) + r.max_tokens, len(ids) - trie.add(ids)
                flop += cost(n, computed) + head_flop * r.max_tokens
            outputs = sum(r.max_tokens for r in planned)
            seconds = (sum(map(len, prompts)) + outputs) / tps  # vLLM's duration of the cell
            need = flop / (seconds / 1.5) / peak
            bound = percentile(sorted(ttft_bounds(prompts, c, cost)), 99) / peak
            print(
                f"{workload + ' c=' + str(c):<12}{100 * need:>17.0f}%{1e3 * p99:>13.0f}ms{500 * p99:>7.0f}ms"
                f"{1e3 * bound:>7.0f}ms{bound / (0.5 * p99):>13.2f}x"
            )


if __name__ == "__main__":
    main()
