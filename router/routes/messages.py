"""``POST /v1/messages``, ``/v1/messages/count_tokens``, ``/tokenize``, ``/detokenize``: the other proxied routes.

Where it sits: beside :mod:`kvfleet.router.routes.completions` and as plain: the tenant's key
(``x-api-key``, as the ``anthropic`` SDK sends it, or ``Authorization: Bearer``), the admission
pipeline (:func:`kvfleet.router.pipeline.admit`, the body read by
:mod:`kvfleet.router.anthropic`), then the relay (:func:`kvfleet.router.proxy.serve`). Errors go
out in Anthropic's shape (:class:`kvfleet.anthropic_api.AnthropicErrors`, installed on the app).
``/tokenize`` and ``/detokenize`` (vLLM's) take the same way, their bodies read by
:mod:`kvfleet.router.tokenize`.
"""

from __future__ import annotations

from fastapi import APIRouter, Request, Response

from kvfleet.anthropic_api import COUNT_TOKENS, MESSAGES
from kvfleet.router import pipeline, proxy
from kvfleet.router.state import RouterState
from kvfleet.router.tokenize import DETOKENIZE, TOKENIZE

router = APIRouter(tags=["anthropic"])


async def _forward(path: str, request: Request) -> Response:
    state: RouterState = request.app.state.router
    credentials = pipeline.credentials(request.headers)
    ex = await pipeline.admit(state, credentials, path, await request.body(), request.headers)
    return await proxy.serve(state, ex)


async def messages(request: Request) -> Response:
    return await _forward(MESSAGES, request)


async def count_tokens(request: Request) -> Response:
    return await _forward(COUNT_TOKENS, request)


async def tokenize(request: Request) -> Response:
    return await _forward(TOKENIZE, request)


async def detokenize(request: Request) -> Response:
    return await _forward(DETOKENIZE, request)


router.add_route(MESSAGES, messages, methods=["POST"], include_in_schema=False)
router.add_route(COUNT_TOKENS, count_tokens, methods=["POST"], include_in_schema=False)
router.add_route(TOKENIZE, tokenize, methods=["POST"], include_in_schema=False)
router.add_route(DETOKENIZE, detokenize, methods=["POST"], include_in_schema=False)
