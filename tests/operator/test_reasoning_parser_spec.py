"""spec.engine.reasoningParser (issue #45): rendered as vLLM's --reasoning-parser for both engine kinds, an
unknown name refused naming the field (the CRD's enum is the engine's registry, tests/engine/server)."""

from __future__ import annotations

from typing import Any

import pytest

from kvfleet.operator import renderers
from kvfleet.operator.spec import SpecError, parse_inferenceservice
from kvfleet.operator.vllm_engine import vllm_args


def spec(engine: dict[str, Any]) -> Any:
    return parse_inferenceservice({"model": {"name": "m", "uri": "file:///m"}, "engine": engine})


@pytest.mark.parametrize("render", [renderers.engine_args, vllm_args])
def test_the_reasoning_parser_is_the_engines_reasoning_parser_flag(render: Any) -> None:
    kind = "kvfleet" if render is renderers.engine_args else "vllm"
    args = render(spec({"kind": kind, "reasoningParser": "openai_gptoss"}))
    assert args[args.index("--reasoning-parser") + 1] == "openai_gptoss"
    assert "--reasoning-parser" not in render(spec({"kind": kind}))


def test_an_unknown_reasoning_parser_is_refused_naming_the_field() -> None:
    with pytest.raises(SpecError, match="reasoningParser"):
        spec({"reasoningParser": "granite"})
