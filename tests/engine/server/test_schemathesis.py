"""schemathesis against the server's own OpenAPI document: no 5xx, and every response as documented."""

from __future__ import annotations

from typing import TYPE_CHECKING

import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)

if TYPE_CHECKING:
    from conftest import LiveServer

CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
    response_headers_conformance,
]


EXAMPLES_PER_OPERATION = 20


def _aim_at_generation(body: dict[str, object]) -> None:
    """Send the served model (else nearly every case stops at the 404) and cap long completions (the budget)."""
    if isinstance(body.get("model"), str):
        body["model"] = "tiny"
    for key in ("max_tokens", "max_completion_tokens"):
        value = body.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > 8:
            body[key] = 8
    if "messages" in body and body.get("max_tokens") is None and body.get("max_completion_tokens") is None:
        body["max_tokens"] = 8  # chat's default is the whole context left


def test_every_operation_answers_as_its_openapi_document_says(fast_server: LiveServer) -> None:
    schema = schemathesis.openapi.from_url(fast_server.url + "/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {op.path for op in operations} >= {"/v1/completions", "/v1/chat/completions", "/tokenize", "/load"}
    for op in operations:

        @given(case=op.as_strategy())
        @settings(
            max_examples=EXAMPLES_PER_OPERATION,
            deadline=None,
            derandomize=True,  # the same examples on every run
            database=None,
            suppress_health_check=list(HealthCheck),
        )
        def check(case: schemathesis.Case) -> None:
            if isinstance(case.body, dict):
                _aim_at_generation(case.body)
            case.call_and_validate(checks=CHECKS)

        check()
