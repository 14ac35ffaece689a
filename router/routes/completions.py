"""``POST /v1/completions`` and ``POST /v1/chat/completions``: the proxied OpenAI endpoints."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response

from kvfleet.router.deps import AuthTenant, State
from kvfleet.router.errors import RouterError
from kvfleet.router.proxy import serve
from kvfleet.router.requests import CHAT, COMPLETIONS, parse_request

router = APIRouter(tags=["openai"])


async def _forward(path: str, request: Request, state: State, tenant: AuthTenant) -> Response:
    try:
        parsed = parse_request(path, await request.body(), state.config.default_max_tokens)
    except RouterError as err:
        state.metrics.reject("unknown", tenant.name, err.code, err.status)
        raise
    return await serve(state, tenant, parsed)


@router.post(COMPLETIONS)
async def completions(request: Request, state: State, tenant: AuthTenant) -> Response:
    return await _forward(COMPLETIONS, request, state, tenant)


@router.post(CHAT)
async def chat_completions(request: Request, state: State, tenant: AuthTenant) -> Response:
    return await _forward(CHAT, request, state, tenant)
