"""The engine's step cost, learnt online, and one step's time target spent as the plan grows.

Where it sits: ``Engine.step()`` feeds :class:`StepCostModel` each step's shape (prefill tokens,
decode rows, context tokens read) and the seconds it took (the wall clock, or the simulated
clock of ``engine/sim.py``); the ``time`` step budget (engine/sched/budget.py) opens a
:class:`StepTimeBudget` on it once the step's decodes are planned and asks it how many prefill tokens
fit in what is left of the step's bound (Sarathi-Serve's stall-free batching, with the chunk sized by time
rather than by a fixed token count). Pure Python: no torch, no clock of its own.

The model: ``seconds ≈ fixed + per_prefill_token × p + per_decode_row × r + per_context_token × c``,
fitted by exponentially weighted least squares with regularised forgetting: each step the old
evidence decays by ``decay`` and a small ridge pulls towards the previous fit, so a direction the
recent steps do not excite (no prefill for a while) keeps its last estimate instead of drifting.
Steps far off the fit (a neighbour's CPU burst, a warm-up) get Huber weights, not full ones.
A prefill token's cost for sizing chunks is the fit's; over the first EXCESS_STEPS steps with prefill
it is at least their measured excess over their decodes' predicted time, per prefill token: chunks of
one size (the first steps of a burst) cannot tell the fit a token from the fixed cost, and the excess
can. Only then: the excess charges every slowdown of a mixed step, its decodes' share included, to its
few prefill tokens, so kept for good (as it was) it ran several times the fit's on a 2-core CPU shared
with the API process and the clients, and starved prefill (bench/results/stall_free.txt).
Two more things outlive the fit's forgetting: a decode floor (decode steps timed at start by
``engine/core/step_profile.py``) under the predicted batch, and ``overrun``, the 0.9 quantile of measured
over predicted mixed steps, which the chunks' share of a bound is divided by.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from dataclasses import dataclass

from kvfleet.engine.sched.plan import ScheduledSeq
from kvfleet.engine.sequence import Sequence

_WARMUP_PREFILL_STEPS = 3  # steps seen before the Huber weights have a residual scale
# Features are scaled to about 1 at a typical step, so the 4x4 normal equations stay well conditioned.
_SCALES = (1.0, 256.0, 32.0, 16384.0)  # fixed, prefill tokens, decode rows, context tokens
_HUBER_K = 3.0  # residuals past this many mean absolute residuals are down-weighted
_EXCESS_STEPS = 8  # prefill steps over which a chunk's cost is at least the measured excess
_RIDGE = 1e-2  # pull towards the previous fit, against the decayed evidence (sum of weights ~ 1/(1-decay))
# Steps with prefill overrun their prediction (a neighbour's burst of CPU, the API process on the same
# cores): chunks are sized to bound / the OVERRUN_Q quantile of actual / predicted over such steps, so
# that quantile of them, not half, stays within the bound (the bound is on measured steps: ITL p99).
OVERRUN_Q = 0.9
_OVERRUN_RATE = 0.02  # the quantile's step per observation (stochastic approximation)
_OVERRUN_MAX = 1.5  # never shrink a chunk's share of the bound by more than this
_OVERRUN_SLACK = 1.02  # a step within 2% of bound / overrun counts as within (a fit's rounding is no overrun)


@dataclass(frozen=True)
class StepShape:
    """What one step computed, in the cost model's terms."""

    prefill_tokens: int  # tokens of chunks longer than one token
    decode_rows: int  # one-token chunks
    context_tokens: int  # Σ context length over the step's sequences (the KV it reads)

    @classmethod
    def of(cls, scheduled: Iterable[ScheduledSeq]) -> StepShape:
        prefill = rows = context = 0
        for e in scheduled:
            if e.num_new_tokens == 1:
                rows += 1
            else:
                prefill += e.num_new_tokens
            context += e.num_computed_before + e.num_new_tokens
        return cls(prefill, rows, context)

    def joined_by(self, max_rows: int, *prompts: Iterable[Sequence]) -> StepShape:
        """This decode step once ``prompts`` decode too: a row each, its tokens as context, up to
        ``max_rows`` rows (the batch a stall-free step's bound is scaled by)."""
        rows, context = self.decode_rows, self.context_tokens
        for seq in itertools.islice(itertools.chain(*prompts), max(0, max_rows - rows)):
            rows, context = rows + 1, context + seq.num_tokens
        return StepShape(self.prefill_tokens, rows, context)


class StepCostModel:
    """``prior``: (fixed s, s per prefill token, s per decode row, s per context token) to start from
    (the simulator's timing model; exact plans in tests); None: nothing known, first chunks minimal."""

    def __init__(self, decay: float = 0.98, prior: tuple[float, float, float, float] | None = None) -> None:
        if not 0.0 < decay < 1.0:
            raise ValueError(f"decay must be in (0, 1), got {decay}")
        self.decay = decay
        n = len(_SCALES)
        theta = [0.0] * n if prior is None else [c * s for c, s in zip(prior, _SCALES, strict=True)]
        self._a = [[_RIDGE if i == j else 0.0 for j in range(n)] for i in range(n)]
        self._b = [_RIDGE * t for t in theta]
        self._theta = theta  # seconds per scaled feature
        self._excess = (0.0, 0.0)  # seconds over the decodes' prediction, prefill tokens: first steps only
        self._prior_knows_prefill = prior is not None and prior[1] > 0.0
        self._mean_abs_residual = 0.0  # EW mean of |seconds - prediction|, clipped: the noise's scale
        self.num_observed = 0
        self.num_prefill_observed = 0
        self._floor: tuple[tuple[int, float], ...] = ()  # (decode rows, s): measured at start, kept
        self.overrun = 1.0  # the OVERRUN_Q quantile of seconds / predicted over steps with prefill

    def set_decode_floor(self, points: Iterable[tuple[int, float]]) -> None:
        """Decode steps measured at start (``engine/core/step_profile.py``): (rows, seconds), which
        :meth:`predict_batch` never goes under. The fit forgets; a batch the recent steps did not run
        (a burst reaching more streams) is then predicted from this, not from a per-row cost unlearnt."""
        floor = sorted(dict(points).items())
        if any(rows < 1 or seconds < 0 for rows, seconds in floor):
            raise ValueError(f"a decode floor needs rows >= 1 and seconds >= 0, got {floor}")
        self._floor = tuple(floor)

    def decode_floor(self, rows: float) -> float:
        """The measured decode step of ``rows`` rows, piecewise linear between the points measured and
        extended by the last segment's slope past them, flat below the first (0.0: no floor set)."""
        pts = self._floor
        if not pts:
            return 0.0
        if len(pts) == 1 or rows <= pts[0][0]:
            return pts[0][1]
        for (r0, s0), (r1, s1) in itertools.pairwise(pts):
            if rows <= r1:
                return s0 + (s1 - s0) * (rows - r0) / (r1 - r0)
        (r0, s0), (r1, s1) = pts[-2], pts[-1]
        return s1 + max(0.0, (s1 - s0) / (r1 - r0)) * (rows - r1)

    @property
    def knows_prefill(self) -> bool:
        """Whether a prefill token's cost is known: from the prior or an observed step with prefill
        tokens (before that, chunks are the minimum)."""
        return self._prior_knows_prefill or self.num_prefill_observed > 0

    def coefficients(self) -> tuple[float, float, float, float]:
        """(fixed s, s per prefill token, s per decode row, s per context token) as fitted."""
        f, p, r, c = (t / s for t, s in zip(self._theta, _SCALES, strict=True))
        return f, p, r, c

    def observe(self, shape: StepShape, seconds: float) -> None:
        decodes_s = self.predict(0, shape.decode_rows, shape.context_tokens)
        if shape.prefill_tokens and shape.decode_rows and self.num_prefill_observed >= _EXCESS_STEPS:
            self._track_overrun(
                seconds, self.predict(shape.prefill_tokens, shape.decode_rows, shape.context_tokens)
            )
        x = _features(shape.prefill_tokens, shape.decode_rows, shape.context_tokens)
        w = self._huber_weight(sum(t * xi for t, xi in zip(self._theta, x, strict=True)), seconds)
        lam, ridge = self.decay, (1.0 - self.decay) * _RIDGE
        for i, xi in enumerate(x):
            row = self._a[i]
            for j, xj in enumerate(x):
                row[j] = lam * row[j] + w * xi * xj + (ridge if i == j else 0.0)
            self._b[i] = lam * self._b[i] + w * xi * seconds + ridge * self._theta[i]
        self._theta = _solve(self._a, self._b)
        self.num_observed += 1
        if shape.prefill_tokens:
            self.num_prefill_observed += 1
            old_s, old_tokens = self._excess
            excess = max(0.0, seconds - decodes_s) * w
            self._excess = (old_s + excess, old_tokens + w * shape.prefill_tokens)

    def _track_overrun(self, seconds: float, predicted: float) -> None:
        """One step of the quantile's stochastic approximation: up by RATE x q when the step overran the
        current quantile, down by RATE x (1 - q) when not; it settles where a q share of steps are within
        it. Only steps whose decodes wait on the prefill (mixed steps) count, once the fit knows prefill."""
        if predicted <= 0.0:
            return
        above = seconds > predicted * self.overrun * _OVERRUN_SLACK
        step = _OVERRUN_RATE * (OVERRUN_Q if above else OVERRUN_Q - 1.0)
        self.overrun = min(_OVERRUN_MAX, max(1.0, self.overrun + step))

    def _huber_weight(self, predicted: float, seconds: float) -> float:
        """An observation's weight: 1 within HUBER_K mean absolute residuals (or a quarter of the
        prediction) of the fit, less beyond, so a step slowed by a neighbour's burst of CPU or a
        one-time warm-up bends the fit only as much as an ordinary step."""
        residual = abs(seconds - predicted)
        bound = max(_HUBER_K * self._mean_abs_residual, 0.25 * predicted, 1e-6)
        if self.num_observed < _WARMUP_PREFILL_STEPS:
            bound = max(bound, residual)  # no scale yet: every early step counts fully
        lam = self.decay
        self._mean_abs_residual = lam * self._mean_abs_residual + (1.0 - lam) * min(residual, bound)
        return 1.0 if residual <= bound else bound / residual

    def predict(self, prefill_tokens: int, decode_rows: int, context_tokens: int) -> float:
        x = _features(prefill_tokens, decode_rows, context_tokens)
        return max(0.0, sum(t * xi for t, xi in zip(self._theta, x, strict=True)))

    def predict_batch(self, decode_rows: float, context_tokens: float) -> float:
        """A decode step of ``decode_rows`` rows, at least the fixed cost and a prefill token a row: a row
        runs a token's matmuls, and more rows than the recent steps ran leave the fit's per-row cost
        unlearnt (a burst reaching a few streams would otherwise be bounded by a batch predicted too cheap),
        and at least the decode step of that many rows measured at start (:meth:`decode_floor`)."""
        fixed, _, per_row, per_context = self.coefficients()
        fitted = fixed + per_row * decode_rows + per_context * context_tokens
        per_token = self.marginal_prefill()[0] if self.knows_prefill else 0.0
        return max(0.0, fitted, fixed + per_token * decode_rows, self.decode_floor(decode_rows))

    def marginal_prefill(self) -> tuple[float, float]:
        """(s per prefill token, s per context token) for sizing a chunk, both > 0: the fit's, but over
        the first EXCESS_STEPS prefill steps at least their excess over their decodes, per token."""
        _, per_token, _, per_context = self.coefficients()
        excess_s, tokens = self._excess
        if tokens and self.num_prefill_observed <= _EXCESS_STEPS:
            per_token = max(per_token, excess_s / tokens)
        return max(per_token, 1e-9), max(per_context, 0.0)


class StepTimeBudget:
    """One step's time bound, spent by the plan: decodes first, then prefill chunks.

    The bound is ``max(target_s, factor × the decodes' predicted time, factor × the decode step
    midway)``. A fixed target alone cannot suit 8 streams (45 ms decode steps here) and 32 (90-120 ms);
    scaled by a decode step, a step with prefill is at most ``factor`` times one (the ITL p99/p50 it
    allows) and prefill gets ``factor - 1`` times it (the throughput it keeps). ``batch`` is the decode
    step once the prompts running or waiting have joined (up to max_num_seqs; default: the decodes
    alone); while they are prefilled the batch grows from today's decodes towards it, so the step midway
    (half the joining rows and their context) is the decode step the burst's streams wait on, on
    average. Scaled by today's decodes alone, a burst reaching few streams (32 prompts at once, 1-6
    decoding) got 30-40-token chunks: each step paid a decode step's fixed cost for few tokens, the
    batch stayed small, served output fell to 0.77-0.80x the unbounded scheduler's (and under CPU
    contention to 0.17x in helper branch s33b's run: prefill slowed, fewer streams decoded, the bound
    shrank); scaled by the whole joined batch, steps grew past 3x the median gap
    (bench/results/stall_free.txt).
    The chunks fill ``bound / overrun``: the cost model's OVERRUN_Q quantile of measured over predicted
    mixed steps, so that share of measured steps stays within the bound.
    Invariant: the predicted step time stays within bound / overrun, except for the ``min_chunk`` prefill
    tokens a step always gets, shared by its first prompts (no prefill starves while the cost model
    knows no prefill cost yet, or when the decodes alone fill the bound).
    """

    def __init__(
        self,
        cost: StepCostModel,
        target_s: float,
        min_chunk: int,
        decodes: StepShape,
        factor: float = 0.0,
        batch: StepShape | None = None,
    ) -> None:
        self.cost = cost
        decode_s = cost.predict(0, decodes.decode_rows, decodes.context_tokens)
        full = decodes if batch is None else batch
        midway_s = cost.predict_batch(
            (decodes.decode_rows + full.decode_rows) / 2, (decodes.context_tokens + full.context_tokens) / 2
        )
        self.bound_s = max(target_s, factor * decode_s, factor * midway_s)
        self.left_s = self.bound_s / cost.overrun - decode_s
        self.min_left = min_chunk  # prefill tokens this step gets whatever the prediction

    def chunk(self, computed: int, wanted: int) -> int:
        """Prefill tokens of a sequence at ``computed`` tokens that fit (0: none, the step is full)."""
        fit = 0
        if self.cost.knows_prefill:
            per_token, per_context = self.cost.marginal_prefill()
            fit = max(0, int((self.left_s - per_context * computed) / (per_token + per_context)))
        return min(max(fit, self.min_left), wanted)

    def spend(self, computed: int, num_new: int) -> None:
        per_token, per_context = self.cost.marginal_prefill()
        self.left_s -= per_token * num_new + per_context * (computed + num_new)
        self.min_left = max(0, self.min_left - num_new)


def _features(prefill_tokens: int, decode_rows: int, context_tokens: int) -> tuple[float, ...]:
    return (1.0, prefill_tokens / _SCALES[1], decode_rows / _SCALES[2], context_tokens / _SCALES[3])


def _solve(a: list[list[float]], b: list[float]) -> list[float]:
    """x with a·x = b, by Gaussian elimination with partial pivoting (a is symmetric positive definite)."""
    n = len(b)
    m = [row[:] + [b[i]] for i, row in enumerate(a)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(m[r][col]))
        m[col], m[pivot] = m[pivot], m[col]
        for r in range(col + 1, n):
            f = m[r][col] / m[col][col]
            for k in range(col, n + 1):
                m[r][k] -= f * m[col][k]
    x = [0.0] * n
    for r in range(n - 1, -1, -1):
        x[r] = (m[r][n] - sum(m[r][k] * x[k] for k in range(r + 1, n))) / m[r][r]
    return x
