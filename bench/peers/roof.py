"""bench/peers/peers.py's model of the work and its table: a model's matmul shape from its config, the
machine's fp32 matmul roof measured in the same run, one result row per contender and cell, and the
printed table of ratios (kvfleet over the best vLLM setting, over transformers)."""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.common import TokenRates

# ---------------------------------------------------------------- FLOPs and the roof


@dataclass(frozen=True)
class Shape:
    params: int  # matmul weights of the layers, one multiply-add each per token
    lm_head: int  # vocab x hidden: computed for output tokens (one logit row per sampled token)
    layers: int
    q_width: int  # heads x head_dim

    @classmethod
    def of(cls, folder: Path) -> Shape:
        c = json.loads((folder / "config.json").read_text())
        h, inter, layers = c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"]
        heads = c["num_attention_heads"]
        head_dim = c.get("head_dim") or h // heads
        kv = c.get("num_key_value_heads", heads) * head_dim
        q = heads * head_dim
        per_layer = h * q + 2 * h * kv + q * h + 3 * h * inter
        return cls(layers * per_layer, c["vocab_size"] * h, layers, q)

    def flops(self, prompt: int, output: int) -> float:
        """One request: 2 x weights per token, the LM head per output token, causal attention (QK and AV)."""
        n = prompt + output
        return 2.0 * self.params * n + 2.0 * self.lm_head * output + 2.0 * self.layers * self.q_width * n * n


def matmul_roof(
    threads: int, sizes: tuple[int, ...] = (256, 512, 1024, 2048)
) -> tuple[float, dict[int, float]]:
    """Best fp32 ``torch.mm`` GFLOP/s on ``threads`` threads over square ``sizes`` (each timed >= 0.3 s)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    per_size = {}
    try:
        for n in sizes:
            a, b = torch.randn(n, n), torch.randn(n, n)
            torch.mm(a, b)
            reps, start = 0, time.perf_counter()
            while (elapsed := time.perf_counter() - start) < 0.3:
                torch.mm(a, b)
                reps += 1
            per_size[n] = 2.0 * n**3 * reps / elapsed / 1e9
    finally:
        torch.set_num_threads(before)
    return max(per_size.values()), per_size


# ---------------------------------------------------------------- rows


@dataclass
class Row(TokenRates):
    part: str  # offline | serving
    name: str
    seconds: float
    prompt_tokens: int
    output_tokens: int
    flops: float
    workload: str = ""
    concurrency: int = 0
    ttft: tuple[float, float] | None = None  # p50, p99 seconds
    itl: tuple[float, float] | None = None
    failed: int = 0
    extra: dict[str, Any] = field(default_factory=dict)

    def roof(self, gflops: float) -> float:
        return self.flops / self.seconds / (gflops * 1e9)


def pct(p: Any) -> tuple[float, float] | None:
    return None if p is None else (p.p50, p.p99)


def ms(pair: tuple[float, float] | None) -> str:
    return "-/-" if pair is None else f"{pair[0] * 1e3:.0f}/{pair[1] * 1e3:.0f}"


# ---------------------------------------------------------------- the table


def table(
    args: argparse.Namespace, offline_rows: list[Row], serving_rows: list[Row], gflops: float
) -> list[str]:
    lines: list[str] = []
    if offline_rows:
        lines.append(
            f"OFFLINE: {args.num_prompts} prompts, input {args.input_len}, output {args.output_len} tokens"
        )
        lines.append(f"{'contender':<58}{'s':>8}{'out tok/s':>11}{'total tok/s':>12}{'roof %':>8}")
        for r in offline_rows:
            lines.append(f"{r.name:<58}{r.seconds:>8.2f}{r.out_tps:>11.1f}{r.total_tps:>12.1f}"
                         f"{100 * r.roof(gflops):>8.1f}")  # fmt: skip
        best = {e: max((r for r in offline_rows if r.extra["engine"] == e), key=lambda r: r.out_tps, default=None)
                for e in ("kvfleet", "vllm", "hf")}  # fmt: skip
        k = best["kvfleet"]
        for peer, label in (("vllm", "vLLM"), ("hf", "transformers")):
            p = best[peer]
            if k and p:
                lines.append(f"kvfleet / {label} (best of each): output {k.out_tps / p.out_tps:.2f}x, "
                             f"total {k.total_tps / p.total_tps:.2f}x  [{p.name}]")  # fmt: skip
        lines.append("")
    if serving_rows:
        lines.append(
            f"SERVING: chat, input {args.input_len} words, output {args.output_len} tokens, closed loop; "
            f"requests per cell max({args.min_requests}, {args.rounds} x concurrency); "
            f"shared = first {args.shared_fraction:.0%} of each prompt from one prefix"
        )
        lines.append(f"{'server':<28}{'workload':<9}{'conc':>5}{'out tok/s':>10}{'total tok/s':>12}"
                     f"{'TTFT p50/p99 ms':>17}{'ITL p50/p99 ms':>16}{'roof %':>8}{'failed':>7}")  # fmt: skip
        for r in serving_rows:
            lines.append(f"{r.name:<28}{r.workload:<9}{r.concurrency:>5}{r.out_tps:>10.1f}{r.total_tps:>12.1f}"
                         f"{ms(r.ttft):>17}{ms(r.itl):>16}{100 * r.roof(gflops):>8.1f}{r.failed:>7}")  # fmt: skip
        lines.append("kvfleet (best threads) / vLLM (best threads) per cell: tokens/s (target >= 1.5x), "
                     "TTFT p99 and ITL p99 (target TTFT p99 <= 0.5x)")  # fmt: skip
        for w in args.workloads:
            for c in args.concurrency:
                cell = [r for r in serving_rows if r.workload == w and r.concurrency == c]
                ks = [r for r in cell if r.name.startswith("kvfleet")]
                vs = [r for r in cell if r.name.startswith("vLLM")]
                if not ks or not vs:
                    continue
                k, v = max(ks, key=lambda r: r.out_tps), max(vs, key=lambda r: r.out_tps)
                kt, vt = min(ks, key=p99_ttft), min(vs, key=p99_ttft)
                ki, vi = min(ks, key=p99_itl), min(vs, key=p99_itl)
                lines.append(f"  {w:<7} c={c:<3} output {k.out_tps / v.out_tps:.2f}x, total "
                             f"{k.total_tps / v.total_tps:.2f}x, TTFT p99 {ratio(p99_ttft(kt), p99_ttft(vt))}, "
                             f"ITL p99 {ratio(p99_itl(ki), p99_itl(vi))}")  # fmt: skip
        lines.append("")
    return lines


def p99_ttft(r: Row) -> float:
    return r.ttft[1] if r.ttft else float("inf")


def p99_itl(r: Row) -> float:
    return r.itl[1] if r.itl else float("inf")


def ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}x" if b and b != float("inf") and a != float("inf") else "-"
