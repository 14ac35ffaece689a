"""The real tiny model behind the HTTP server: the same greedy text as the offline engine, through the openai client."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvfleet.engine.client.llm import LLM
from kvfleet.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from conftest import LiveServer


def test_the_served_greedy_completion_equals_the_offline_one(tiny_server: LiveServer) -> None:
    offline = LLM("tiny", num_kv_blocks=64, max_model_len=256).generate(
        ["Once upon a time"], SamplingParams(max_tokens=6, temperature=0.0)
    )[0]
    with tiny_server.openai_client() as client:
        done = client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=6, temperature=0)
        streamed = client.completions.create(
            model="tiny", prompt="Once upon a time", max_tokens=6, temperature=0, stream=True
        )
        text = "".join(c.choices[0].text for c in streamed if c.choices)
    assert done.choices[0].text == text == offline.outputs[0].text
    assert done.choices[0].finish_reason == offline.outputs[0].finish_reason
    assert done.usage is not None and done.usage.completion_tokens == len(offline.outputs[0].token_ids)
