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
from typing import Any

import orjson

from kvfleet import openai_api
from kvfleet.openai_api import ChatCompletionRequest, CompletionRequest, EmbeddingRequest
from kvfleet.router.errors import RouterError
from kvfleet.router.prefix import prompt_text

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
EMBEDDINGS = "/v1/embeddings"  # admitted and charged as the others: its prompt tokens, no completion
BODIES: dict[str, type[ChatCompletionRequest] | type[CompletionRequest] | type[EmbeddingRequest]] = {
    COMPLETIONS: CompletionRequest,
    CHAT: ChatCompletionRequest,
    EMBEDDINGS: EmbeddingRequest,
}


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
        if self.stream:
            body["stream_options"] = {**(self.body.get("stream_options") or {}), "include_usage": True}
        return body

    def upstream_content(self) -> bytes:
        """The bytes to send the engine: the client's own, unless usage or the salt must change."""
        if self.raw and not self.rewritten:
            return self.raw
        return orjson.dumps(self.upstream_body())


def parse_request(path: str, raw: bytes, default_max_tokens: int) -> ParsedRequest:
    """Validate with the shared OpenAI models (:mod:`kvfleet.openai_api`); forward the body as sent."""
    parsed: ChatCompletionRequest | CompletionRequest | EmbeddingRequest
    model = BODIES[path]
    try:
        try:
            body = orjson.loads(raw)
            parsed = openai_api.validate_request(model, body)
        except orjson.JSONDecodeError:  # the shared parser words the 400 (or reads what only json does)
            parsed = openai_api.parse_request(model, raw)
            body = json.loads(raw)
    except openai_api.APIError as exc:
        raise RouterError(
            exc.status_code, exc.code or "invalid_request", exc.message, param=exc.param
        ) from None
    max_tokens = parsed.requested_max_tokens
    return ParsedRequest(
        path=path,
        model=parsed.model,
        body=body,
        stream=parsed.stream,
        client_wants_usage=parsed.include_usage,
        max_tokens=max_tokens if max_tokens is not None else default_max_tokens,
        prompt=prompt_text(body),
        raw=raw,
        cache_salt=parsed.cache_salt,
    )
