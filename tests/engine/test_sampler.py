"""The sampler on crafted logits: exact masks, argmax for greedy, reproducible seeded draws, penalties as defined."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from kvfleet.engine.runner.sampler import (
    Sampler,
    SampleRequest,
    apply_penalties,
    apply_top_k,
    apply_top_p,
    request_seed,
)
from kvfleet.engine.sampling_params import SamplingParams, SamplingParamsError

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


def reference_penalised(
    logits: torch.Tensor, params: SamplingParams, prompt: list[int], output: list[int]
) -> torch.Tensor:
    """vLLM's and OpenAI's definitions, token by token: bias, repetition (prompt + output), frequency, presence."""
    out = logits.clone()
    for token, bias in params.logit_bias:
        out[token] += bias
    for token in set(prompt) | set(output):
        value = out[token]
        out[token] = value / params.repetition_penalty if value > 0 else value * params.repetition_penalty
    for token in set(output):
        out[token] -= params.frequency_penalty * output.count(token) + params.presence_penalty
    return out


def test_bias_and_penalties_change_exactly_the_logits_their_definitions_name() -> None:
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(40, generator=gen) * 3
    prompt, output = [1, 2, 2, 7, 30], [7, 7, 7, 3, 39, 3, 1]
    params = SamplingParams(
        presence_penalty=0.5,
        frequency_penalty=-0.25,
        repetition_penalty=1.3,
        logit_bias={3: 5.0, 11: -100.0, 39: 0.5},
    )
    got = apply_penalties(logits, params, prompt, output)
    want = reference_penalised(logits, params, prompt, output)
    assert torch.allclose(got, want, rtol=0, atol=1e-6)
    untouched = [t for t in range(40) if t not in {1, 2, 3, 7, 11, 30, 39}]
    assert torch.equal(got[untouched], logits[untouched])


def test_a_repetition_penalty_below_one_favours_seen_tokens_by_sign() -> None:
    logits = torch.tensor([2.0, -2.0, 2.0, -2.0])
    got = apply_penalties(logits, SamplingParams(repetition_penalty=0.5), [0, 1], [])
    assert got.tolist() == [4.0, -1.0, 2.0, -2.0]


def test_greedy_takes_the_argmax_after_the_bias_and_penalties() -> None:
    logits = torch.tensor([[0.0, 3.0, 2.0, 1.0]])
    sampler = Sampler(0, torch.device("cpu"))

    def pick(params: SamplingParams, output: list[int]) -> int:
        return sampler.sample(logits, [SampleRequest(params, 0, len(output), [], output)])[0].token_id

    assert pick(SamplingParams(temperature=0.0), [1, 1]) == 1
    assert pick(SamplingParams(temperature=0.0, frequency_penalty=1.0), [1, 1]) == 2
    assert pick(SamplingParams(temperature=0.0, presence_penalty=1.5), [1]) == 2
    assert pick(SamplingParams(temperature=0.0, logit_bias={0: 100.0}), []) == 0
    assert pick(SamplingParams(temperature=0.0, repetition_penalty=2.0), [1]) == 2


def test_a_random_draw_samples_from_the_penalised_distribution() -> None:
    logits = torch.zeros(1, 4).repeat(300, 1)
    params = SamplingParams(temperature=1.0, logit_bias={0: -100.0, 1: -100.0}, seed=9)
    requests = [SampleRequest(params, 0, i, [], []) for i in range(300)]
    tokens = {r.token_id for r in Sampler(0, torch.device("cpu")).sample(logits, requests)}
    assert tokens == {2, 3}


@pytest.mark.parametrize(
    ("field", "kwargs"),
    [
        ("presence_penalty", {"presence_penalty": 2.5}),
        ("frequency_penalty", {"frequency_penalty": -3.0}),
        ("repetition_penalty", {"repetition_penalty": 0.0}),
        ("logit_bias", {"logit_bias": {5: 101.0}}),
        ("logit_bias", {"logit_bias": {-1: 1.0}}),
    ],
)
def test_out_of_range_penalties_and_biases_are_refused_naming_the_field(
    field: str, kwargs: dict[str, Any]
) -> None:
    with pytest.raises(SamplingParamsError) as info:
        SamplingParams(**kwargs)
    assert info.value.field == field
