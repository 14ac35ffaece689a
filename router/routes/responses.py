"""``/v1/responses``: the Responses API through the router.

``POST /v1/responses`` is a generation route like chat (a plain Starlette route, through the
admission pipeline and the relay: authenticated, parsed, quota-charged, queued, placed,
accounted from the usage its answer reports); a follow-up (``previous_response_id``) is placed
on the engine that stored its predecessor (:mod:`kvfleet.router.responses`). ``GET``, cancel
and ``DELETE`` of a stored response are authenticated and passed to that engine as they are.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import urlsplit

import httpx
from fastapi import APIRouter, Request, Response

from kvfleet.openai_api.responses_request import ResponseObject
from kvfleet.openai_responses import ErrorResponse
from kvfleet.protocol import HEADER_ENGINE
from kvfleet.router import pipeline, proxy
from kvfleet.router.deps import AuthTenant, State
from kvfleet.router.errors import RouterError
from kvfleet.router.requests import RESPONSES
from kvfleet.router.responses import engine_for

router = APIRouter(tags=["responses"])

_ERROR = {"model": ErrorResponse}
STORED: dict[int | str, dict[str, Any]] = {
    200: {"model": ResponseObject, "description": "the stored response (the engine's answer)"},
    400: {**_ERROR, "description": "cancel: not a running background response"},
    401: {**_ERROR, "description": "missing or invalid API key"},
    404: {**_ERROR, "description": "no engine of the fleet stored this response"},
    502: {**_ERROR, "description": "the engine could not be reached"},
}


async def create_response(request: Request) -> Response:
    state = request.app.state.router
    ex = await pipeline.admit(
        state, request.headers.get("authorization"), RESPONSES, await request.body(), request.headers
    )
    return await proxy.serve(state, ex)


router.add_route(RESPONSES, create_response, methods=["POST"], include_in_schema=False)


async def _to_engine(state: State, method: str, response_id: str, suffix: str = "") -> Response:
    url = engine_for(state, response_id)
    if url is None:
        raise RouterError(
            404, "response_not_found", f"response {response_id!r} was not stored by an engine of this fleet"
        )
    try:
        answer = await state.client.request(method, f"{url}{RESPONSES}/{response_id}{suffix}")
    except httpx.HTTPError as exc:
        raise RouterError(502, "engine_unreachable", f"the engine could not be reached: {exc}") from None
    headers = {HEADER_ENGINE: urlsplit(url).netloc}
    return Response(
        answer.content, status_code=answer.status_code, headers=headers, media_type="application/json"
    )


@router.get("/v1/responses/{response_id}", responses=STORED)
async def get_response(response_id: str, state: State, _: AuthTenant) -> Response:
    return await _to_engine(state, "GET", response_id)


@router.post("/v1/responses/{response_id}/cancel", responses=STORED)
async def cancel_response(response_id: str, state: State, _: AuthTenant) -> Response:
    return await _to_engine(state, "POST", response_id, "/cancel")


@router.delete("/v1/responses/{response_id}", responses={**STORED, 200: {"description": "deleted"}})
async def delete_response(response_id: str, state: State, _: AuthTenant) -> Response:
    return await _to_engine(state, "DELETE", response_id)
