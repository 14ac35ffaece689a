"""``POST /v1/completions`` and ``POST /v1/chat/completions``: the proxied OpenAI endpoints.

These are the hot path, so the handlers take the bare :class:`Request` and do the two
things the dependencies of the other routes do (state, authentication) inline:
FastAPI's dependency solving is a measurable share of the router's CPU per request.
"""

from __future__ import annotations

from fastapi import APIRouter, Request, Response

from kvfleet.router.deps import authenticate
from kvfleet.router.errors import RouterError
from kvfleet.router.proxy import serve
from kvfleet.router.requests import CHAT, COMPLETIONS, parse_request
from kvfleet.router.state import RouterState

router = APIRouter(tags=["openai"])


async def _forward(path: str, request: Request) -> Response:
    state: RouterState = request.app.state.router
    tenant = authenticate(state, request.headers.get("authorization"))
    try:
        parsed = parse_request(path, await request.body(), state.config.default_max_tokens)
    except RouterError as err:
        state.metrics.reject("unknown", tenant.name, err.code, err.status)
        raise
    return await serve(state, tenant, parsed)


@router.post(COMPLETIONS)
async def completions(request: Request) -> Response:
    return await _forward(COMPLETIONS, request)


@router.post(CHAT)
async def chat_completions(request: Request) -> Response:
    return await _forward(CHAT, request)
