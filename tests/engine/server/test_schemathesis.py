"""schemathesis against the server's own OpenAPI document: no 5xx, and every response as documented."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvfleet.testing.openapi_checks import check_every_operation

if TYPE_CHECKING:
    from conftest import LiveServer

EXAMPLES_PER_OPERATION = 20


def test_every_operation_answers_as_its_openapi_document_says(fast_server: LiveServer) -> None:
    paths = check_every_operation(fast_server.url, "tiny", EXAMPLES_PER_OPERATION)
    assert paths >= {"/v1/completions", "/v1/chat/completions", "/tokenize", "/load", "/v1/embeddings", "/v1/models/{model_id}",
                     "/v1/responses", "/v1/responses/{response_id}", "/v1/responses/{response_id}/cancel",
                     "/detokenize", "/v1/messages", "/v1/messages/count_tokens"}  # fmt: skip


def test_a_pooling_engine_answers_every_operation_as_documented(pooling_server: LiveServer) -> None:
    paths = check_every_operation(pooling_server.url, "tiny-embed", EXAMPLES_PER_OPERATION)
    assert "/v1/embeddings" in paths
