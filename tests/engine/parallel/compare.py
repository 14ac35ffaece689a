"""Greedy tokens of two engines compared step by step: a divergence is a failure unless it is a near-tie."""

from __future__ import annotations

import warnings

from kvfleet.engine.outputs import RequestOutput

NEAR_TIE = 1e-4  # top-2 logprobs closer than this: float32 summation order may pick either


def assert_same_greedy(reference: list[RequestOutput], tp: list[RequestOutput], label: str) -> None:
    """Every request's tokens equal; where they first differ, the reference's top-2 must be a near-tie
    (then reported as a warning naming the request and the step, and the rest of that request skipped)."""
    for i, (ref, got) in enumerate(zip(reference, tp, strict=True)):
        want, have = ref.outputs[0].token_ids, got.outputs[0].token_ids
        if want == have:
            continue
        step = next(s for s, (a, b) in enumerate(zip(want, have, strict=False)) if a != b)
        logprobs = ref.outputs[0].logprobs
        assert logprobs is not None, f"{label}: request {i} diverges at step {step}; ask for logprobs=2"
        top = logprobs[step].top
        gap = top[0][1] - top[1][1]
        assert gap < NEAR_TIE, (
            f"{label}: request {i} diverges at step {step} ({want[step]} vs {have[step]}), "
            f"not a near-tie: top-2 logprobs {gap:.2e} apart"
        )
        warnings.warn(
            f"{label}: request {i} diverges at step {step} on a near-tie "
            f"(top-2 logprobs {gap:.2e} apart): {want[step]} vs {have[step]}",
            stacklevel=2,
        )
