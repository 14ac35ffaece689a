"""The table and the ratios bench/peers/llamacpp_vs_kvfleet.py prints: pure arithmetic on measured cells.

Where it sits: the bench measures one :class:`Cell` per (server, concurrency) with ``kvfleet bench``'s
load core; this module turns them into lines, and judges issue #34's targets for each kvfleet server
against llama.cpp's cell of the same concurrency: output tokens/s >= 1.5x llama.cpp's, and TTFT p99
<= llama.cpp's. Tested in tests/kvfleet/test_llamacpp_peer.py.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

BASELINE = "llama.cpp"
VLLM = "vLLM bf16"  # vLLM-CPU's server in bfloat16 (its recommendation on AMX / AVX512-BF16 CPUs)
TARGET_OUTPUT_RATIO = 1.5  # kvfleet output tokens/s over llama.cpp's, at least
TARGET_TTFT_P99_RATIO = 1.0  # kvfleet TTFT p99 over llama.cpp's, at most


@dataclass(frozen=True)
class Cell:
    """One server at one concurrency: what the load core measured, and the load average after it."""

    server: str
    concurrency: int
    seconds: float
    output_tokens: int
    ttft: tuple[float, float]  # p50, p99 seconds
    itl: tuple[float, float]
    failed: int = 0
    load: tuple[float, float, float] = (0.0, 0.0, 0.0)
    busy_before: float = 0.0  # the CPUs' busy fraction over 3 s just before the cell, our server idle

    @property
    def out_tps(self) -> float:
        return self.output_tokens / self.seconds if self.seconds > 0 else 0.0


def ms(pair: tuple[float, float]) -> str:
    return f"{pair[0] * 1e3:.0f}/{pair[1] * 1e3:.0f}"


def loadavg(load: Sequence[float]) -> str:
    return " ".join(f"{x:.2f}" for x in load)


def row_line(c: Cell) -> str:
    """One table row, with the load average measured right after the cell."""
    return (
        f"{c.server:<18}{c.concurrency:>5}{c.out_tps:>10.1f}{ms(c.ttft):>16}{ms(c.itl):>15}"
        f"{c.failed:>7}{c.busy_before:>6.0%}   {loadavg(c.load)}"
    )


def table(cells: Sequence[Cell]) -> list[str]:
    head = f"{'server':<18}{'conc':>5}{'out tok/s':>10}{'TTFT p50/p99 ms':>16}{'ITL p50/p99 ms':>15}{'failed':>7}{'busy':>6}"
    return [
        head + "   load average after the cell (busy: CPUs' use by others just before it)",
        *(row_line(c) for c in cells),
    ]


def ratio(a: float, b: float) -> float:
    return a / b if b > 0 else float("inf")


def verdict(cell: Cell, base: Cell) -> tuple[float, float, float, bool, bool]:
    """Output tokens/s, TTFT p99 and ITL p99 ratios of ``cell`` over ``base``, and whether each target is met."""
    out = ratio(cell.out_tps, base.out_tps)
    ttft = ratio(cell.ttft[1], base.ttft[1])
    itl = ratio(cell.itl[1], base.itl[1])
    return out, ttft, itl, out >= TARGET_OUTPUT_RATIO, ttft <= TARGET_TTFT_P99_RATIO


def ratio_lines(cells: Sequence[Cell]) -> list[str]:
    """Each non-baseline server over llama.cpp at the same concurrency, with the targets met or not."""
    base = {c.concurrency: c for c in cells if c.server == BASELINE}
    lines = [
        f"ratios over {BASELINE} at the same concurrency (targets: output tok/s >= {TARGET_OUTPUT_RATIO}x, "
        f"TTFT p99 <= {TARGET_TTFT_P99_RATIO}x)"
    ]
    for c in cells:
        b = base.get(c.concurrency)
        if not c.server.startswith("kvfleet") or b is None:
            continue
        out, ttft, itl, out_ok, ttft_ok = verdict(c, b)
        lines.append(
            f"  {c.server:<16} c={c.concurrency:<3} output {out:.2f}x ({'met' if out_ok else 'NOT met'}), "
            f"TTFT p99 {ttft:.2f}x ({'met' if ttft_ok else 'NOT met'}), ITL p99 {itl:.2f}x"
        )
    return lines


def targets_summary(cells: Sequence[Cell], server: str) -> str:
    """One line: how many of ``server``'s cells meet each target."""
    base = {c.concurrency: c for c in cells if c.server == BASELINE}
    mine = [c for c in cells if c.server == server and c.concurrency in base]
    results = [verdict(c, base[c.concurrency]) for c in mine]
    out_met = sum(r[3] for r in results)
    ttft_met = sum(r[4] for r in results)
    return (
        f"{server}: output >= {TARGET_OUTPUT_RATIO}x met in {out_met} of {len(results)} cells, "
        f"TTFT p99 <= {BASELINE}'s in {ttft_met} of {len(results)}"
    )


def vllm_lines(cells: Sequence[Cell]) -> list[str]:
    """Each kvfleet server over vLLM bf16 at the same concurrency (output tokens/s >= 1.5x); nothing
    where vLLM bf16 did not run."""
    base = {c.concurrency: c for c in cells if c.server == VLLM}
    mine = [c for c in cells if c.server.startswith("kvfleet") and c.concurrency in base]
    if not mine:
        return []
    lines = [f"ratios over {VLLM} at the same concurrency (target: output tok/s >= {TARGET_OUTPUT_RATIO}x)"]
    for c in mine:
        b = base[c.concurrency]
        out = ratio(c.out_tps, b.out_tps)
        lines.append(
            f"  {c.server:<16} c={c.concurrency:<3} output {out:.2f}x "
            f"({'met' if out >= TARGET_OUTPUT_RATIO else 'NOT met'}), TTFT p99 {ratio(c.ttft[1], b.ttft[1]):.2f}x, "
            f"ITL p99 {ratio(c.itl[1], b.itl[1]):.2f}x"
        )
    return lines
