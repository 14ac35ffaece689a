"""``POST /v1/completions``, ``POST /v1/chat/completions`` and ``POST /v1/embeddings``: the proxied OpenAI endpoints.

These are the hot path, so they are plain Starlette routes (no FastAPI dependency solving
or response-model handling per request; they are left out of the OpenAPI schema) and the
handlers do what the other routes' dependencies do (state, authentication) inline: the
admission pipeline (:func:`kvfleet.router.pipeline.admit`), then the relay
(:func:`kvfleet.router.proxy.serve`).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from fastapi import APIRouter, Request, Response

from kvfleet.router import pipeline, proxy
from kvfleet.router.requests import CHAT, COMPLETIONS, EMBEDDINGS
from kvfleet.router.state import RouterState

router = APIRouter(tags=["openai"])


async def _forward(path: str, request: Request) -> Response:
    state: RouterState = request.app.state.router
    ex = await pipeline.admit(
        state, pipeline.credentials(request.headers), path, await request.body(), request.headers
    )
    return await proxy.serve(state, ex)


def proxied(path: str) -> Callable[[Request], Awaitable[Response]]:
    """The handler of a proxied ``POST path``: admitted by the pipeline, then relayed."""

    async def handler(request: Request) -> Response:
        return await _forward(path, request)

    return handler


async def completions(request: Request) -> Response:
    return await _forward(COMPLETIONS, request)


async def chat_completions(request: Request) -> Response:
    return await _forward(CHAT, request)


async def embeddings(request: Request) -> Response:
    return await _forward(EMBEDDINGS, request)


router.add_route(COMPLETIONS, completions, methods=["POST"], include_in_schema=False)
router.add_route(CHAT, chat_completions, methods=["POST"], include_in_schema=False)
router.add_route(EMBEDDINGS, embeddings, methods=["POST"], include_in_schema=False)
