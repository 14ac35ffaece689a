"""``/tokenize`` and ``/detokenize`` as the router reads them: parsed before quota, charged as prompt tokens.

Where it sits: beside :mod:`kvfleet.router.anthropic`; the admission pipeline
(:mod:`kvfleet.router.pipeline`) hands these bodies to :func:`parse_tokenizer_request`,
validated by the engine's own models (:mod:`kvfleet.openai_api`), and then admits, queues and
charges them as it does a chat completion (nothing is generated: ``max_tokens`` is 0). Unlike
the engine, the router needs ``model``: it is what picks the engines. The accounting reads a
``/tokenize`` answer's ``count`` as its prompt tokens (:func:`whole_usage`); a ``/detokenize``
is charged its token ids.
"""

from __future__ import annotations

from typing import Any

from kvfleet.openai_api import DetokenizeRequest, TokenizeRequest
from kvfleet.router.errors import RouterError
from kvfleet.router.prefix import prompt_text
from kvfleet.router.requests import ParsedRequest, validated

TOKENIZE = "/tokenize"
DETOKENIZE = "/detokenize"
PATHS = (TOKENIZE, DETOKENIZE)


def parse_tokenizer_request(path: str, raw: bytes) -> ParsedRequest:
    model: type[TokenizeRequest] | type[DetokenizeRequest] = (
        TokenizeRequest if path == TOKENIZE else DetokenizeRequest
    )
    parsed, body = validated(model, raw)
    if parsed.model is None:
        raise RouterError(
            400, "invalid_request", "model: field required (the router routes by it)", param="model"
        )
    prompt = "" if isinstance(parsed, DetokenizeRequest) else prompt_text(body)
    return ParsedRequest(
        path=path, model=parsed.model, body=body, stream=False, client_wants_usage=True, max_tokens=0,
        prompt=prompt, raw=raw,
    )  # fmt: skip


def whole_usage(path: str, body: dict[str, Any], request: dict[str, Any]) -> dict[str, int]:
    """The answer's count (``/tokenize``) or the request's token ids (``/detokenize``) as prompt tokens."""
    prompt = int(body.get("count") or 0) if path == TOKENIZE else len(request.get("tokens") or [])
    return {"prompt_tokens": prompt, "completion_tokens": 0, "total_tokens": prompt}
