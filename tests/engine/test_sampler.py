"""The sampler on crafted logits: exact masks, argmax for greedy, reproducible seeded draws."""

from __future__ import annotations

import math

import torch

from kvfleet.engine.sampler import Sampler, SampleRequest, apply_top_k, apply_top_p, request_seed
from kvfleet.engine.sampling_params import SamplingParams

NEG_INF = float("-inf")


def logits_of(probs: list[float]) -> torch.Tensor:
    return torch.tensor([math.log(p) for p in probs])


def test_greedy_picks_the_argmax_of_every_row_and_the_first_of_a_tie() -> None:
    logits = torch.tensor([[0.1, 3.0, -1.0, 2.9], [5.0, 5.0, 1.0, 0.0]])
    req = SampleRequest(SamplingParams(temperature=0.0), 0, 0)
    out = Sampler(0, torch.device("cpu")).sample(logits, [req, req])
    assert [r.token_id for r in out] == [1, 0]


def test_top_k_keeps_exactly_the_k_largest_logits() -> None:
    logits = torch.tensor([1.0, 4.0, 2.0, 3.0, 0.5])
    assert apply_top_k(logits, 2).tolist() == [NEG_INF, 4.0, NEG_INF, 3.0, NEG_INF]
    assert apply_top_k(logits, 5).tolist() == logits.tolist()


def test_top_p_keeps_the_smallest_prefix_whose_mass_reaches_p() -> None:
    # sorted: token 1 (0.5), 3 (0.25), 2 (0.15), 0 (0.1); mass ranked above each: 0, 0.5, 0.75, 0.9
    logits = logits_of([0.1, 0.5, 0.15, 0.25])

    def kept(top_p: float) -> list[int]:
        return [i for i, v in enumerate(apply_top_p(logits, top_p).tolist()) if v != NEG_INF]

    assert kept(0.45) == [1]
    assert kept(0.7) == [1, 3]
    assert kept(0.8) == [1, 2, 3]
    assert kept(1.0) == [0, 1, 2, 3]


def test_draws_never_leave_the_top_k_and_top_p_set() -> None:
    logits = logits_of([0.4, 0.3, 0.2, 0.1]).repeat(200, 1)
    params = SamplingParams(temperature=1.0, top_k=3, top_p=0.6)
    requests = [SampleRequest(params, 0, i) for i in range(200)]
    tokens = {r.token_id for r in Sampler(0, torch.device("cpu")).sample(logits, requests)}
    assert tokens == {0, 1}


def test_a_seeded_request_draws_the_same_tokens_whatever_shares_its_batch() -> None:
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(1))
    seeded = SamplingParams(temperature=1.0, seed=1234)
    alone = Sampler(0, torch.device("cpu")).sample(logits[:1], [SampleRequest(seeded, 0, 5)])
    others = [SampleRequest(SamplingParams(temperature=0.8), 0, i) for i in range(5)]
    mixed = Sampler(99, torch.device("cpu")).sample(logits, [SampleRequest(seeded, 0, 5), *others])
    assert mixed[0].token_id == alone[0].token_id


def test_seeded_draws_change_with_the_output_position_and_the_sample_index() -> None:
    assert request_seed(7, 0, 0) == request_seed(7, 0, 0)
    assert (
        len({request_seed(7, 0, 0), request_seed(7, 0, 1), request_seed(7, 1, 0), request_seed(8, 0, 0)}) == 4
    )
    logits = torch.zeros(64, 1000)
    params = SamplingParams(temperature=1.0, seed=3)
    sampler = Sampler(0, torch.device("cpu"))
    run1 = [r.token_id for r in sampler.sample(logits, [SampleRequest(params, 0, i) for i in range(64)])]
    run2 = [r.token_id for r in sampler.sample(logits, [SampleRequest(params, 0, i) for i in range(64)])]
    assert run1 == run2
    assert len(set(run1)) > 40  # uniform over 1000 tokens: positions do not repeat one draw


def test_logprobs_give_the_sampled_token_and_the_top_k_best_first() -> None:
    logits = logits_of([0.1, 0.6, 0.3]).unsqueeze(0)
    req = SampleRequest(SamplingParams(temperature=0.0, logprobs=2), 0, 0)
    (result,) = Sampler(0, torch.device("cpu")).sample(logits, [req])
    assert result.token_id == 1 and result.logprob is not None
    assert math.isclose(result.logprob.logprob, math.log(0.6), abs_tol=1e-6)
    assert [t for t, _ in result.logprob.top] == [1, 2]
    assert math.isclose(result.logprob.top[1][1], math.log(0.3), abs_tol=1e-6)


def test_no_logprobs_are_computed_unless_asked() -> None:
    (result,) = Sampler(0, torch.device("cpu")).sample(
        torch.zeros(1, 4), [SampleRequest(SamplingParams(temperature=0.0), 0, 0)]
    )
    assert result.logprob is None
