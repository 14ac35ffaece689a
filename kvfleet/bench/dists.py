"""Length distributions for ``--input-len`` / ``--output-len``: ``fixed:N``, ``uniform:A:B``, ``lognormal:MEAN:SIGMA``.

Where it sits: ``kvfleet bench`` parses the flags here; ``run_load`` draws one input and one
output length per request from a seeded ``random.Random``, so a run is reproducible.
Every draw is at least 1 token.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass


class DistributionError(ValueError):
    pass


@dataclass(frozen=True)
class Distribution:
    kind: str  # "fixed" | "uniform" | "lognormal"
    a: float
    b: float = 0.0

    def sample(self, rng: random.Random) -> int:
        if self.kind == "fixed":
            value = self.a
        elif self.kind == "uniform":
            value = rng.randint(int(self.a), int(self.b))
        else:
            # MEAN is the distribution's mean: mu chosen so that exp(mu + sigma^2 / 2) == MEAN.
            mu = math.log(self.a) - self.b**2 / 2
            value = round(rng.lognormvariate(mu, self.b))
        return max(1, int(value))

    @property
    def mean(self) -> float:
        return self.a if self.kind != "uniform" else (self.a + self.b) / 2

    def __str__(self) -> str:
        if self.kind == "fixed":
            return f"fixed:{int(self.a)}"
        return f"{self.kind}:{_num(self.a)}:{_num(self.b)}"


def _num(x: float) -> str:
    return str(int(x)) if x == int(x) else str(x)


def parse_distribution(text: str) -> Distribution:
    parts = text.strip().split(":")
    kind, args = parts[0].lower(), parts[1:]
    try:
        values = [float(x) for x in args]
    except ValueError:
        raise DistributionError(f"{text!r}: the parameters must be numbers") from None
    if kind == "fixed" and len(values) == 1 and values[0] >= 1:
        return Distribution("fixed", values[0])
    if kind == "uniform" and len(values) == 2 and 1 <= values[0] <= values[1]:
        return Distribution("uniform", values[0], values[1])
    if kind == "lognormal" and len(values) == 2 and values[0] >= 1 and values[1] >= 0:
        return Distribution("lognormal", values[0], values[1])
    raise DistributionError(
        f"{text!r}: expected fixed:N (N >= 1), uniform:A:B (1 <= A <= B) or lognormal:MEAN:SIGMA (MEAN >= 1, SIGMA >= 0)"
    )
