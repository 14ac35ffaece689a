"""The admission pipeline's one entry, as both transports see it (router/pipeline.py)."""

from __future__ import annotations

import json

from kvfleet.router.errors import RouterError
from kvfleet.router.gateway.gate import Reply


def test_a_gateway_refusal_has_the_router_s_own_error_body_and_retry_after() -> None:
    err = RouterError(429, "requests_per_minute", "over the limit", retry_after_s=2.2)
    reply = Reply.error(429, "requests_per_minute", "over the limit", retry_after_s=2.2)
    assert json.loads(reply.body) == err.body()
    assert reply.headers == {"content-type": "application/json", "retry-after": "3"}


def test_an_upstream_failure_is_typed_as_the_router_types_it_at_the_gateway_too() -> None:
    for status, kind in ((502, "upstream_error"), (504, "timeout_error"), (503, "service_unavailable")):
        assert json.loads(Reply.error(status, "x", "y").body)["error"]["type"] == kind
