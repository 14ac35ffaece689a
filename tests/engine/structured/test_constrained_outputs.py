"""Structured outputs on the real tiny model: every output that stops parses and matches its constraint.

The tiny model's weights are random, so without the grammar its output is noise: whatever
matches below is the grammar's doing. Outputs cut by max_tokens ("length") are allowed but
counted; most must stop on their own.
"""

from __future__ import annotations

import json
import random
import re

import jsonschema
import pytest

from kvfleet.engine import LLM, SamplingParams
from kvfleet.engine.sampling_params import RequestError, StructuredOutputSpec
from kvfleet.testing.json_schemas import random_schema

NUM_SCHEMAS = 200


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM("tiny", num_kv_blocks=1024, max_model_len=256, max_num_seqs=32)


def constrained(kind: str, value: str, seed: int, max_tokens: int = 160) -> SamplingParams:
    spec = StructuredOutputSpec(kind, value)  # type: ignore[arg-type]
    return SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=seed, structured=spec)


def test_outputs_of_200_random_schemas_parse_and_validate(llm: LLM) -> None:
    rng = random.Random(28)
    schemas = [random_schema(rng) for _ in range(NUM_SCHEMAS)]
    params = [constrained("json", json.dumps(s), seed) for seed, s in enumerate(schemas)]
    outputs = llm.generate(["{"] * len(params), params)
    reasons = [o.outputs[0].finish_reason for o in outputs]
    for schema, out in zip(schemas, outputs, strict=True):
        if out.outputs[0].finish_reason == "stop":
            jsonschema.validate(json.loads(out.outputs[0].text), schema)
    assert reasons.count("stop") >= 0.9 * NUM_SCHEMAS, reasons.count("length")
    assert set(reasons) <= {"stop", "length"}


def test_json_object_is_any_json_object(llm: LLM) -> None:
    outputs = llm.generate(["x"] * 8, [constrained("json_object", "", seed) for seed in range(8)])
    stopped = [json.loads(o.outputs[0].text) for o in outputs if o.outputs[0].finish_reason == "stop"]
    assert stopped and all(isinstance(v, dict) for v in stopped)


REGEXES = [
    r"\d{3}-\d{4}",
    r"[a-z]{2,6}@[a-z]{2,5}\.(com|org)",
    r"-?\d{1,3}(\.\d{1,2})?",
    r"[A-Z][a-z]{1,5}( [A-Z][a-z]{1,5})?",
    r"#[0-9a-f]{6}",
    r"(yes|no|maybe)!?",
]


def test_regex_outputs_match_the_whole_pattern(llm: LLM) -> None:
    cases = [(pattern, seed) for pattern in REGEXES for seed in range(6)]
    outputs = llm.generate(["x"] * len(cases), [constrained("regex", p, seed, 40) for p, seed in cases])
    reasons = [o.outputs[0].finish_reason for o in outputs]
    assert reasons == ["stop"] * len(cases)
    for (pattern, _), out in zip(cases, outputs, strict=True):
        assert re.fullmatch(pattern, out.outputs[0].text), (pattern, out.outputs[0].text)


def test_choice_outputs_are_exactly_one_of_the_choices(llm: LLM) -> None:
    choices = ["positive", "negative", "neutral", 'a "quoted" one', "é"]
    outputs = llm.generate(
        ["x"] * 20, [constrained("choice", json.dumps(choices), seed, 20) for seed in range(20)]
    )
    texts = [o.outputs[0].text for o in outputs]
    assert [o.outputs[0].finish_reason for o in outputs] == ["stop"] * 20
    assert set(texts) <= set(choices) and len(set(texts)) > 1


def test_an_ebnf_grammar_constrains_the_output(llm: LLM) -> None:
    grammar = 'root ::= "(" item ("," item)* ")"\nitem ::= [0-9] | "x"'
    outputs = llm.generate(["x"] * 10, [constrained("grammar", grammar, seed, 60) for seed in range(10)])
    stopped = [o.outputs[0].text for o in outputs if o.outputs[0].finish_reason == "stop"]
    assert len(stopped) >= 5
    assert all(re.fullmatch(r"\([0-9x](,[0-9x])*\)", t) for t in stopped), stopped


def test_free_rows_get_the_tokens_they_get_alone(llm: LLM) -> None:
    free = [
        SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=24, temperature=0.9, seed=7, ignore_eos=True),
        SamplingParams(max_tokens=24, temperature=0.7, top_p=0.9, seed=8, ignore_eos=True),
    ]
    prompts = ["hello world", "the", "structured"]
    alone = [o.outputs[0].token_ids for o in llm.generate(prompts, free)]
    rng = random.Random(5)
    schemas = [json.dumps(random_schema(rng)) for _ in range(3)]
    mixed_params: list[SamplingParams] = []
    for i, p in enumerate(free):
        mixed_params += [p, constrained("json", schemas[i], i, 24), constrained("regex", r"\d+", i, 24)]
    mixed = llm.generate([p for p in prompts for _ in range(3)], mixed_params)
    assert [mixed[3 * i].outputs[0].token_ids for i in range(3)] == alone


def test_n_samples_each_follow_the_grammar(llm: LLM) -> None:
    params = SamplingParams(
        n=4, max_tokens=20, temperature=1.0, seed=1, structured=StructuredOutputSpec("regex", r"[ab]{3}-\d")
    )
    (out,) = llm.generate(["x"], params)
    assert [o.finish_reason for o in out.outputs] == ["stop"] * 4
    assert all(re.fullmatch(r"[ab]{3}-\d", o.text) for o in out.outputs)


def test_a_grammar_the_engine_cannot_compile_is_refused_naming_the_field(llm: LLM) -> None:
    spec = StructuredOutputSpec("grammar", 'root ::= "a" |', source="structured_outputs.grammar")
    with pytest.raises(RequestError) as refused:
        llm.generate(["x"], SamplingParams(structured=spec))
    assert refused.value.field == "structured_outputs.grammar"
    assert refused.value.reason.startswith(
        "the grammar engine cannot compile it: EBNF parser error at line 1"
    )
    assert not llm.engine.has_unfinished_requests()


def test_the_logprobs_of_refused_tokens_are_a_finite_floor(llm: LLM) -> None:
    spec = StructuredOutputSpec("choice", '["ab", "ac"]')
    (out,) = llm.generate(["x"], SamplingParams(max_tokens=4, temperature=0.0, logprobs=3, structured=spec))
    first = out.outputs[0].logprobs[0]  # type: ignore[index]
    assert (first.token_id, first.logprob) == (ord("a"), 0.0)
    assert [value for _, value in first.top[1:]] == [-9999.0, -9999.0]
