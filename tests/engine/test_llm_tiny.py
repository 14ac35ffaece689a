"""LLM(model="tiny") end to end: the real runner under the engine core, against Hugging Face greedy decoding."""

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from kvfleet.engine import LLM, SamplingParams
from kvfleet.engine.testing.tiny import ensure_tiny_model

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
PROMPTS = ["hello world", "the", "kvfleet serves models on kubernetes"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ensure_tiny_model(tmp_path_factory.mktemp("kvfleet-cache"))


@pytest.fixture(scope="module")
def reference(tiny: Path) -> dict[tuple[int, ...], list[int]]:
    """Greedy continuation by transformers, one prompt at a time, no KV cache tricks."""
    model = AutoModelForCausalLM.from_pretrained(tiny).eval()
    cache: dict[tuple[int, ...], list[int]] = {}

    def run(prompt_ids: list[int]) -> list[int]:
        ids = torch.tensor([prompt_ids])
        with torch.no_grad():
            for _ in range(GREEDY.max_tokens):
                ids = torch.cat([ids, model(ids).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
        return ids[0, len(prompt_ids) :].tolist()

    return {"run": run, "cache": cache}  # type: ignore[return-value]


def hf(reference: dict, prompt_ids: list[int]) -> list[int]:  # type: ignore[type-arg]
    key = tuple(prompt_ids)
    if key not in reference["cache"]:
        reference["cache"][key] = reference["run"](prompt_ids)
    return reference["cache"][key]


def test_generate_on_the_tiny_model_equals_transformers_greedy(tiny: Path, reference: dict) -> None:  # type: ignore[type-arg]
    llm = LLM(model=str(tiny), num_kv_blocks=64, block_size=4, max_model_len=128)
    outs = llm.generate(PROMPTS, GREEDY)
    assert [o.prompt_token_ids for o in outs] == [llm.engine.tokenizer.encode(p) for p in PROMPTS]
    for out in outs:
        assert out.outputs[0].token_ids == hf(reference, out.prompt_token_ids)
        assert out.outputs[0].finish_reason == "length"
        assert out.outputs[0].text == llm.engine.tokenizer.decode(out.outputs[0].token_ids)
    assert llm.engine.stats().kv_cache_usage == 0.0


def test_chunked_prefill_preemption_and_prefix_hits_keep_the_tokens_exact(
    tiny: Path, reference: dict
) -> None:  # type: ignore[type-arg]
    # An 8-token budget chunks the 12-token prompts; 8 blocks of 4 slots cannot hold all three at once;
    # the third request repeats the first one's prompt.
    llm = LLM(model=str(tiny), num_kv_blocks=8, block_size=4, max_model_len=128, max_num_batched_tokens=8)
    outs = llm.generate([PROMPTS[0], PROMPTS[1], PROMPTS[0]], GREEDY)
    for out in outs:
        assert out.outputs[0].token_ids == hf(reference, out.prompt_token_ids)
    stats = llm.engine.stats()
    assert (stats.num_preemptions, stats.prefix_cache_queries, stats.prefix_cache_hits) == (1, 44, 20)
    assert stats.kv_cache_usage == 0.0


def test_n_greedy_samples_of_one_prompt_are_identical_and_exact(tiny: Path, reference: dict) -> None:  # type: ignore[type-arg]
    llm = LLM(model=str(tiny), num_kv_blocks=64, block_size=4, max_model_len=128)
    params = SamplingParams(n=3, temperature=0.0, max_tokens=6, ignore_eos=True)
    (out,) = llm.generate(PROMPTS[0], params)
    expected = hf(reference, out.prompt_token_ids)
    assert [o.token_ids for o in out.outputs] == [expected] * 3


def test_model_tiny_builds_into_the_kvfleet_cache_and_generates(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KVFLEET_CACHE", str(tmp_path))
    llm = LLM(model="tiny", num_kv_blocks=16)
    (out,) = llm.generate(["hi"], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    assert (out.prompt_token_ids, len(out.outputs[0].token_ids), out.outputs[0].finish_reason) == (
        [256, 104, 105],
        4,
        "length",
    )
    assert llm.engine.model_name == "tiny" and llm.engine.max_model_len == 2048


def test_greedy_with_penalties_and_a_bias_equals_transformers_with_the_same_processing(tiny: Path) -> None:
    # transformers' own repetition-penalty processor (vLLM's semantics: prompt and output tokens),
    # then OpenAI's frequency and presence penalties over the output and the logit bias, by hand.
    from transformers import RepetitionPenaltyLogitsProcessor

    params = SamplingParams(
        temperature=0.0,
        max_tokens=10,
        ignore_eos=True,
        repetition_penalty=1.8,
        frequency_penalty=0.6,
        presence_penalty=0.4,
        logit_bias={70: -50.0, 101: 2.0},  # 70: the third token greedy picks without it
    )
    model = AutoModelForCausalLM.from_pretrained(tiny).eval()
    repetition = RepetitionPenaltyLogitsProcessor(params.repetition_penalty)
    llm = LLM(model=str(tiny), num_kv_blocks=64, block_size=4, max_model_len=128)
    plain = llm.generate(PROMPTS[0], GREEDY)[0].outputs[0].token_ids
    (out,) = llm.generate(PROMPTS[0], params)
    ids = torch.tensor([out.prompt_token_ids])
    with torch.no_grad():
        for _ in range(params.max_tokens):
            logits = model(ids).logits[:, -1].float()
            for token, bias in params.logit_bias:
                logits[0, token] += bias
            logits = repetition(ids, logits)
            output = ids[0, len(out.prompt_token_ids) :].tolist()
            for token in set(output):
                logits[0, token] -= params.frequency_penalty * output.count(token) + params.presence_penalty
            ids = torch.cat([ids, logits.argmax(-1, keepdim=True)], dim=1)
    assert out.outputs[0].token_ids == ids[0, len(out.prompt_token_ids) :].tolist()
    assert out.outputs[0].token_ids[:6] != plain  # the processing changed what greedy picks
