"""Every error the engine server sends is an OpenAI error body (``{"error": {...}}``), never a bare 422 or 500.

Where it sits: installed on the app by ``create_app``. FastAPI's body validation errors
(malformed JSON, wrong types, missing fields, ranges) become 400s naming the field through
:func:`kvfleet.openai_api.errors_to_api_error`, the same wording the router gives. What no
handler here takes (a bug) is answered by :class:`kvfleet.http_guard.RequestGuard` with a 500
body that leaves the keep-alive connection open.
"""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvfleet.engine.async_engine import EngineDeadError
from kvfleet.openai_api import APIError, error_body, errors_to_api_error


def _respond(err: APIError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status_code, headers=err.headers or None)


async def _api_error(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, APIError)
    return _respond(exc)


async def _validation_error(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    return _respond(errors_to_api_error(exc.errors()))


async def _http_error(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
    return JSONResponse(
        error_body(str(exc.detail), type=kind),
        status_code=exc.status_code,
        headers=dict(exc.headers or {}) or None,
    )


def engine_dead_error(exc: Exception) -> APIError:
    """What a request the dead (or stopping) engine core failed gets: a 503 ``engine_dead``."""
    return APIError(
        503, str(exc), type="service_unavailable", code="engine_dead", headers={"Retry-After": "5"}
    )


async def _engine_dead(_: Request, exc: Exception) -> JSONResponse:
    return _respond(engine_dead_error(exc))


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(EngineDeadError, _engine_dead)
