"""The Anthropic Messages routes as the router reads them: parsed before quota, their usage in OpenAI's terms.

Where it sits: the admission pipeline (:mod:`kvfleet.router.pipeline`) hands a ``/v1/messages`` or
``/v1/messages/count_tokens`` body to :func:`parse_anthropic`, validated by the engine's own
models (:mod:`kvfleet.anthropic_api`); from there the pipeline admits, queues and charges it as
it does a chat completion, and the relay forwards the client's bytes. The accounting
(:class:`~kvfleet.router.accounting.Exchange`) reads the usage of the answer through
:func:`whole_usage` and :func:`stream_usage`, so a message's ``input_tokens``/``output_tokens``
count as a chat's ``prompt_tokens``/``completion_tokens``; a token count's ``input_tokens`` are
prompt tokens the engine tokenized and nothing was generated. A stream ends at ``message_stop``.
"""

from __future__ import annotations

from typing import Any

import orjson

from kvfleet.anthropic_api import (
    COUNT_TOKENS,
    MESSAGES,
    CountTokensRequest,
    MessagesRequest,
    anthropic_error_body,
)
from kvfleet.router.prefix import prompt_text
from kvfleet.router.requests import ParsedRequest, validated

PATHS = (MESSAGES, COUNT_TOKENS)
STOP_EVENT = "message_stop"


def parse_anthropic(path: str, raw: bytes) -> ParsedRequest:
    """Validate with the shared Anthropic models; forward the body as sent (a 400 names the field)."""
    model: type[MessagesRequest] | type[CountTokensRequest] = (
        MessagesRequest if path == MESSAGES else CountTokensRequest
    )
    parsed, body = validated(model, raw)
    system = (
        parsed.system if isinstance(parsed.system, str) else "\n".join(b.text for b in parsed.system or [])
    )
    return ParsedRequest(
        path=path,
        model=parsed.model,
        body=body,
        stream=isinstance(parsed, MessagesRequest) and parsed.stream,
        client_wants_usage=True,  # Anthropic's stream always carries its usage: nothing to add or strip
        max_tokens=parsed.max_tokens if isinstance(parsed, MessagesRequest) else 0,
        prompt=f"system\n{system}\n{prompt_text(body)}" if system else prompt_text(body),
        raw=raw,
        cache_salt=parsed.cache_salt if isinstance(parsed, MessagesRequest) else None,
    )


def _usage(input_tokens: Any, output_tokens: Any) -> dict[str, int]:
    prompt = int(input_tokens or 0)
    completion = int(output_tokens or 0)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def whole_usage(body: dict[str, Any]) -> dict[str, int] | None:
    """A whole message's (or token count's) usage as OpenAI's; None for any other body."""
    if body.get("type") == "message" and isinstance(body.get("usage"), dict):
        return _usage(body["usage"].get("input_tokens"), body["usage"].get("output_tokens"))
    if set(body) == {"input_tokens"}:
        return _usage(body["input_tokens"], 0)
    return None


def stream_usage(obj: dict[str, Any], so_far: dict[str, Any] | None) -> dict[str, Any] | None:
    """The usage known after one stream event (``message_start``: the prompt; ``message_delta``: the output)."""
    kind = obj.get("type")
    message = obj.get("message")
    if kind == "message_start" and isinstance(message, dict) and isinstance(message.get("usage"), dict):
        return _usage(message["usage"].get("input_tokens"), message["usage"].get("output_tokens"))
    if kind == "message_delta" and isinstance(obj.get("usage"), dict):
        usage = obj["usage"]
        prompt = usage.get("input_tokens") or (so_far or {}).get("prompt_tokens")
        return _usage(prompt, usage.get("output_tokens"))
    return so_far


def stop_reason(obj: dict[str, Any]) -> str | None:
    delta = obj.get("delta")
    if (
        obj.get("type") == "message_delta"
        and isinstance(delta, dict)
        and isinstance(delta.get("stop_reason"), str)
    ):
        return str(delta["stop_reason"])
    if obj.get("type") == "message" and isinstance(obj.get("stop_reason"), str):
        return str(obj["stop_reason"])
    return None


def error_event(status: int, message: str) -> bytes:
    """Anthropic's terminal ``error`` event of a stream."""
    return b"event: error\ndata: " + orjson.dumps(anthropic_error_body(status, message)) + b"\n\n"


def is_content(obj: dict[str, Any]) -> bool:
    return obj.get("type") == "content_block_delta"
