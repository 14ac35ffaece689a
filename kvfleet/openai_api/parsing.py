"""The OpenAI error body and request parsing: every bad input becomes one :class:`APIError` naming the field.

Where it sits: under the request models of :mod:`kvfleet.openai_api`; the router and the engine
server parse a body with :func:`parse_request` (or :func:`validate_request` for decoded JSON) and
answer an :class:`APIError` with :meth:`APIError.body`, OpenAI's
``{"error": {"message", "type", "param", "code"}}``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError


class APIError(Exception):
    """An error the client caused (or a state it must wait out), carried as an OpenAI error body."""

    def __init__(
        self,
        status_code: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.headers = dict(headers or {})
        self.status_code = status_code
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        return error_body(self.message, type=self.type, param=self.param, code=self.code)


def error_body(
    message: str, *, type: str = "invalid_request_error", param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    """OpenAI's error body: ``{"error": {"message", "type", "param", "code"}}``."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def model_not_found(model: str, served: str) -> APIError:
    return APIError(
        404,
        f"The model '{model}' does not exist; this server serves '{served}'",
        param="model",
        code="model_not_found",
    )


def validation_error(exc: ValidationError) -> APIError:
    return errors_to_api_error(exc.errors(include_url=False))


def errors_to_api_error(errors: Sequence[Mapping[str, Any]]) -> APIError:
    """pydantic's (or FastAPI's) error list as one 400 naming the field's path, the problem and the value.

    The most specific error wins (the longest location: inside a union, the member that got furthest).
    """
    err = max(errors, key=lambda e: len(e["loc"]))  # max keeps the first of equals
    loc = [str(p) for p in err["loc"] if not _is_union_tag(p)]
    if loc and loc[0] == "body":  # FastAPI's prefix for the request body
        loc = loc[1:]
    param = ".".join(loc) if loc else None
    message = str(err["msg"]).removeprefix("Value error, ")
    if param is None and (named := _FIELD_PREFIX.match(message)):
        param = named.group(1)  # a model-level check names its field first: "stream_options: ..."
        message = message[named.end() :]
    if err["type"] == "missing":
        message = "field required"
    elif err["type"] == "extra_forbidden":
        name = loc[-1] if loc else ""
        message = f"{UNSUPPORTED_FIELDS.get(name, 'not a field this server knows')}; remove it"
    elif err["type"] == "json_invalid":
        return APIError(
            400, f"the request body is not valid JSON: {err.get('ctx', {}).get('error', message)}"
        )
    elif "input" in err and err["type"] != "value_error":
        message = f"{message} (got {_short(err['input'])})"
    return APIError(400, f"{param}: {message}" if param else message, param=param)


_FIELD_PREFIX = re.compile(r"^([a-z_][a-z0-9_.]*): ")


def _is_union_tag(part: int | str) -> bool:
    # pydantic names the member of a union it tried ("str", "list[str]") inside an error's location.
    return isinstance(part, str) and (part in {"str", "int", "float", "bool"} or "[" in part)


def _short(value: Any) -> str:
    text = json.dumps(value) if not isinstance(value, str) else repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


# Fields OpenAI or vLLM define that kvfleet does not implement: refused (400) naming the field, never ignored.
UNSUPPORTED_FIELDS = {
    "functions": "function calling is not implemented",
    "function_call": "function calling is not implemented",
    "use_beam_search": "beam search is not implemented",
    "length_penalty": "beam search is not implemented",
    "prompt_logprobs": "prompt logprobs are not implemented",
    "min_p": "min_p sampling is not implemented",
    "guided_whitespace_pattern": "a whitespace pattern for guided decoding is not implemented",
}


M = TypeVar("M", bound=BaseModel)


def parse_request(model: type[M], raw: bytes | str) -> M:
    """Parse a raw JSON body into ``model``; malformed JSON or a bad field raises :class:`APIError` (400)."""
    try:  # strictly: no invalid bytes, no overlong forms, no encoded surrogates
        text = raw.decode("utf-8") if isinstance(raw, bytes) else raw
    except UnicodeDecodeError as exc:
        raise APIError(
            400, f"the request body is not valid UTF-8: {exc.reason} at byte {exc.start}"
        ) from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise APIError(400, f"the request body is not valid JSON: {exc}") from None
    return validate_request(model, data)


def validate_request(model: type[M], data: Any) -> M:
    if not isinstance(data, dict):
        raise APIError(400, f"the request body must be a JSON object, got {type(data).__name__}")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise validation_error(exc) from None
