"""schemathesis against a running server's own OpenAPI document: no 5xx, every response as documented.

The engine's and the router's tests (``tests/engine/server/test_schemathesis.py``,
``tests/router/test_bad_input.py``) run :func:`check_every_operation` against a live server;
the generated bodies are aimed at the served model with short completions, so most cases
reach generation instead of stopping at a 404 or spending the budget on long outputs.
Imported by tests only (schemathesis is a dev dependency).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)

CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
    response_headers_conformance,
]


def aim_at_generation(body: dict[str, Any], model: str) -> None:
    """Send the served model (else nearly every case stops at the 404) and cap long completions (the budget)."""
    if isinstance(body.get("model"), str):
        body["model"] = model
    for key in ("max_tokens", "max_completion_tokens"):
        value = body.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > 8:
            body[key] = 8
    if "messages" in body and body.get("max_tokens") is None and body.get("max_completion_tokens") is None:
        body["max_tokens"] = 8  # chat's default is the whole context left


def check_every_operation(
    url: str, model: str, examples: int, headers: Mapping[str, str] | None = None
) -> set[str]:
    """Every operation of ``url``'s ``/openapi.json``, ``examples`` generated cases each; the paths checked."""
    schema = schemathesis.openapi.from_url(url + "/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]  # type: ignore[union-attr]  # an invalid one fails here
    for op in operations:

        @given(case=op.as_strategy())
        @settings(
            max_examples=examples,
            deadline=None,
            derandomize=True,  # the same examples on every run
            database=None,
            suppress_health_check=list(HealthCheck),
        )
        def check(case: schemathesis.Case) -> None:
            if isinstance(case.body, dict):
                aim_at_generation(case.body, model)
            if headers and case.method.upper() == "POST":
                case.headers.update(headers)
            case.call_and_validate(checks=CHECKS)

        check()
    return {op.path for op in operations}
