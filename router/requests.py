"""A client's request as the router reads it, checked before anything is spent (DESIGN §6).

The body is parsed and validated first (a 400 naming the field), so a malformed request
never takes a request, tokens or a concurrency slot from its tenant's quota. The
router forwards the body it received, adding only ``stream_options.include_usage``
to streams so that it can account the real usage.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

from kvfleet.router.errors import RouterError
from kvfleet.router.prefix import prompt_text

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"


@dataclass(frozen=True)
class ParsedRequest:
    path: str
    model: str
    body: dict[str, Any]
    stream: bool
    client_wants_usage: bool
    max_tokens: int
    prompt: str

    def prompt_tokens_estimate(self, chars_per_token: float) -> int:
        return max(1, math.ceil(len(self.prompt) / chars_per_token))

    def upstream_body(self) -> dict[str, Any]:
        if not self.stream:
            return self.body
        options = dict(self.body.get("stream_options") or {})
        options["include_usage"] = True
        return {**self.body, "stream_options": options}


def _bad(message: str, param: str | None) -> RouterError:
    return RouterError(400, "invalid_request", message, param=param)


def _field(body: dict[str, Any], name: str, kinds: tuple[type, ...], what: str) -> Any:
    value = body.get(name)
    if value is not None and (not isinstance(value, kinds) or isinstance(value, bool) and bool not in kinds):
        raise _bad(f"'{name}' must be {what}, got {json.dumps(value)[:60]}", name)
    return value


def parse_request(path: str, raw: bytes, default_max_tokens: int) -> ParsedRequest:
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise _bad(f"request body is not valid JSON: {exc}", None) from None
    if not isinstance(body, dict):
        raise _bad("request body must be a JSON object", None)
    model = _field(body, "model", (str,), "a string")
    if not model:
        raise _bad("'model' is required", "model")
    if path == CHAT:
        messages = _field(body, "messages", (list,), "a list of messages")
        if not messages or not all(isinstance(m, dict) and "role" in m for m in messages):
            raise _bad("'messages' must be a non-empty list of objects with a 'role'", "messages")
    elif _field(body, "prompt", (str, list), "a string or a list") in (None, "", []):
        raise _bad("'prompt' is required", "prompt")
    max_tokens = _field(body, "max_tokens", (int,), "an integer")
    if max_tokens is None:
        max_tokens = _field(body, "max_completion_tokens", (int,), "an integer")
    if max_tokens is not None and max_tokens < 1:
        raise _bad(f"'max_tokens' must be at least 1, got {max_tokens}", "max_tokens")
    stream = bool(_field(body, "stream", (bool,), "a boolean"))
    options = _field(body, "stream_options", (dict,), "an object") or {}
    return ParsedRequest(
        path=path,
        model=model,
        body=body,
        stream=stream,
        client_wants_usage=bool(options.get("include_usage")),
        max_tokens=max_tokens if max_tokens is not None else default_max_tokens,
        prompt=prompt_text(body),
    )
