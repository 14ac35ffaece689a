"""A client's request as the router reads it, checked before anything is spent (docs/architecture.md §6).

The body is parsed and validated first, by the same models the engine uses
(:mod:`kvfleet.openai_api`; a 400 naming the field), so a malformed request never takes
a request, tokens or a concurrency slot from its tenant's quota. The
router forwards the bytes it received, re-encoding the body only when it must change it:
for a stream whose client did not ask for ``stream_options.include_usage`` (the router adds
it, so that it can account the real usage), and to set ``cache_salt`` to the tenant's
(the pipeline's :func:`~kvfleet.router.prefix.tenant_cache_salt`: no tenant reuses another's
prefix cache).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any, TypeVar

import orjson
from pydantic import BaseModel

from kvfleet import openai_api
from kvfleet.openai_api import ChatCompletionRequest, CompletionRequest, EmbeddingRequest
from kvfleet.openai_api.responses_request import ResponsesRequest
from kvfleet.router.errors import RouterError
from kvfleet.router.prefix import prompt_text

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
RESPONSES = "/v1/responses"
EMBEDDINGS = "/v1/embeddings"  # admitted and charged as the others: its prompt tokens, no completion
BODIES: dict[str, type[ChatCompletionRequest] | type[CompletionRequest] | type[EmbeddingRequest]] = {
    COMPLETIONS: CompletionRequest,
    CHAT: ChatCompletionRequest,
    EMBEDDINGS: EmbeddingRequest,
}

M = TypeVar("M", bound=BaseModel)


@dataclass(frozen=True)
class ParsedRequest:
    path: str
    model: str
    body: dict[str, Any]
    stream: bool
    client_wants_usage: bool
    max_tokens: int
    prompt: str
    raw: bytes = b""
    cache_salt: str | None = None  # what the engine is sent; the pipeline sets it (the client's until then)
    previous_response_id: str | None = None  # a Responses follow-up: placed where its predecessor is stored

    def prompt_tokens_estimate(self, chars_per_token: float) -> int:
        return max(1, math.ceil(len(self.prompt) / chars_per_token))

    @property
    def rewritten(self) -> bool:
        """Whether the engine must be sent another body than the client's."""
        return (self.stream and not self.client_wants_usage) or self.cache_salt != self.body.get("cache_salt")

    def upstream_body(self) -> dict[str, Any]:
        body = dict(self.body)
        if self.cache_salt is None:
            body.pop("cache_salt", None)
        else:
            body["cache_salt"] = self.cache_salt
        # Responses and Anthropic streams carry their usage already
        if self.stream and self.path in (COMPLETIONS, CHAT):
            body["stream_options"] = {**(self.body.get("stream_options") or {}), "include_usage": True}
        return body

    def upstream_content(self) -> bytes:
        """The bytes to send the engine: the client's own, unless usage or the salt must change."""
        if self.raw and not self.rewritten:
            return self.raw
        body = self.upstream_body()
        try:
            return orjson.dumps(body)
        except TypeError:  # an integer past 64 bits in a free-form object (a schema, an item): json writes it
            return json.dumps(body, ensure_ascii=False).encode()


def validated(model: type[M], raw: bytes) -> tuple[M, dict[str, Any]]:
    """``raw`` validated by ``model`` and read as a dict: every route's parser starts here.

    A refusal is the shared models' own error (a 400 naming the field), as a :class:`RouterError`.
    """
    try:
        try:
            body = orjson.loads(raw)
            return openai_api.validate_request(model, body), body
        except orjson.JSONDecodeError:  # the shared parser words the 400 (or reads what only json does)
            return openai_api.parse_request(model, raw), json.loads(raw)
    except openai_api.APIError as exc:
        raise RouterError(
            exc.status_code, exc.code or "invalid_request", exc.message, param=exc.param
        ) from None


def parse_request(path: str, raw: bytes, default_max_tokens: int) -> ParsedRequest:
    """Validate with the shared OpenAI models (:mod:`kvfleet.openai_api`); forward the body as sent."""
    parsed: ChatCompletionRequest | CompletionRequest | EmbeddingRequest | ResponsesRequest
    if path == RESPONSES:  # its stream ends with the usage (response.completed): never rewritten for it
        responses, body = validated(ResponsesRequest, raw)
        prompt, max_tokens, wants_usage = _responses_prompt(responses), responses.max_output_tokens, True
        parsed = responses
    else:
        request, body = validated(BODIES[path], raw)
        prompt, max_tokens, wants_usage = (
            prompt_text(body),
            request.requested_max_tokens,
            request.include_usage,
        )
        parsed = request
    return ParsedRequest(
        path=path,
        model=parsed.model,
        body=body,
        stream=parsed.stream,
        client_wants_usage=wants_usage,
        max_tokens=max_tokens if max_tokens is not None else default_max_tokens,
        prompt=prompt,
        raw=raw,
        cache_salt=parsed.cache_salt,
        previous_response_id=parsed.previous_response_id if isinstance(parsed, ResponsesRequest) else None,
    )


def _responses_prompt(parsed: ResponsesRequest) -> str:
    """A Responses request's prompt (:mod:`kvfleet.openai_api.responses_request`), read as the chat it
    amounts to."""
    messages = parsed.input_messages()
    if parsed.instructions:
        messages.insert(0, {"role": "system", "content": parsed.instructions})
    return prompt_text({"messages": messages})
