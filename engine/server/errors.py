"""Every error the engine server sends is an OpenAI error body (``{"error": {...}}``), never a bare 422 or 500.

Where it sits: installed on the app by ``create_app``. FastAPI's body validation errors
(malformed JSON, wrong types, missing fields, ranges) become 400s naming the field through
:func:`kvfleet.openai_api.errors_to_api_error` (:mod:`kvfleet.http_guard`, shared with the router). What no
handler here takes (a bug) is answered by :class:`kvfleet.http_guard.RequestGuard` with a 500
body that leaves the keep-alive connection open.
"""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from kvfleet.engine.client.async_engine import EngineDeadError
from kvfleet.http_guard import api_error_response
from kvfleet.http_guard import install_error_handlers as install_openai_error_handlers
from kvfleet.openai_api import APIError


def engine_dead_error(exc: Exception) -> APIError:
    """What a request the dead (or stopping) engine core failed gets: a 503 ``engine_dead``."""
    return APIError(
        503, str(exc), type="service_unavailable", code="engine_dead", headers={"Retry-After": "5"}
    )


async def _engine_dead(_: Request, exc: Exception) -> JSONResponse:
    return api_error_response(engine_dead_error(exc))


def install_error_handlers(app: FastAPI) -> None:
    install_openai_error_handlers(app)
    app.add_exception_handler(EngineDeadError, _engine_dead)
