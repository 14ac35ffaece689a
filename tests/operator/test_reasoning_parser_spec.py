"""spec.engine.reasoningParser (issue #45): rendered as vLLM's --reasoning-parser for both engine kinds, an
unknown name refused naming the field (the CRD's enum is the engine's registry, tests/engine/server)."""

from __future__ import annotations

from typing import Any

import pytest

from kvfleet.operator.spec import SpecError, parse_inferenceservice

from .engine_flags import RENDERERS, assert_field_is_flag


def spec(engine: dict[str, Any]) -> Any:
    return parse_inferenceservice({"model": {"name": "m", "uri": "file:///m"}, "engine": engine})


@pytest.mark.parametrize("kind", sorted(RENDERERS))
def test_the_reasoning_parser_is_the_engines_reasoning_parser_flag(kind: str) -> None:
    assert_field_is_flag(spec, kind, "reasoningParser", "openai_gptoss", "--reasoning-parser")


def test_an_unknown_reasoning_parser_is_refused_naming_the_field() -> None:
    with pytest.raises(SpecError, match="reasoningParser"):
        spec({"reasoningParser": "granite"})
