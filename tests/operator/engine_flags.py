"""A ``spec.engine`` field that both engine kinds (kvfleet's and vLLM's) take as the same flag: what the
field tests of tests/operator check for each kind."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvfleet.operator import renderers
from kvfleet.operator.vllm_engine import vllm_args

RENDERERS: dict[str, Callable[[Any], list[str]]] = {"kvfleet": renderers.engine_args, "vllm": vllm_args}


def assert_field_is_flag(
    spec: Callable[[dict[str, Any]], Any], kind: str, field: str, value: str, flag: str
) -> None:
    """``spec.engine.<field>: value`` renders ``flag value`` on ``kind``'s command line; no field, no ``flag``."""
    render = RENDERERS[kind]
    args = render(spec({"kind": kind, field: value}))
    assert args[args.index(flag) + 1] == value
    assert flag not in render(spec({"kind": kind}))
