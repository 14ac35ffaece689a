"""The offline LLM API over an engine with the fake runner; import lightness of kvfleet.engine."""

import subprocess
import sys
from collections.abc import Callable

import pytest

from kvfleet.engine import LLM, SamplingParams
from kvfleet.engine.core.engine import Engine, RequestError


def test_generate_returns_one_result_per_prompt_in_order(make_engine: Callable[..., Engine]) -> None:
    llm = LLM(engine=make_engine())
    outs = llm.generate(["abc", "x", [ord("m")]], SamplingParams(max_tokens=2))
    assert [o.prompt_token_ids for o in outs] == [[97, 98, 99], [120], [109]]
    assert [(o.outputs[0].text, o.outputs[0].finish_reason) for o in outs] == [
        ("de", "length"),
        ("yz", "length"),
        ("no", "length"),
    ]


def test_generate_takes_one_sampling_params_per_prompt(make_engine: Callable[..., Engine]) -> None:
    llm = LLM(engine=make_engine())
    outs = llm.generate(["a", "a"], [SamplingParams(max_tokens=1), SamplingParams(max_tokens=3, n=2)])
    assert [[c.text for c in o.outputs] for o in outs] == [["b"], ["bcd", "bcd"]]


def test_generate_rejects_a_params_list_of_the_wrong_length_before_running_anything(
    make_engine: Callable[..., Engine],
) -> None:
    llm = LLM(engine=make_engine())
    with pytest.raises(ValueError, match="got 1 SamplingParams for 2 prompts"):
        llm.generate(["a", "b"], [SamplingParams()])
    assert not llm.engine.has_unfinished_requests()


def test_a_bad_prompt_in_a_batch_aborts_the_ones_already_added(make_engine: Callable[..., Engine]) -> None:
    llm = LLM(engine=make_engine())
    with pytest.raises(RequestError, match="prompt: must not be empty"):
        llm.generate(["a", ""])
    assert not llm.engine.has_unfinished_requests() and llm.engine.stats().kv_cache_usage == 0.0
    assert llm.generate("a", SamplingParams(max_tokens=1))[0].outputs[0].text == "b"


def test_importing_the_engine_core_does_not_import_torch() -> None:
    code = (
        "import sys, kvfleet.engine, kvfleet.engine.core.engine, kvfleet.engine.client.llm, kvfleet.engine.sched.scheduler;"
        "from kvfleet.engine import LLM, SamplingParams;"
        "print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
