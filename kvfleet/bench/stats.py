"""The figures of a benchmark run: latency percentiles, throughput and goodput.

Where it sits: ``run_load`` produces one :class:`RequestRecord` per request (times in
seconds on the run's clock); :func:`summarize` reduces them. TTFT is send → first content
chunk; ITL the gaps between content chunks; TPOT per request (e2e − TTFT) / (output
tokens − 1); goodput counts the successful requests meeting both SLOs (a request with a
single token has no TPOT and meets that SLO).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class RequestRecord:
    ok: bool
    start: float = 0.0
    ttft: float | None = None
    e2e: float | None = None
    itls: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    output_tokens: int = 0
    error: str | None = None

    @property
    def tpot(self) -> float | None:
        if self.ttft is None or self.e2e is None or self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)


@dataclass(frozen=True)
class Percentiles:
    mean: float
    p50: float
    p90: float
    p99: float

    @classmethod
    def of(cls, values: Sequence[float]) -> Percentiles | None:
        if not values:
            return None
        ordered = sorted(values)
        return cls(
            sum(ordered) / len(ordered),
            percentile(ordered, 50),
            percentile(ordered, 90),
            percentile(ordered, 99),
        )


def percentile(ordered: Sequence[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default), on sorted values."""
    pos = (len(ordered) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


@dataclass(frozen=True)
class BenchSummary:
    num_requests: int
    num_ok: int
    num_failed: int
    duration_s: float
    request_throughput: float  # successful requests / s
    output_token_throughput: float
    total_token_throughput: float  # prompt + output tokens / s
    ttft: Percentiles | None
    tpot: Percentiles | None
    itl: Percentiles | None
    e2e: Percentiles | None
    goodput: float | None  # requests / s meeting the SLOs (None without SLOs)
    slo_attainment: float | None  # share of all requests meeting the SLOs
    total_prompt_tokens: int
    total_output_tokens: int
    errors: dict[str, int]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def meets_slo(r: RequestRecord, slo_ttft_s: float | None, slo_tpot_s: float | None) -> bool:
    if not r.ok or r.ttft is None:
        return False
    if slo_ttft_s is not None and r.ttft > slo_ttft_s:
        return False
    tpot = r.tpot
    return not (slo_tpot_s is not None and tpot is not None and tpot > slo_tpot_s)


def summarize(
    records: Sequence[RequestRecord],
    duration_s: float,
    *,
    slo_ttft_s: float | None = None,
    slo_tpot_s: float | None = None,
) -> BenchSummary:
    ok = [r for r in records if r.ok]
    errors: dict[str, int] = {}
    for r in records:
        if not r.ok:
            errors[r.error or "unknown"] = errors.get(r.error or "unknown", 0) + 1
    prompt = sum(r.prompt_tokens for r in ok)
    output = sum(r.output_tokens for r in ok)
    per_s = 1.0 / duration_s if duration_s > 0 else 0.0
    goodput = attainment = None
    if slo_ttft_s is not None or slo_tpot_s is not None:
        good = sum(meets_slo(r, slo_ttft_s, slo_tpot_s) for r in records)
        goodput, attainment = good * per_s, good / len(records) if records else 0.0
    return BenchSummary(
        num_requests=len(records),
        num_ok=len(ok),
        num_failed=len(records) - len(ok),
        duration_s=duration_s,
        request_throughput=len(ok) * per_s,
        output_token_throughput=output * per_s,
        total_token_throughput=(prompt + output) * per_s,
        ttft=Percentiles.of([r.ttft for r in ok if r.ttft is not None]),
        tpot=Percentiles.of([t for r in ok if (t := r.tpot) is not None]),
        itl=Percentiles.of([gap for r in ok for gap in r.itls]),
        e2e=Percentiles.of([r.e2e for r in ok if r.e2e is not None]),
        goodput=goodput,
        slo_attainment=attainment,
        total_prompt_tokens=prompt,
        total_output_tokens=output,
        errors=errors,
    )


def format_summary(s: BenchSummary) -> str:
    lines = [
        f"requests: {s.num_ok} ok, {s.num_failed} failed in {s.duration_s:.2f} s",
        f"request throughput: {s.request_throughput:.2f} req/s",
        f"output token throughput: {s.output_token_throughput:.1f} tok/s",
        f"total token throughput: {s.total_token_throughput:.1f} tok/s",
    ]
    if s.goodput is not None:
        lines.append(
            f"goodput: {s.goodput:.2f} req/s ({100 * (s.slo_attainment or 0):.1f} % of requests met the SLOs)"
        )
    lines.append(f"{'ms':<6}{'mean':>10}{'p50':>10}{'p90':>10}{'p99':>10}")
    for name, p in (("TTFT", s.ttft), ("TPOT", s.tpot), ("ITL", s.itl), ("E2E", s.e2e)):
        if p is not None:
            lines.append(
                f"{name:<6}{p.mean * 1e3:>10.2f}{p.p50 * 1e3:>10.2f}{p.p90 * 1e3:>10.2f}{p.p99 * 1e3:>10.2f}"
            )
    for err, count in sorted(s.errors.items()):
        lines.append(f"error ×{count}: {err}")
    return "\n".join(lines)
