"""The ASGI layer in front of both HTTP servers' routes: body size, UTF-8, and unexpected errors (torch-free).

Where it sits: the engine server (``engine/server/app.py``) and the router (``router/app.py``)
wrap their FastAPI app in :class:`RequestGuard`, inside Starlette's outermost error middleware
and outside everything else. A request body is read here, once:

- over ``max_body_bytes`` (8 MiB by default): a 413 naming the limit, sent as soon as the
  ``Content-Length`` header (or the bytes read so far) exceed it, before the rest is read;
- not UTF-8 (invalid bytes, overlong sequences, encoded surrogates): a 400 naming the position;
- otherwise replayed to the app unchanged.

An exception that escapes the app before its response started becomes a 500 in the OpenAI
error body, logged once, and goes no further: uvicorn closes a keep-alive connection when
an exception reaches it, so without this one bug would also fail the client's next request.

Both servers also share :func:`install_error_handlers` (an :class:`~kvfleet.openai_api.APIError`,
FastAPI's validation errors and Starlette's HTTP errors as OpenAI error bodies, a 400 naming
the field instead of a 422) and :func:`document_errors` (their OpenAPI documents say so).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvfleet.openai_api import APIError, error_body, errors_to_api_error

DEFAULT_MAX_BODY_BYTES = 8 << 20

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

log = logging.getLogger(__name__)


class _Refused(Exception):
    def __init__(self, status: int, message: str, code: str) -> None:
        super().__init__(message)
        self.status, self.message, self.code = status, message, code


class HttpMiddleware:
    """Pure ASGI middleware that sees HTTP requests only (:meth:`handle`); lifespan and websocket
    scopes go on to ``app`` untouched. What every middleware of both servers is."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
        else:
            await self.handle(scope, receive, send)

    async def handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        raise NotImplementedError


class RequestGuard(HttpMiddleware):
    """Pure ASGI middleware: bounded, UTF-8 request bodies, and a 500 body for what escapes the app.

    ``on_error(status)`` is told of each 500 it sends (the router counts it in its metrics).
    """

    def __init__(
        self,
        app: ASGIApp,
        max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
        on_error: Callable[[Scope, int], None] | None = None,
    ) -> None:
        super().__init__(app)
        self.max_body_bytes = max_body_bytes
        self.on_error = on_error

    async def handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        started = False

        async def send_tracked(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            if scope["method"] in ("POST", "PUT", "PATCH"):
                receive = await self._buffered(scope, receive)
            await self.app(scope, receive, send_tracked)
        except _Refused as refused:
            await _send_json(send, refused.status, error_body(refused.message, code=refused.code))
        except Exception as exc:
            if started:
                raise  # a response is half sent: only closing the connection can tell the client
            log.exception("unexpected error serving %s %s", scope["method"], scope["path"], exc_info=exc)
            if self.on_error is not None:
                self.on_error(scope, 500)
            body = error_body(
                f"internal error: {type(exc).__name__}", type="server_error", code="internal_error"
            )
            await _send_json(send, 500, body)

    async def _buffered(self, scope: Scope, receive: Receive) -> Receive:
        # Invariant: never more than max_body_bytes are held; the app sees the body exactly as sent.
        limit = self.max_body_bytes
        declared = _content_length(scope)
        if declared is not None and declared > limit:
            raise _too_large(limit, f"Content-Length is {declared}")
        chunks: list[bytes] = []
        size, more = 0, True
        while more:
            message = await receive()
            if message["type"] != "http.request":
                return _replay([message], receive)  # the client left: let the app see it
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                raise _too_large(limit, f"more than {limit} bytes were sent")
            chunks.append(chunk)
            more = message.get("more_body", False)
        body = b"".join(chunks)
        try:
            body.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise _Refused(
                400,
                f"the request body is not valid UTF-8: {exc.reason} at byte {exc.start}",
                "invalid_utf8",
            ) from None
        return _replay([{"type": "http.request", "body": body, "more_body": False}], receive)


def _too_large(limit: int, what: str) -> _Refused:
    return _Refused(
        413, f"the request body is too large: {what}, over the limit of {limit} bytes", "request_too_large"
    )


def _content_length(scope: Scope) -> int | None:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                raise _Refused(400, f"invalid Content-Length header: {value!r}", "invalid_header") from None
    return None


def _replay(messages: list[Message], receive: Receive) -> Receive:
    """A receive that gives ``messages`` first, then whatever the server sends (a disconnect)."""

    async def replayed() -> Message:
        if messages:
            return messages.pop(0)
        return await receive()

    return replayed


async def _send_json(send: Send, status: int, body: dict[str, Any]) -> None:
    content = json.dumps(body).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(content)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": content})


def api_error_response(err: APIError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status_code, headers=err.headers or None)


async def _api_error(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, APIError)
    return api_error_response(exc)


async def _validation_error(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    return api_error_response(errors_to_api_error(exc.errors()))


async def _http_error(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
    return JSONResponse(
        error_body(str(exc.detail), type=kind),
        status_code=exc.status_code,
        headers=dict(exc.headers or {}) or None,
    )


def install_error_handlers(app: FastAPI) -> None:
    """APIError, FastAPI's validation errors and Starlette's HTTP errors answered as OpenAI error bodies."""
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)


def document_errors(schema: dict[str, Any]) -> dict[str, Any]:
    """FastAPI's OpenAPI document with its 422 replaced by the 400 OpenAI error body the servers really send."""
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    for path in schema.get("paths", {}).values():
        for op in path.values():
            responses = op.get("responses", {})
            if responses.pop("422", None) is not None:
                responses.setdefault(
                    "400",
                    {
                        "description": "bad input, naming the field",
                        "content": {
                            "application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}
                        },
                    },
                )
    for name in ("HTTPValidationError", "ValidationError"):
        components.pop(name, None)
    return schema
