"""The router's OpenAPI document: FastAPI's, plus the two proxied routes it cannot see.

Where it sits: ``build_app`` installs :func:`install_openapi`. The generation routes are
plain Starlette routes (the hot path skips FastAPI's per-request machinery), so FastAPI
leaves them out; they are described here from the same models that validate them
(:mod:`kvfleet.openai_api`) and that the engine answers with (:mod:`kvfleet.openai_responses`),
with every status the router sends (docs/architecture.md §6). Schemathesis checks the
router against this document.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from kvfleet.http_guard import document_errors
from kvfleet.openai_api import ChatCompletionRequest, CompletionRequest, EmbeddingRequest
from kvfleet.openai_api.responses_request import ResponseObject, ResponsesRequest
from kvfleet.openai_responses import (
    SSE_EVENT_SCHEMA,
    ChatCompletionResponse,
    CompletionResponse,
    EmbeddingResponse,
    ErrorResponse,
)
from kvfleet.router.requests import CHAT, COMPLETIONS, EMBEDDINGS, RESPONSES

_REF = "#/components/schemas/{model}"
_ERRORS = {
    "400": "bad input, naming the field",
    "401": "missing or invalid API key",
    "403": "the tenant may not use this model",
    "404": "no engine serves this model",
    "413": "the request body is over the router's limit",
    "429": "over the tenant's quota, or its queue is full (Retry-After)",
    "500": "a bug in the router",
    "502": "no engine could be reached",
    "503": "no ready engine (Retry-After)",
    "504": "the engine did not answer in time",
}
_GENERATION: dict[str, tuple[str, type[BaseModel], type[BaseModel]]] = {
    COMPLETIONS: ("create a completion", CompletionRequest, CompletionResponse),
    CHAT: ("create a chat completion", ChatCompletionRequest, ChatCompletionResponse),
    RESPONSES: ("create a response (OpenAI Responses API)", ResponsesRequest, ResponseObject),
    EMBEDDINGS: ("create embeddings", EmbeddingRequest, EmbeddingResponse),
}


def _ref(model: type[BaseModel]) -> dict[str, str]:
    return {"$ref": _REF.format(model=model.__name__)}


def _operation(summary: str, request: type[BaseModel], response: type[BaseModel]) -> dict[str, Any]:
    errors = {
        code: {"description": text, "content": {"application/json": {"schema": _ref(ErrorResponse)}}}
        for code, text in _ERRORS.items()
    }
    ok = {
        "description": "JSON, or SSE when stream",
        "content": {
            "application/json": {"schema": _ref(response)},
            "text/event-stream": {"schema": SSE_EVENT_SCHEMA},
        },
    }
    return {
        "summary": summary,
        "tags": ["openai"],
        "security": [{"bearer": []}],
        "requestBody": {"required": True, "content": {"application/json": {"schema": _ref(request)}}},
        "responses": {"200": ok, **errors},
    }


def router_openapi(app: FastAPI) -> dict[str, Any]:
    if app.openapi_schema is None:
        schema = document_errors(FastAPI.openapi(app))
        models: list[tuple[type[BaseModel], Any]] = [(m, "validation") for _, m, _ in _GENERATION.values()]
        models += [(m, "serialization") for _, _, m in _GENERATION.values()] + [
            (ErrorResponse, "serialization")
        ]
        _, defs = models_json_schema(models, ref_template=_REF)
        components = schema.setdefault("components", {})
        components.setdefault("schemas", {}).update(defs.get("$defs", {}))
        components.setdefault("securitySchemes", {})["bearer"] = {"type": "http", "scheme": "bearer"}
        for path, (summary, request, response) in _GENERATION.items():
            schema.setdefault("paths", {})[path] = {"post": _operation(summary, request, response)}
        app.openapi_schema = schema
    return app.openapi_schema


def install_openapi(app: FastAPI) -> None:
    app.openapi = lambda: router_openapi(app)  # type: ignore[method-assign]
